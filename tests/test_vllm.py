"""Exports run in vLLM (CPU) through prune-heads' plugin and compared with the verified model: a uniform export
(stock vLLM Llama), per-layer exports of every family vLLM serves natively, shaped like their real checkpoints (uneven
head counts, a whole KV group removed, a layer left with no attention, Qwen2's biases), each against the original
model run in vLLM's own class as the reference for the tolerance; and the embedded SmolLM2's per-layer export.

vLLM pins its own transformers, so it runs in an environment of its own, named by $PRUNE_HEADS_VLLM_PYTHON (set-up in
the README). Without one these tests skip, except where $PRUNE_HEADS_REQUIRE_VLLM is set (CI): there they fail."""
from __future__ import annotations

import json
import os

import pytest
import torch
from tiny import REAL_SHAPES, tiny_model, uneven_heads

from exporters.export import ExportOptions, export_pruned
from exporters.runtimes.vllm_check import VllmPair, VllmRequest, check_in_vllm, vllm_python
from prune_heads.heads import HeadSet

PYTHON = vllm_python()
if PYTHON is None and os.environ.get("PRUNE_HEADS_REQUIRE_VLLM"):
    raise RuntimeError("PRUNE_HEADS_REQUIRE_VLLM is set but no vLLM was found: set PRUNE_HEADS_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(PYTHON is None, reason="no vLLM: set PRUNE_HEADS_VLLM_PYTHON (README, vLLM)")
PROMPTS = ((1, 17, 45, 3, 99, 120, 7, 64, 5, 200, 31, 8), (1, 250, 12, 12, 90, 4, 33, 77), (1, 6, 6, 300, 2, 140))
REQUEST = VllmRequest(PROMPTS, greedy_tokens=6, max_model_len=128)


def _original(lm, tmp_path):
    directory = tmp_path / "original"
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return VllmPair(directory, lm.model)


def _export(lm, heads, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    out = tmp_path / layout
    out.mkdir()
    result = export_pruned(lm, heads, out, ExportOptions(layout=layout, progress=False, measure_speed=False))
    assert result.choice.layout == layout
    return VllmPair(out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()), result


def _assert_verified(record, architecture):
    assert record["architecture"] == architecture
    assert record["greedy_equal"] == len(PROMPTS) and record["unpruned"]["greedy_equal"] == len(PROMPTS)
    assert record["max_abs_logprob_diff"] <= record["tolerance"] and record["verified"], record


def test_a_uniform_llama_export_runs_in_stock_vllm(tmp_path):
    lm = tiny_model("llama", **REAL_SHAPES["llama"])
    heads = HeadSet.of({i: [i % 3, 3 + (i % 3)] for i in range(4)})  # one head per KV group everywhere: (4, 2)
    original = _original(lm, tmp_path)
    export, _ = _export(lm, heads, tmp_path, "uniform")
    assert json.loads((export.directory / "config.json").read_text())["model_type"] == "llama"
    _assert_verified(check_in_vllm(PYTHON, original, export, REQUEST), "LlamaForCausalLM")


@pytest.mark.parametrize("family", sorted(REAL_SHAPES))
def test_per_layer_exports_run_in_vllm_through_the_plugin(family, tmp_path):
    shape = REAL_SHAPES[family]
    lm = tiny_model(family, **shape)
    original = _original(lm, tmp_path)
    export, result = _export(lm, uneven_heads(shape["num_attention_heads"], shape["num_key_value_heads"]), tmp_path,
                             "per-layer")
    heads = json.loads((export.directory / "config.json").read_text())["per_layer_heads"]
    assert heads[3] == [0, 0] and heads[1] == [shape["num_attention_heads"], shape["num_key_value_heads"]]
    assert result.stats["after"]["parameters"] < result.stats["before"]["parameters"]
    record = check_in_vllm(PYTHON, original, export, REQUEST)
    _assert_verified(record, f"Pruned{type(lm.model).__name__}")


@pytest.mark.slow
def test_the_embedded_smollm2_per_layer_export_runs_in_vllm_with_the_same_greedy_text(tmp_path):
    """The embedded SmolLM2-135M (dequantised float32): a per-layer export (layers 0-9 keep 6 of 9 query heads, layer
    29 none) and the original in vLLM through its Llama class; the export's greedy text equals transformers'."""
    from prune_heads.models import load_model

    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    heads = HeadSet.of({**{i: [0, 3, 6] for i in range(10)}, 29: list(range(9))})
    original = _original(lm, tmp_path)
    export, _ = _export(lm, heads, tmp_path, "per-layer")
    prompt = tuple(lm.tokenizer("The capital of France is")["input_ids"])
    request = VllmRequest((prompt, tuple(lm.tokenizer("def fibonacci(n):")["input_ids"])), greedy_tokens=12,
                          max_model_len=256, throughput={"batch": 8, "prompt_tokens": 128, "decode_tokens": 16})
    record = check_in_vllm(PYTHON, original, export, request)
    assert record["architecture"] == "PrunedLlamaForCausalLM" and record["verified"], record
    assert record["speed"]["prefill_speedup"] > 0 and record["speed"]["decode_speedup"] > 0
    print(json.dumps({k: v for k, v in record.items() if k != "unpruned"} | {"unpruned": record["unpruned"]}))
