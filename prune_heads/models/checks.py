"""Sanity checks of a model's config and checkpoint before anything proportional to them is allocated: head counts
that can exist, a layer count the weights hold, projections whose shapes fit the heads, safetensors headers that are
whole. Read from config.json and the safetensors headers only (a few KiB), never the weights."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from prune_heads.errors import UserError
from prune_heads.runtime import HEADS_FIELD

MAX_LAYERS = 4096
MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_config(config, spec: str) -> None:
    """Head counts, sizes and layer counts that a model can have (any config object: from config.json or GGUF)."""
    fields = {name: getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers",
                                                             "num_attention_heads", "vocab_size")}
    fields["num_key_value_heads"] = getattr(config, "num_key_value_heads", None) or fields["num_attention_heads"]
    for name, value in fields.items():
        if not _positive(value):
            raise UserError(f"the config of {spec!r} has {name} = {value!r}; it must be a positive integer; fix "
                            "config.json or pass another model")
    if fields["num_hidden_layers"] > MAX_LAYERS:
        raise UserError(f"the config of {spec!r} has num_hidden_layers = {fields['num_hidden_layers']}, more than "
                        f"any model has (at most {MAX_LAYERS}); fix config.json")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise UserError(f"the config of {spec!r} has num_key_value_heads = {fields['num_key_value_heads']}, which "
                        f"does not divide num_attention_heads = {fields['num_attention_heads']}; fix config.json")
    for name in ("head_dim", "max_position_embeddings"):  # optional, but never zero, negative or a fraction
        value = getattr(config, name, None)
        if value is not None and not _positive(value):
            raise UserError(f"the config of {spec!r} has {name} = {value!r}; it must be a positive integer; fix "
                            "config.json or pass another model")


FINITE_CHUNK = 1 << 20  # elements checked at a time: the check's own memory stays a few MiB on any model


def _chunks(tensor):
    """``tensor``'s values in pieces of at most ``FINITE_CHUNK``, as views where it is contiguous (no copy)."""
    if tensor.is_contiguous():
        flat = tensor.view(-1)
        return (flat[lo:lo + FINITE_CHUNK] for lo in range(0, flat.numel(), FINITE_CHUNK))
    return (row.reshape(-1) for row in tensor)  # one row of a strided tensor copied at a time


def check_finite(tensors, spec: str, what: str = "weights") -> None:
    """Every value of ``tensors`` ((name, tensor) pairs) is a finite number; else one line naming the first tensor
    that is not. A NaN or infinity in the weights makes every logit NaN, and a NaN compares as no difference at all,
    so it is refused before any pass. Tensors on the meta device (offloaded to disk by accelerate) are skipped.
    Read a piece at a time: a piece's sum (accumulated in float32) is finite when its values are (a NaN or infinity
    carries through), and only a piece whose sum is not is searched value by value."""
    import torch

    for name, tensor in tensors:
        if tensor.device.type == "meta" or not tensor.is_floating_point():
            continue
        for part in _chunks(tensor.detach()):
            if bool(torch.isfinite(part.sum())) or bool(torch.isfinite(part).all()):
                continue
            bad = part[~torch.isfinite(part)][0].item()
            raise UserError(f"the {what} of {spec!r} hold {bad} in {name}; a model with NaN or infinite weights "
                            "computes nothing that can be verified: fix or re-download the checkpoint")


def safetensors_header(path: Path, spec: str) -> dict:
    """The JSON header of a safetensors file, checked to be whole: its tensors lie inside the file."""
    size = path.stat().st_size
    bad = f"could not load model {spec!r}: {path.name} is corrupt"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{bad} (shorter than a safetensors header); re-download or re-save the checkpoint")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER, size - 8):
            raise UserError(f"{bad} (its header claims {length} bytes, the file has {size}); re-download it")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{bad} (its header is not valid JSON); re-download or re-save the checkpoint") from None
    if not isinstance(header, dict):
        raise UserError(f"{bad} (its header is not a JSON object); re-download or re-save the checkpoint")
    data = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise UserError(f"{bad} (tensor {name} lies outside the file: truncated?); re-download the checkpoint")
    return header


GGUF_MAGIC, GGUF_VERSIONS = b"GGUF", (2, 3)
GGUF_MIN_TENSOR_INFO, GGUF_MIN_KV = 32, 13  # bytes: name length, dims, type, offset; key length, type, a value


