"""Write the pruned checkpoint straight from the source's safetensors files, one tensor at a time (``safe_open``):
never a second copy of the model, and no copy at all of a model that is offloaded to disk.

Every tensor outside the pruned layers' attention is passed through under its own name: copied from the source
file into the output by the kernel (``copy_file_range``) when it already has the export's dtype, else read and cast.
Read through a mapping of the source instead, a shard's worth of pages would count in the resident set a second
time beside the loaded model's own mapping of the same files (Qwen2-0.5B in bf16: +474 MiB while a 470 MB shard
was written, the main command's peak).

A pruned layer's attention is rebuilt on an empty (``meta``) copy of the model's skeleton: that one module is
filled from the source tensors and sliced by the same code that prunes a model in memory
(``plan.slicing.apply_layer_plan``), and its state dict is written in place of the original's. Output shards are cut at
``max_shard_size`` with the index ``from_pretrained`` reads, as ``save_pretrained`` writes them.
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from prune_heads.io.files import write_json
from prune_heads.models.checks import INDEX, SINGLE, checkpoint_files, checkpoint_weight_map
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.planner import PrunePlan
from prune_heads.plan.slicing import apply_layer_plan


def source_directory(lm: LoadedModel) -> Path | None:
    """The local directory of a safetensors source (a directory, or a Hub snapshot already downloaded)."""
    if lm.source.kind == "directory":
        return Path(lm.source.path)
    if lm.source.kind == "hub":
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(lm.source.path, revision=lm.source.revision, local_files_only=True,
                                          allow_patterns=["*.safetensors", INDEX]))
        except Exception:  # noqa: BLE001  (not in the cache as files: fall back to writing from memory)
            return None
    return None


def weight_map(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, for the files transformers loaded (the single file first,
    else the index's shards: ``checkpoint_files``); None without either."""
    if checkpoint_files(directory, str(directory)) is None:
        return None
    return checkpoint_weight_map(directory, str(directory))


def _skeleton(lm: LoadedModel) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(lm.config)


def streamable(lm: LoadedModel) -> dict[str, Path] | None:
    """The source's weight map when the export can be written from it: plain safetensors whose names are the
    model's own state-dict names (no renaming on load, no quantisation); else None (write from memory)."""
    directory = source_directory(lm)
    files = weight_map(directory) if directory is not None else None
    if files is None or getattr(lm.config, "quantization_config", None):
        return None
    tied = {"lm_head.weight"} if getattr(lm.config, "tie_word_embeddings", False) else set()
    needed = set(lm.model.state_dict()) - tied
    return files if needed <= set(files) and set(files) <= needed | tied else None


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
COPY_CHUNK = 16 << 20  # bytes per copy (and the buffer where the kernel cannot copy)


@dataclass(frozen=True)
class SourceSpan:
    """A tensor's bytes in a source file, copied into the output by the kernel, never read into this process:
    read through ``safe_open`` (a mapping of the file), a shard's worth of source pages would count in this
    process's resident set a second time beside the loaded model's own mapping of the same file."""

    path: Path
    start: int  # absolute offset of the tensor's first byte
    nbytes: int


@dataclass(frozen=True)
class ShardEntry:
    dtype: str  # safetensors' name of the dtype
    shape: tuple[int, ...]
    data: "torch.Tensor | SourceSpan"

    @property
    def nbytes(self) -> int:
        data = self.data
        return data.nbytes if isinstance(data, SourceSpan) else data.numel() * data.element_size()


