"""Zero chosen heads' outputs before o_proj: a context manager that leaves the model untouched on exit.

The mask is ``[layer, head]`` (one head set for every input: static ablation) or ``[batch, layer, head]``
(a head set per input row: dynamic ablation, or several head sets evaluated in one batch). 1 keeps a head,
0 removes it. The hook multiplies o_proj's input ``[batch, seq, num_heads * head_dim]`` head by head.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .heads import HeadSet
from .models.loading import LoadedModel


class HeadAblation:
    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.layouts = lm.adapter.layouts(lm.model)
        self.mask: torch.Tensor | None = None
        self._active: list[bool] = []
        self._handles: list = []

    def set_mask(self, mask: torch.Tensor | HeadSet | None) -> None:
        if isinstance(mask, HeadSet):
            mask = mask_for(self.lm, mask)
        self.mask = None if mask is None else mask.to(self.lm.device)
        # Which layers actually remove something, decided once here rather than per forward.
        self._active = [] if self.mask is None else [bool((self.mask[..., i, :] != 1).any()) for i in range(self.mask.shape[-2])]

    def _hook(self, layer: int):
        layout = self.layouts[layer]

        def pre_hook(module, args):
            if self.mask is None or not self._active[layer]:
                return None
            (x, *rest) = args
            m = self.mask[..., layer, : layout.num_heads]  # [H] or [B, H]
            m = m.to(x.dtype)
            shape = x.shape
            x = x.view(*shape[:-1], layout.num_heads, layout.head_dim)
            if m.dim() == 1:
                x = x * m[:, None]
            else:  # per row: [B, H] against x [B, S, H, D]
                if m.shape[0] != shape[0]:
                    raise ValueError(f"per-row ablation mask has {m.shape[0]} rows, the batch has {shape[0]}")
                x = x * m[:, None, :, None]
            return (x.reshape(shape), *rest)

        return pre_hook

    def __enter__(self) -> "HeadAblation":
        adapter = self.lm.adapter
        for layer in range(adapter.num_layers(self.lm.model)):
            o_proj = adapter.output_projection(adapter.attention(self.lm.model, layer))
            self._handles.append(o_proj.register_forward_pre_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.mask = None


def mask_for(lm: LoadedModel, heads: HeadSet) -> torch.Tensor:
    layouts = lm.adapter.layouts(lm.model)
    heads.validate(len(layouts), [lay.num_heads for lay in layouts])
    return heads.mask(len(layouts), max(lay.num_heads for lay in layouts))


@contextmanager
def ablate(lm: LoadedModel, mask: torch.Tensor | HeadSet | None) -> Iterator[HeadAblation]:
    """``with ablate(lm, heads): ...`` runs the model with those heads' outputs zeroed."""
    abl = HeadAblation(lm)
    with abl:
        abl.set_mask(mask)
        yield abl