def check_gguf_header(path: Path, spec: str) -> None:
    """A GGUF's fixed header read before any library parses it: the magic, a version llama.cpp writes, and counts of
    tensors and metadata entries that the file's size can hold (a crafted count would have a parser loop or
    allocate for ever)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    bad = f"GGUF file {spec} is corrupt"
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise UserError(f"{bad}: it does not start with a GGUF header; re-download or re-convert it")
    version, tensors, kv = struct.unpack("<IQQ", head[4:])
    if version not in GGUF_VERSIONS:
        raise UserError(f"{bad}: its header says GGUF version {version}, not one of {GGUF_VERSIONS}; re-convert it "
                        "with a current llama.cpp")
    if 24 + tensors * GGUF_MIN_TENSOR_INFO + kv * GGUF_MIN_KV > size:
        raise UserError(f"{bad}: its header claims {tensors:,} tensors and {kv:,} metadata entries, more than a file "
                        f"of {size:,} bytes can describe; re-download or re-convert it")


SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def checkpoint_files(directory: Path, spec: str) -> list[Path] | None:
    """The safetensors files that form the checkpoint in ``directory``, chosen as transformers chooses them (the
    single file first, else the index's shards), every one of them present; None when it has neither. Loading,
    checking and the streamed export all read these, so they never read different weights."""
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    if not (directory / INDEX).is_file():
        return None
    return sorted(set(checkpoint_weight_map(directory, spec).values()))


def checkpoint_weight_map(directory: Path, spec: str) -> dict[str, Path]:
    """Tensor name -> the file holding it, for the checkpoint :func:`checkpoint_files` chooses (its index's map, or
    the single file's header); a UserError naming a shard the index lists that is missing or not a plain name."""
    from prune_heads.io.readers import read_json

    if (directory / SINGLE).is_file():
        return {name: directory / SINGLE for name in safetensors_header(directory / SINGLE, spec)
                if name != "__metadata__"}
    index = read_json(directory / INDEX, "safetensors index")
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UserError(f"the checkpoint of {spec!r} has an {INDEX} without a weight_map of file names; re-download "
                        "the checkpoint")
    for shard in sorted(set(mapping.values())):
        if Path(shard).name != shard or not (directory / shard).is_file():
            raise UserError(f"the checkpoint of {spec!r} is incomplete: its {INDEX} names the shard {shard!r}, which "
                            f"is not in {directory}; download the missing shards")
    return {name: directory / shard for name, shard in mapping.items()}


def _raw_int(raw: dict, name: str, spec: str, default=None):
    value = raw.get(name, default)
    if value is not None and not _positive(value):
        raise UserError(f"the config of {spec!r} has {name} = {value!r}; it must be a positive integer; fix "
                        "config.json or pass another model")
    return value


def check_checkpoint(source, raw: dict) -> None:
    """config.json against the safetensors headers of a local directory, before transformers builds anything."""
    spec = source.spec
    if not isinstance(raw, dict):
        raise UserError(f"the config.json of {spec!r} is not a JSON object; fix it")
    if raw.get("per_layer_config") or raw.get(HEADS_FIELD):
        raise UserError(f"{spec!r} has different attention head counts per layer (an already pruned per-layer "
                        "export?); prune-heads scores and prunes stock models: pass the original model, or a uniform "
                        "export")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    layers, heads = _raw_int(text, "num_hidden_layers", spec), _raw_int(text, "num_attention_heads", spec)
    hidden = _raw_int(text, "hidden_size", spec)
    kv, head_dim = _raw_int(text, "num_key_value_heads", spec, heads), _raw_int(text, "head_dim", spec)
    if layers is not None and layers > MAX_LAYERS:
        raise UserError(f"the config of {spec!r} has num_hidden_layers = {layers}, more than any model has (at "
                        f"most {MAX_LAYERS}); fix config.json")
    if heads and kv and heads % kv:
        raise UserError(f"the config of {spec!r} has num_key_value_heads = {kv}, which does not divide "
                        f"num_attention_heads = {heads}; fix config.json")
    headers = {}
    for f in checkpoint_files(Path(source.path), spec) or []:
        headers.update(safetensors_header(f, spec))
    if not headers:
        return
    present = {int(m.group(1)) for name in headers for m in [_LAYER.search(name)] if m}
    if layers is not None and present and layers != len(present):
        raise UserError(f"the config of {spec!r} has num_hidden_layers = {layers}, but the weights hold "
                        f"{len(present)} layers; fix config.json or pass the matching checkpoint")
    head_dim = head_dim or (hidden // heads if hidden and heads else None)
    _check_embedding(headers, spec, _raw_int(text, "vocab_size", spec), hidden)
    _check_rows(headers, spec, "q_proj", "num_attention_heads", heads, head_dim)
    _check_rows(headers, spec, "k_proj", "num_key_value_heads", kv, head_dim)


def _check_embedding(headers: dict, spec: str, vocab, hidden) -> None:
    """The embedding matrix is ``vocab_size x hidden_size`` as config.json says."""
    info = next((v for k, v in headers.items() if k.endswith("embed_tokens.weight")), None)
    shape = info.get("shape") if isinstance(info, dict) else None
    if not shape or len(shape) != 2:
        return
    for field, value, actual in (("vocab_size", vocab, shape[0]), ("hidden_size", hidden, shape[1])):
        if value and value != actual:
            raise UserError(f"the config of {spec!r} has {field} = {value:,}, but the embedding weights are "
                            f"{shape[0]:,} x {shape[1]:,}; fix {field} in config.json or pass the matching checkpoint")


def _check_rows(headers: dict, spec: str, proj: str, field: str, count, head_dim) -> None:
    """Layer 0's ``proj`` weight has ``count x head_dim`` rows (families with separate q/k/v projections)."""
    pattern = re.compile(rf"\.layers\.0\.self_attn\.{proj}\.weight$")
    info = next((v for k, v in headers.items() if pattern.search(k)), None)
    if not count or not head_dim or not isinstance(info, dict) or not info.get("shape"):
        return
    rows = info["shape"][0]
    if count * head_dim != rows:
        raise UserError(f"the config of {spec!r} has {field} x head_dim = {count} x {head_dim} = {count * head_dim}, "
                        f"but {proj} has {rows} rows; fix head_dim or {field} in config.json")