def source_layout(path: Path) -> dict[str, ShardEntry]:
    """Every tensor of a safetensors file as a :class:`ShardEntry` of its bytes' span in the file (header only read)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes); re-download the checkpoint")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    start = 8 + length
    return {name: ShardEntry(h["dtype"], tuple(h["shape"]), SourceSpan(path, start + h["data_offsets"][0],
                                                                         h["data_offsets"][1] - h["data_offsets"][0]))
            for name, h in header.items()}


def write_safetensors(path: Path, entries: dict[str, ShardEntry], metadata: dict[str, str]) -> None:
    """A safetensors file of ``entries`` in order (header, then each tensor's bytes): tensors written from memory,
    spans copied file to file (``copy_file_range``)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, e in entries.items():
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with open(path, "wb") as out:
        out.write(len(blob).to_bytes(8, "little") + blob)
        for e in entries.values():
            if isinstance(e.data, SourceSpan):
                _copy_span(e.data, out)
            else:
                out.write(memoryview(e.data.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _copy_span(span: SourceSpan, out) -> None:
    """``span``'s bytes appended to ``out``: by ``copy_file_range`` where the system has it for these two files,
    else through one bounded buffer (other systems, or file systems the kernel will not copy between)."""
    out.flush()
    done = 0
    with open(span.path, "rb") as src:
        copy = getattr(os, "copy_file_range", None)
        try:
            while copy is not None and done < span.nbytes:
                n = copy(src.fileno(), out.fileno(), min(COPY_CHUNK, span.nbytes - done), span.start + done)
                if n <= 0:
                    raise EOFError(f"{span.path}: the source ended {span.nbytes - done} bytes early")
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
        src.seek(span.start + done)
        while done < span.nbytes:
            block = src.read(min(COPY_CHUNK, span.nbytes - done))
            if not block:
                raise EOFError(f"{span.path}: the source ended {span.nbytes - done} bytes early")
            out.write(block)
            done += len(block)


class _Shards:
    """Output shards of at most ``limit`` bytes, named and indexed as ``save_pretrained`` names them."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.pending: dict[str, ShardEntry] = {}
        self.size, self.written = 0, []

    def add(self, name: str, entry: "torch.Tensor | ShardEntry") -> None:
        if not isinstance(entry, ShardEntry):  # a tensor in memory (cast, or a pruned attention's)
            entry = ShardEntry(SAFETENSORS_DTYPES[entry.dtype], tuple(entry.shape), entry)
        if self.pending and self.size + entry.nbytes > self.limit:
            self.flush()
        self.pending[name] = entry
        self.size += entry.nbytes

    def flush(self) -> None:
        if self.pending:
            path = self.out / f".shard-{len(self.written):05d}.tmp"
            write_safetensors(path, self.pending, {"format": "pt"})
            self.written.append((path, list(self.pending)))
            self.pending, self.size = {}, 0

    def finish(self) -> list[Path]:
        self.flush()
        if len(self.written) == 1:
            os.replace(self.written[0][0], self.out / SINGLE)
            return [self.out / SINGLE]
        total, names, paths = len(self.written), {}, []
        for i, (tmp, keys) in enumerate(self.written):
            final = self.out / f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(tmp, final)
            paths.append(final)
            names.update({k: final.name for k in keys})
        size = sum(p.stat().st_size for p in paths)
        write_json(self.out / INDEX, {"metadata": {"total_size": size}, "weight_map": dict(sorted(names.items()))})
        return paths


def stream_export(lm: LoadedModel, plan: PrunePlan, files: dict[str, Path], out: Path, max_shard_bytes: int,
                  dtype: torch.dtype) -> dict:
    """Write the pruned weights of ``plan`` from ``files`` (``streamable``) into ``out``; returns the number of
    parameters written and read, and the shard files. Tensors outside the pruned attention that already have the
    export's dtype are copied from file to file by the kernel; at most one cast source tensor, one attention module
    and the cast tensors of one output shard are in memory at a time."""
    skeleton, arch = _skeleton(lm), lm.arch
    prefixes = {i: _prefix(skeleton, arch.attention(skeleton, i)) for i, lp in enumerate(plan.layers)
                if not lp.is_identity}
    handles: dict[Path, object] = {}
    shards = _Shards(out, max_shard_bytes)
    done: set[int] = set()
    def read(name: str) -> torch.Tensor:
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), "pt")
        return handles[files[name]].get_tensor(name)

    try:
        for source in dict.fromkeys(files.values()):  # file by file, each closed once read
            layout = source_layout(source)
            for name in (n for n, f in files.items() if f == source):
                layer = next((i for i, p in prefixes.items() if name.startswith(p)), None)
                if layer is None and layout[name].dtype == SAFETENSORS_DTYPES[dtype]:
                    shards.add(name, layout[name])  # as it is in the source: copied file to file
                elif layer is None:
                    shards.add(name, read(name).to(dtype))
                elif layer not in done:
                    for key, tensor in _pruned_attention(skeleton, arch, layer, plan.layers[layer], prefixes[layer],
                                                         read).items():
                        shards.add(key, tensor.to(dtype))
                    done.add(layer)
            handles.clear()
        paths = shards.finish()
    finally:
        for f in out.glob(".shard-*.tmp"):
            f.unlink()
    return {"files": [p.name for p in paths]}


def _prefix(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module) + "."


def _pruned_attention(skeleton, arch, layer: int, lp, prefix: str, read) -> dict[str, torch.Tensor]:
    """One layer's attention, filled from the source and pruned by ``apply_layer_plan``: its new state dict."""
    attn = arch.attention(skeleton, layer).to_empty(device="cpu")
    with torch.no_grad():
        for key, value in attn.state_dict(keep_vars=True).items():
            value.copy_(read(prefix + key))
    apply_layer_plan(skeleton, arch, layer, lp)
    new = arch.attention(skeleton, layer) if lp.slots else arch.decoder_layers(skeleton)[layer].self_attn
    state = {prefix + k: v.detach() for k, v in new.state_dict().items()}
    arch.decoder_layers(skeleton)[layer].self_attn = new.to("meta")  # release this layer's tensors
    return state
