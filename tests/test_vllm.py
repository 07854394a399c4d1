"""Exports run in vLLM (CPU) through prune-heads' plugin and compared with the verified model: a uniform export
(stock vLLM Llama), per-layer exports of every family vLLM serves natively, shaped like their real checkpoints (uneven
head counts, a whole KV group removed, a layer left with no attention, Qwen2's biases), each against the original
model run in vLLM's own class as the reference for the tolerance; and the embedded SmolLM2's per-layer export. Each
goes through the export's own vLLM stage (exporters/runtimes/vllm_check.py), as `prune-heads --vllm-python` runs it.

vLLM pins its own transformers, so it runs in an environment of its own, named by $PRUNE_HEADS_VLLM_PYTHON (set-up in
the README). Without one these tests skip, except where $PRUNE_HEADS_REQUIRE_VLLM is set (CI): there they fail."""
from __future__ import annotations

import json
import os

import pytest
from tiny import REAL_SHAPES, tiny_model, uneven_heads

from exporters.export import ExportOptions, export_pruned
from exporters.manifest import MANIFEST
from exporters.runtimes.vllm_check import UNPRUNED_DIR, vllm_python
from prune_heads.heads import HeadSet

PYTHON = vllm_python(os.environ.get("PRUNE_HEADS_TEST_VLLM_PYTHON"))  # conftest moved $PRUNE_HEADS_VLLM_PYTHON there
if PYTHON is None and os.environ.get("PRUNE_HEADS_REQUIRE_VLLM"):
    raise RuntimeError("PRUNE_HEADS_REQUIRE_VLLM is set but no vLLM was found: set PRUNE_HEADS_VLLM_PYTHON")
pytestmark = [pytest.mark.skipif(PYTHON is None, reason="no vLLM: set PRUNE_HEADS_VLLM_PYTHON (README, vLLM)"),
              pytest.mark.vllm, pytest.mark.slow]


def _export(lm, heads, tmp_path, layout, measure_speed=False):
    """The export with its vLLM stage: the original (saved beside it) and the export run in vLLM, the reload in
    transformers."""
    out = tmp_path / layout
    out.mkdir()
    result = export_pruned(lm, heads, out, ExportOptions(layout=layout, progress=False, measure_speed=measure_speed,
                                                         vllm_python=PYTHON))
    assert result.choice.layout == layout
    return out, result


def _assert_verified(out, result, architecture):
    record = result.vllm
    assert record["architecture"] == architecture
    # Greedy tokens equal, or vLLM's a near-tie of the verified model's (a random tiny model's flat logits leave some on
    # 4 random 96-token prompts; the embedded model's test asks for equality).
    assert record["greedy_equal"] >= record["prompts"] - 1 and record["greedy_max_margin"] <= record["tolerance"]
    assert record["max_abs_logprob_diff"] <= record["tolerance"] and record["verified"], record
    assert json.loads((out / MANIFEST).read_text())["vllm"] == json.loads(json.dumps(record))
    assert f"Run in vLLM {record['vllm']} when written" in (out / "README.md").read_text()
    assert not (out / UNPRUNED_DIR).exists()  # the unpruned copy vLLM ran is gone


@pytest.mark.parametrize("layout", ["uniform", "masked"])
def test_uniform_and_masked_llama_exports_run_in_stock_vllm(layout, tmp_path):
    """The uniform export is also timed in vLLM against the original on a batch (the card says so)."""
    lm = tiny_model("llama", **REAL_SHAPES["llama"])
    heads = HeadSet.of({i: [i % 3, 3 + (i % 3)] for i in range(4)})  # one head per KV group everywhere: (4, 2)
    out, result = _export(lm, heads, tmp_path, layout, measure_speed=layout == "uniform")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_attention_heads"] == (4 if layout == "uniform" else 6)
    _assert_verified(out, result, "LlamaForCausalLM")
    if layout == "uniform":
        speed = result.vllm["speed"]
        assert speed["batch"] == 8 and speed["prompt_tokens"] == 128 and speed["rounds"] == 3
        assert speed["prefill_speedup"] > 0 and speed["decode_speedup"] > 0 and speed["dtype"] == "float32"
        assert "vLLM throughput" in (out / "README.md").read_text()


