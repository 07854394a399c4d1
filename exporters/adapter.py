"""Slice a peft LoRA adapter trained on the unpruned base so that it fits a pruned export, using the export's plan.

For each layer: q_proj's lora_B rows follow the query slots, k_proj/v_proj's follow the KV slots (copied KV heads
copy their rows, zero heads get zero rows), and o_proj's lora_A columns follow the query slots (removed or zero
heads get zero columns). LoRA biases and DoRA magnitudes of q/k/v are sliced like their rows. A layer that kept no
heads keeps no attention adapter. DoRA on o_proj is refused: its column norms change when columns go; so is DoRA on
q_proj when the export has zero padding heads, whose row norms are zero.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prune_heads.errors import UserError
from prune_heads.fileio import atomic_write, write_json
from prune_heads.pruning import _rows

from .export import read_manifest

_KEY = re.compile(r"\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)\.(.+)$")


def _slice(name: str, proj: str, tensor: torch.Tensor, layer: dict) -> torch.Tensor:
    d = layer["original"]["head_dim"]
    q_slots, kv_slots = layer["query_slots"], layer["kv_slots"]
    zero = set(layer["zero_output"])
    is_a = ".lora_A." in name or name.endswith("lora_A.weight")
    if proj == "o_proj":
        if "magnitude" in name:
            raise UserError("DoRA on o_proj cannot be sliced exactly (its column norms change); re-train without "
                            "o_proj in target_modules, or use --layout masked for the base")
        if not is_a:  # lora_B and lora biases of o_proj act on the hidden size, which does not change
            return tensor
        cols = [None if h is None or h in zero else h for h in q_slots]
        return _rows(tensor.T, cols, d).T.contiguous()
    if is_a:  # lora_A of q/k/v acts on the (unchanged) hidden size
        return tensor
    if "magnitude" in name and proj in ("q_proj", "qkv_proj") and any(h is None for h in q_slots):
        # DoRA divides by the norm of each row of W + BA; a zero padding head's rows are all zero, so that is 0 / 0.
        raise UserError("this adapter uses DoRA on the query projection, and the export pads some layers with zero "
                        "query heads, whose DoRA norm would be 0 / 0 (NaN); export with --layout masked, or use a LoRA "
                        "adapter without DoRA on q_proj")
    if proj == "qkv_proj":  # fused [q | k | v] rows (Phi-3)
        h, kv = layer["original"]["num_heads"], layer["original"]["num_kv_heads"]
        q, k, v = tensor[: h * d], tensor[h * d:(h + kv) * d], tensor[(h + kv) * d:]
        return torch.cat([_rows(q, q_slots, d), _rows(k, kv_slots, d), _rows(v, kv_slots, d)]).contiguous()
    return _rows(tensor, q_slots if proj == "q_proj" else kv_slots, d).contiguous()


def slice_adapter(adapter_dir: str | Path, pruned_dir: str | Path, out: str | Path, log=print) -> Path:
    adapter_dir, pruned_dir, out = Path(adapter_dir), Path(pruned_dir), Path(out)
    meta = read_manifest(pruned_dir)
    cfg_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise UserError(f"{adapter_dir} is not a peft adapter (needs adapter_config.json and adapter_model.safetensors)")
    config = json.loads(cfg_path.read_text())
    if config.get("peft_type") != "LORA":
        raise UserError(f"{adapter_dir} is a {config.get('peft_type')} adapter; only LoRA (and DoRA) adapters can be sliced")
    layers = meta["plan"]["layers"]
    state = load_file(str(weights_path))
    sliced = {}
    for name, tensor in state.items():
        m = _KEY.search(name)
        if not m:
            sliced[name] = tensor  # not attention (MLP, embeddings): unchanged
            continue
        layer = layers[int(m.group(1))]
        if not layer["query_slots"]:
            continue  # the layer's attention was removed entirely
        sliced[name] = _slice(name, m.group(2), tensor, layer)
    config["base_model_name_or_path"] = str(pruned_dir.resolve())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "adapter_model.safetensors", lambda tmp: save_file(sliced, tmp, metadata={"format": "pt"}))
    write_json(out / "adapter_config.json", config)
    log(f"sliced {len(state)} adapter tensors to {len(sliced)} for {pruned_dir}: {out}")
    return out
