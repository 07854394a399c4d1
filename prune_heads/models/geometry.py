"""Head geometry of one attention module, and the two tensor operations every head-level change is made of.

A projection's weight ``[out, in]`` keeps head ``h`` in rows ``h * head_dim:(h + 1) * head_dim`` (q/k/v) or, for
o_proj, in the same columns. Selecting, copying or zeroing heads is therefore one operation on blocks of rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class HeadGeometry:
    """Query heads, KV heads and head size of one attention module (query head h reads KV head h // group_size)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention); 0 for a layer without attention."""
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 0

    def kv_head_of(self, head: int) -> int:
        return head // self.group_size


def head_rows(weight: torch.Tensor, index: Sequence[int | None], block: int) -> torch.Tensor:
    """Blocks of ``block`` rows (dim 0) in the order of ``index``, zeros for None (a silent dummy head)."""
    parts = [weight[h * block:(h + 1) * block] if h is not None else torch.zeros_like(weight[:block]) for h in index]
    return torch.cat(parts, dim=0) if parts else weight[:0]


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding exactly ``weight`` ``[out, in]`` (and ``bias``), on their device and dtype, no grad."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.requires_grad_(False)
    return lin
