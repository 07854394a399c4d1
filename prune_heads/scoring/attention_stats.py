"""Attention that also reports what the attention-weight scores need, without materialising ``[S, S]`` weights.

Two score functions read attention weights p_ij = softmax_j(s_ij) of query i over visible keys j: first-token weight
(awft) and entropy (aeqd). Both follow from the log-sum-exp ``lse_i`` and one weighted sum of keys:

    p_i0     = exp(s_i0 - lse_i)
    H_i      = -sum_j p_ij log p_ij = lse_i - sum_j p_ij s_ij
             = (lse_i - s_i0) - scale * q_i . sum_j p_ij (k_j - k_0)       (s_ij = scale * q_i . k_j)

The weighted key sum is one more "value" channel of the same attention, so on CPU a single fused flash-attention call
over ``[q | 0]``, ``[k | 0]``, ``[v | k - k_0]`` (head size doubled) gives the output, the key sum and ``lse``
without the eager path's ``[B, H, S, S]`` tensors. Keys are taken relative to the first token so the sum is small
exactly where the entropy is (sink heads), which keeps bf16 rounding out of it.

Where that kernel does not apply (logit soft-capping makes scores non-linear in k; devices other than CPU) the same
quantities are computed explicitly, a block of queries at a time, so memory stays bounded.

The model calls :func:`attention_with_stats` through transformers' ``AttentionInterface`` under the name
:data:`IMPLEMENTATION`; each attention module's statistics go to the receiver registered for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

IMPLEMENTATION = "prune_heads_stats"
QUERY_BLOCK = 256  # explicit path: queries per block, so [B, H, block, S] stays small

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
use_fused_kernel = True  # tests switch this off to check the explicit path on CPU


@dataclass
class AttentionStats:
    """Per query, ``[B, H, S]`` float32: attention on the first token and attention entropy (nats)."""

    first_token_weight: torch.Tensor
    entropy: torch.Tensor


Receiver = Callable[[AttentionStats], None]
_receivers: dict[int, Receiver] = {}


def receive(module: torch.nn.Module, receiver: Receiver | None) -> None:
    """Send ``module``'s statistics to ``receiver`` on every forward (None: stop)."""
    if receiver is None:
        _receivers.pop(id(module), None)
    else:
        _receivers[id(module)] = receiver


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV * groups, S, D], each KV head repeated for the query heads that read it."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _causal_mask(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Additive causal mask ``[1, 1, S_q, S_k]``, queries aligned with the last keys."""
    s_q, s_k = query.shape[2], key.shape[2]
    rows = torch.arange(s_q, device=query.device)[:, None] + (s_k - s_q)
    hidden = torch.arange(s_k, device=query.device)[None, :] > rows
    return torch.zeros(s_q, s_k, dtype=query.dtype, device=query.device).masked_fill(
        hidden, torch.finfo(query.dtype).min
    )[None, None]


def _fused_cpu(query, key, value, mask, scale):
    """One flash-attention call with the key sum as extra value channels; returns (out, key_sum, lse)."""
    d = query.shape[-1]
    wide_q = torch.cat([query, torch.zeros_like(query)], dim=-1)
    wide_k = torch.cat([key, torch.zeros_like(key)], dim=-1)
    wide_v = torch.cat([value, (key.float() - key[:, :, :1].float()).to(key.dtype)], dim=-1)
    out, lse = _FLASH_CPU(wide_q, wide_k, wide_v, 0.0, False, attn_mask=mask.to(query.dtype), scale=scale)
    return out[..., :d], out[..., d:], lse


def _explicit(query, key, value, mask, scale, softcap):
    """Scores a block of queries at a time; returns (out, entropy, first_token_weight)."""
    outs, entropies, firsts = [], [], []
    s_len = query.shape[2]
    for start in range(0, s_len, QUERY_BLOCK):
        q = query[:, :, start : start + QUERY_BLOCK]
        scores = torch.matmul(q, key.transpose(2, 3)).float() * scale  # [B, H, block, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + mask[:, :, start : start + QUERY_BLOCK].float()
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - lse)
        outs.append(torch.matmul(p.to(value.dtype), value))
        # Masked keys have p = 0; where() keeps 0 * (-inf) out of the sum.
        entropies.append(lse[..., 0] - torch.where(p > 0, p * scores, 0.0).sum(-1))
        firsts.append(p[..., 0])
    return torch.cat(outs, dim=2), torch.cat(entropies, dim=2), torch.cat(firsts, dim=2)


def attention_with_stats(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S, D]
    key: torch.Tensor,  # [B, KV, S, D]
    value: torch.Tensor,  # [B, KV, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, S, S] additive (eager mask); None means plain causal
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the usual output ``[B, S, H, D]``, statistics to the module's receiver."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is None:
        attention_mask = _causal_mask(query, key)
    if use_fused_kernel and softcap is None and query.device.type == "cpu" and _FLASH_CPU is not None:
        out, key_sum, lse = _fused_cpu(query, key, value, attention_mask, scale)
        q = query.float()
        first_score = scale * (q * key[:, :, :1].float()).sum(-1)  # s_i0, [B, H, S]
        first = torch.exp(first_score + attention_mask[:, :, :, 0].float() - lse)
        entropy = (lse - first_score) - scale * (q * key_sum.float()).sum(-1)
    else:
        out, entropy, first = _explicit(query, key, value, attention_mask, scale, softcap)
    receiver = _receivers.get(id(module))
    if receiver is not None:
        receiver(AttentionStats(first_token_weight=first, entropy=entropy))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make :data:`IMPLEMENTATION` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(IMPLEMENTATION, attention_with_stats)
    AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)  # always an additive mask in the model's dtype
