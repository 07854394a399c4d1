"""Where a model's weights live when accelerate places them (``--device-map``): across GPUs, the CPU and disk.

accelerate's big-model inference keeps an offloaded module's weights on the ``meta`` device and brings them in only
for its own forward (an ``AlignDevicesHook``). Code that reads a weight outside that forward (the scoring pass's
Gram matrices of o_proj, OLMo-2's cross-head norm in the ablation) asks here for the real tensor.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from prune_heads import memory
from prune_heads.errors import UserError


def live_weight(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module.<name>`` as a real tensor: from accelerate's offload map when the module's copy is on ``meta``."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    hook = getattr(module, "_hf_hook", None)
    weights = getattr(hook, "weights_map", None)
    if weights is None:
        raise RuntimeError(f"{type(module).__name__}.{name} is offloaded and no weights map holds it")
    value = weights[name]
    execution = getattr(hook, "execution_device", None)
    return value.to(execution) if execution is not None else value


def input_device(model: nn.Module) -> torch.device:
    """Where token ids go in: the embedding's execution device (a device-mapped model may start anywhere)."""
    embed = model.get_input_embeddings()
    hook = getattr(embed, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, torch.device) else device
    return embed.weight.device


PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")


def device_map_option(value: str | None):
    """``--device-map``: one of accelerate's strategies, or a JSON file mapping module names to devices."""
    if value is None or value in PLACEMENTS:
        return value
    from prune_heads.io.readers import read_json

    mapping = read_json(value, "device map")
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, (str, int))
                                                for k, v in mapping.items()):
        raise UserError(f"`device_map` {value} must map module names to devices (\"cuda:0\", 0, \"cpu\", "
                        "\"disk\")")
    return mapping


def max_memory_option(value: str | None) -> dict | None:
    """``--max-memory 0=20GiB,1=20GiB,cpu=60GiB`` as accelerate's ``max_memory`` dict."""
    if not value:
        return None
    out: dict = {}
    for part in value.split(","):
        device, _, size = part.strip().partition("=")
        if not device or not re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]i?B", size.strip(), re.IGNORECASE):
            raise UserError(f"`max_memory` {value!r} is not a list of DEVICE=SIZE; write e.g. 0=20GiB,cpu=60GiB")
        out[int(device) if device.isdigit() else device] = size.strip()
    return out


def release_weights(model: nn.Module) -> None:
    """Free ``model``'s weights (they move to ``meta``) and hand the memory back to the system."""
    model.to("meta")
    memory.policy().between_stages()
