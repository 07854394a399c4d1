"""Zero chosen heads' outputs before o_proj: a context manager that leaves the model untouched on exit.

A PrunePlan can stand in for the mask: its removed heads are zeroed, and for families whose q/k norms act
across heads (OLMo-2) those norms are recomputed over exactly the heads the pruned model keeps (KV copies
counted twice, dummy heads as zeros), so the ablated model computes what the pruned one will.

The mask is ``[layer, head]`` (one head set for every input: static ablation) or ``[batch, layer, head]``
(a head set per input row: dynamic ablation, or several head sets evaluated in one batch). 1 keeps a head,
0 removes it. The hook multiplies o_proj's input ``[batch, seq, num_heads * head_dim]`` head by head.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from prune_heads.heads import HeadSet
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import live_weight
from prune_heads.plan.planner import LayerPlan, PrunePlan


class HeadAblation:
    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.geometries = lm.arch.geometries(lm.model)
        self.mask: torch.Tensor | None = None
        self._active: list[bool] = []
        self._handles: list = []
        self._norm_plan: list[LayerPlan | None] = [None] * len(self.geometries)

    def set_mask(self, mask: "torch.Tensor | HeadSet | PrunePlan | None") -> None:
        self._norm_plan = [None] * len(self.geometries)
        if isinstance(mask, PrunePlan):
            if mask.kind != "masked" and self.lm.arch.qk_norm == "across_heads":
                self._norm_plan = [None if lp.is_identity or not lp.slots else lp for lp in mask.layers]
            mask = mask.removed
        if isinstance(mask, HeadSet):
            mask = mask_for(self.lm, mask)
        self.mask = None if mask is None else mask.to(self.lm.device)
        # Which layers actually remove something, decided once here rather than per forward.
        self._active = (
            [] if self.mask is None else [bool((self.mask[..., i, :] != 1).any()) for i in range(self.mask.shape[-2])]
        )

    def _hook(self, layer: int):
        geo = self.geometries[layer]

        def pre_hook(module, args):
            if self.mask is None or not self._active[layer]:
                return None
            (x, *rest) = args
            m = self.mask[..., layer, : geo.num_heads]  # [H] or [B, H]
            m = m.to(device=x.device, dtype=x.dtype)  # a device-mapped layer may sit on another device
            shape = x.shape
            x = x.view(*shape[:-1], geo.num_heads, geo.head_dim)
            if m.dim() == 1:
                x = x * m[:, None]
            else:  # per row: [B, H] against x [B, S, H, D]
                if m.shape[0] != shape[0]:
                    raise ValueError(f"per-row ablation mask has {m.shape[0]} rows, the batch has {shape[0]}")
                x = x * m[:, None, :, None]
            return (x.reshape(shape), *rest)

        return pre_hook

    def _norm_hook(self, layer: int, which: str):
        """Replace a cross-head RMSNorm's output by the norm over the plan's heads (same formula as the module)."""
        d = self.geometries[layer].head_dim

        def hook(module, args, output):
            lp = self._norm_plan[layer]
            if lp is None:
                return None
            index = lp.slots if which == "q" else lp.kv_slots
            x = args[0]
            xf = x.float()
            per_head = xf.view(*xf.shape[:-1], -1, d).pow(2).sum(-1)  # [B, S, heads]
            counts = torch.zeros(per_head.shape[-1], device=x.device)
            for h in index:
                if h is not None:
                    counts[h] += 1
            variance = (per_head * counts).sum(-1, keepdim=True) / (len(index) * d)
            normed = xf * torch.rsqrt(variance + module.variance_epsilon)
            return (live_weight(module) * normed).to(x.dtype)

        return hook

    def __enter__(self) -> "HeadAblation":
        arch = self.lm.arch
        for layer in range(arch.num_layers(self.lm.model)):
            attn = arch.attention(self.lm.model, layer)
            o_proj = arch.output_projection(attn)
            self._handles.append(o_proj.register_forward_pre_hook(self._hook(layer)))
            for which, norm in arch.across_head_norms(attn).items():
                self._handles.append(norm.register_forward_hook(self._norm_hook(layer, which)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.mask = None
        self._norm_plan = [None] * len(self.geometries)


def mask_for(lm: LoadedModel, heads: HeadSet) -> torch.Tensor:
    geometries = lm.arch.geometries(lm.model)
    heads.validate(len(geometries), [geo.num_heads for geo in geometries])
    return heads.mask(len(geometries), max(geo.num_heads for geo in geometries))


@contextmanager
def ablate(lm: LoadedModel, mask: "torch.Tensor | HeadSet | PrunePlan | None") -> Iterator[HeadAblation]:
    """``with ablate(lm, heads): ...`` runs the model with those heads' outputs zeroed."""
    abl = HeadAblation(lm)
    with abl:
        abl.set_mask(mask)
        yield abl


def dynamic_masks(per_input: torch.Tensor, threshold: float, direction: str) -> torch.Tensor:
    """Dynamic ablation: for each input, remove the heads whose score on that input passes ``threshold``.

    ``per_input`` is ``[input, layer, head]`` (a ScoreTable entry); ``direction`` is "low" when a low score marks a
    dormant head (``awft`` is "high"). Returns ``[input, layer, head]`` masks, 1 = kept, for ``task_loglik``."""
    dormant = per_input <= threshold if direction == "low" else per_input >= threshold
    return (~dormant).float()
