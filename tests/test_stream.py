"""Streaming export: the pruned checkpoint written from the source's safetensors files tensor by tensor is the
checkpoint written from the pruned model in memory (every tensor equal), for every supported family and layout,
from a sharded source into shards; verified against the ablated original after the original's weights are released."""
import dataclasses

import pytest
import torch
from helpers import EVEN, UNEVEN
from safetensors import safe_open
from tiny import FAMILIES, tiny_model

from exporters.export import ExportOptions, export_pruned
from exporters.stream import INDEX, streamable
from prune_heads.models.loading import load_model

# OLMo-2's q/k norms span all heads: its streamed per-layer export is checked beside the masked one.
LAYOUTS = {"olmo2": ("uniform", "per-layer", "masked")}


def _tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _source(tmp_path, family):
    lm = tiny_model(family)
    lm.model.save_pretrained(tmp_path / "src", max_shard_size="100KB")  # several shards
    lm.tokenizer.save_pretrained(tmp_path / "src")
    return load_model(str(tmp_path / "src"), "float32", "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_export_equals_the_export_from_memory(family, tmp_path):
    lm = _source(tmp_path, family)
    assert (tmp_path / "src" / INDEX).is_file() and streamable(lm)
    for layout in LAYOUTS.get(family, ("uniform", "per-layer")):
        heads = EVEN if layout == "uniform" else UNEVEN
        memory = dataclasses.replace(lm, source=dataclasses.replace(lm.source, kind="embedded"))  # not streamable
        a, b = tmp_path / f"{layout}-stream", tmp_path / f"{layout}-memory"
        a.mkdir(), b.mkdir()
        streamed = export_pruned(lm, heads, a, ExportOptions(layout=layout, max_shard_size="100KB", progress=False, measure_speed=False))
        written = export_pruned(memory, heads, b, ExportOptions(layout=layout, max_shard_size="100KB", progress=False, measure_speed=False))
        assert streamed.verification["streamed"] and not written.verification["streamed"]
        assert streamed.verification["max_abs_logit_diff"] <= streamed.verification["tolerance"]
        x, y = _tensors(a), _tensors(b)
        assert x.keys() == y.keys(), family
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (family, layout, k)
        assert (a / INDEX).is_file() == (b / INDEX).is_file()
        assert streamed.stats == written.stats


def test_the_source_is_released_before_the_reload(tmp_path):
    lm = _source(tmp_path, "qwen2")
    out = tmp_path / "out"
    out.mkdir()
    result = export_pruned(lm, EVEN, out, ExportOptions(layout="uniform", max_shard_size="2GB", progress=False, release_source=True))
    v = result.verification
    assert v["source_released"] and v["streamed"] and v["max_abs_logit_diff"] <= v["tolerance"]
    assert all(p.device.type == "meta" for p in lm.model.parameters())  # gone before the reload came in
    assert result.speed and result.speed["prefill_speedup"] > 0  # timed while the pruned copy shared the weights


def test_shards_copy_source_bytes_file_to_file_and_write_cast_tensors_beside_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from exporters.stream import ShardEntry, source_layout, write_safetensors

    src = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.tensor(2.5), "d": torch.randn(4, 2).bfloat16()}
    save_file(src, str(tmp_path / "src.safetensors"))
    layout = source_layout(tmp_path / "src.safetensors")
    assert {k: (e.dtype, e.shape) for k, e in layout.items()} == {
        "a": ("F32", (3, 5)), "b": ("I64", (7,)), "c": ("F32", ()), "d": ("BF16", (4, 2))}
    cast = torch.randn(2, 3).bfloat16()
    entries = {"d": layout["d"], "x": ShardEntry("BF16", (2, 3), cast),
               "a": layout["a"], "c": layout["c"], "b": layout["b"]}
    write_safetensors(tmp_path / "out.safetensors", entries, {"format": "pt"})
    got = load_file(str(tmp_path / "out.safetensors"))  # safetensors validates header, offsets and sizes
    assert got.keys() == {"a", "b", "c", "d", "x"}
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k
    assert torch.equal(got["x"], cast)
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.slow
def test_a_streamed_export_in_another_dtype_casts_what_it_cannot_copy(tmp_path):
    lm = _source(tmp_path, "llama")  # float32 files
    bf16 = load_model(str(tmp_path / "src"), "bfloat16", "cpu")
    memory = dataclasses.replace(bf16, source=dataclasses.replace(bf16.source, kind="embedded"))
    a, b = tmp_path / "stream", tmp_path / "memory"
    a.mkdir(), b.mkdir()
    streamed = export_pruned(bf16, EVEN, a, ExportOptions(layout="uniform", max_shard_size="100KB", progress=False, measure_speed=False))
    export_pruned(memory, EVEN, b, ExportOptions(layout="uniform", max_shard_size="100KB", progress=False, measure_speed=False))
    assert streamed.verification["streamed"] and lm.dtype == torch.float32
    x, y = _tensors(a), _tensors(b)
    assert x.keys() == y.keys() and all(x[k].dtype == torch.bfloat16 and torch.equal(x[k], y[k]) for k in x)


def test_spans_are_copied_through_a_buffer_where_the_kernel_cannot_copy(tmp_path, monkeypatch):
    """Without ``copy_file_range`` (other systems) or where it refuses the pair of files, the same file results."""
    import errno
    import os

    from safetensors.torch import load_file, save_file

    import exporters.stream as stream

    src = {"a": torch.randn(64, 33), "b": torch.randn(5).bfloat16()}
    save_file(src, str(tmp_path / "src.safetensors"))
    layout = stream.source_layout(tmp_path / "src.safetensors")
    monkeypatch.setattr(stream, "COPY_CHUNK", 1000)  # several blocks per tensor

    def refuse(*a):
        raise OSError(errno.EXDEV, "cross-device")

    for name, copy in (("absent", None), ("refused", refuse)):
        if copy is None:
            monkeypatch.delattr(os, "copy_file_range", raising=False)
        else:
            monkeypatch.setattr(os, "copy_file_range", copy, raising=False)
        stream.write_safetensors(tmp_path / f"{name}.safetensors", layout, {"format": "pt"})
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        assert all(torch.equal(got[k], src[k]) for k in src), name
