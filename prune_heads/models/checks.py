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
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and not _positive(head_dim):
        raise UserError(f"the config of {spec!r} has head_dim = {head_dim!r}; it must be a positive integer")


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
    for f in sorted(Path(source.path).glob("*.safetensors")):
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
