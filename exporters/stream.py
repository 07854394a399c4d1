"""Write the pruned checkpoint straight from the source's safetensors files, one tensor at a time (``safe_open``):
never a second copy of the model, and no copy at all of a model that is offloaded to disk.

Every tensor outside the pruned layers' attention is read, cast to the export's dtype and passed through under its
own name. A pruned layer's attention is rebuilt on an empty (``meta``) copy of the model's skeleton: that one
module is filled from the source tensors and sliced by the same code that prunes a model in memory
(``pruning.apply_layer_plan``), and its state dict is written in place of the original's. Output shards are cut at
``max_shard_size`` with the index ``from_pretrained`` reads, as ``save_pretrained`` writes them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prune_heads.fileio import write_json
from prune_heads.models.loading import LoadedModel
from prune_heads.planning import PrunePlan
from prune_heads.pruning import apply_layer_plan

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


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
    """Tensor name -> the safetensors file holding it, from the index or the single file; None without one."""
    if (directory / INDEX).is_file():
        index = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in index.items()}
    if (directory / SINGLE).is_file():
        with safe_open(str(directory / SINGLE), "pt") as f:
            return {name: directory / SINGLE for name in f.keys()}
    return None


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


class _Shards:
    """Output shards of at most ``limit`` bytes, named and indexed as ``save_pretrained`` names them."""

    def __init__(self, out: Path, limit: int):
        self.out, self.limit = out, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.written, self.parameters = 0, [], 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.parameters += tensor.numel()

    def flush(self) -> None:
        if self.pending:
            path = self.out / f".shard-{len(self.written):05d}.tmp"
            save_file(self.pending, str(path), metadata={"format": "pt"})
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
    parameters written and read, and the shard files. At most one source tensor, one attention module and one output
    shard are in memory at a time."""
    skeleton, arch = _skeleton(lm), lm.arch
    prefixes = {i: _prefix(skeleton, arch.attention(skeleton, i)) for i, lp in enumerate(plan.layers)
                if not lp.is_identity}
    handles: dict[Path, object] = {}
    shards = _Shards(out, max_shard_bytes)
    done: set[int] = set()
    read_parameters = [0]

    def read(name: str) -> torch.Tensor:
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), "pt")
        tensor = handles[files[name]].get_tensor(name)
        read_parameters[0] += tensor.numel()
        return tensor

    try:
        for source in dict.fromkeys(files.values()):  # file by file, each closed once read
            for name in (n for n, f in files.items() if f == source):
                layer = next((i for i, p in prefixes.items() if name.startswith(p)), None)
                if layer is None:
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
    return {"parameters": shards.parameters, "source_parameters": read_parameters[0], "files": [p.name for p in paths]}


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