@pytest.mark.parametrize("family", sorted(REAL_SHAPES))
def test_per_layer_exports_run_in_vllm_through_the_plugin(family, tmp_path):
    shape = REAL_SHAPES[family]
    lm = tiny_model(family, **shape)
    out, result = _export(lm, uneven_heads(shape["num_attention_heads"], shape["num_key_value_heads"]), tmp_path,
                          "per-layer")
    heads = json.loads((out / "config.json").read_text())["per_layer_heads"]
    assert heads[3] == [0, 0] and heads[1] == [shape["num_attention_heads"], shape["num_key_value_heads"]]
    assert result.stats["after"]["parameters"] < result.stats["before"]["parameters"]
    _assert_verified(out, result, f"Pruned{type(lm.model).__name__}")


def test_the_export_command_runs_vllm_on_the_source_directory_itself(tmp_path, capsys, monkeypatch):
    """`prune-heads export --vllm-python` from a safetensors checkpoint: vLLM runs the source directory as the
    unpruned model (no copy is written) and the record reaches prune_heads.json."""
    from tiny import run_cli

    import exporters.runtimes.vllm_check as vllm_check

    def no_copy(*args):
        raise AssertionError("the unpruned model was copied although its source directory loads in vLLM")
    monkeypatch.setattr(vllm_check, "check_space", no_copy)
    lm = tiny_model("llama", **REAL_SHAPES["llama"])  # vLLM's CPU attention takes head_dim 32, not the default 16
    source = tmp_path / "model"
    lm.model.save_pretrained(source)
    lm.tokenizer.save_pretrained(source)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0], "2": [1, 3]}))
    out = tmp_path / "pruned"
    code, _, err = run_cli(["export", "--model", source, "--heads", heads, "--out", out, "--no-task-eval",
                            "--no-progress", "--dtype", "float32", "--vllm-python", PYTHON], capsys)
    assert code == 0, err
    record = json.loads((out / MANIFEST).read_text())["vllm"]
    assert record["verified"] and record["architecture"] == "PrunedLlamaForCausalLM", record
    assert record["max_abs_logprob_diff"] <= record["tolerance"]


def test_an_export_vllm_computes_differently_is_refused(tmp_path, monkeypatch):
    """The check can fail: the export's files changed after the reload was checked (a layer's o_proj negated and
    tripled) are caught in vLLM, and the export is refused."""
    import exporters.export as export_module
    from prune_heads.errors import UserError

    lm = tiny_model("llama", **REAL_SHAPES["llama"])
    heads = HeadSet.of({i: [i % 3, 3 + (i % 3)] for i in range(4)})
    check_reload = export_module._check_reload

    def tamper(lm_, choice, out, shipped, released, placement):
        from safetensors.torch import load_file, save_file

        check_reload(lm_, choice, out, shipped, released, placement)
        path = out / "model.safetensors"
        tensors = load_file(path)
        tensors["model.layers.1.self_attn.o_proj.weight"] *= -3
        save_file(tensors, path, metadata={"format": "pt"})
    monkeypatch.setattr(export_module, "_check_reload", tamper)
    with pytest.raises(UserError, match="does not run in vLLM as the verified model does"):
        _export(lm, heads, tmp_path, "uniform")


@pytest.mark.embedded(processes=2)  # this one and the vLLM process that runs the original, then the export
@pytest.mark.slow
def test_the_embedded_smollm2_per_layer_export_runs_in_vllm_with_the_same_greedy_text(tmp_path):
    """The embedded SmolLM2-135M (dequantised float32): a per-layer export (layers 0-9 keep 6 of 9 query heads, layer
    29 none) and the original in vLLM through its Llama class; the export's greedy text in vLLM equals
    transformers'. (The timing in vLLM is tested on the tiny uniform export: here it would add minutes.)"""
    from prune_heads.models import load_model

    lm = load_model("smollm2-135m", dtype="float32", device="cpu")
    heads = HeadSet.of({**{i: [0, 3, 6] for i in range(10)}, 29: list(range(9))})
    out, result = _export(lm, heads, tmp_path, "per-layer")
    _assert_verified(out, result, "PrunedLlamaForCausalLM")
    record = result.vllm
    assert record["greedy_equal"] == record["prompts"] and record["example"]["vllm"] == record["example"]["transformers"]
    print(json.dumps(record))
