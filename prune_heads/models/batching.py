"""How work is cut into forward passes: the one batching rule of the passes over free text (scoring, next-token KL),
and how many rows one pass may hold.

Free text goes longest first, ``batch_size`` at a time, so similar lengths pad together; sharing work across
processes deals out these same batches (eval/cached_steps.py). A pass's activations (and the KV caches the task
passes copy per row) grow with its rows x tokens while the weights stay fixed: on a small model with long prompts four
rows of 1,024 tokens hold as much as the weights themselves. :class:`PassBudget` caps one pass at
:data:`ACTIVATION_SHARE` of the weights' bytes (never under one row), so memory stays near the weights on every
model; on models of a billion parameters and more the cap is far above ``--batch-size`` and changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from prune_heads.models.counting import weight_bytes

if TYPE_CHECKING:
    from prune_heads.models.loading import LoadedModel

ACTIVATION_SHARE = 0.125  # one forward pass holds at most this share of the weights' bytes beside them
FLOAT32 = 4


@dataclass(frozen=True)
class PassBudget:
    """Bytes one forward pass may hold, and what a token costs in it (estimates from the model's shapes)."""

    bytes: int  # ACTIVATION_SHARE x the weights' bytes
    token_bytes: int  # activations live at once per token of a pass (one layer's worth, plus the scoring statistics)
    cache_token_bytes: int  # KV cache per token, all layers
    logits_token_bytes: int  # full-vocabulary float32 log-probabilities of two models and their product, per token

    def tokens(self, full_logits: bool = False) -> int:
        """Tokens (rows x padded length) one pass over free text may hold (``full_logits``: with logits at every
        position, as the next-token KL needs)."""
        return max(1, self.bytes // (self.token_bytes + (self.logits_token_bytes if full_logits else 0)))

    def cached_rows(self, prefix_tokens: int, most: int) -> int:
        """Rows that may each hold a copy of a ``prefix_tokens`` KV cache in one pass (1 to ``most``)."""
        return max(1, min(most, self.bytes // max(1, prefix_tokens * self.cache_token_bytes)))


def pass_budget(lm: "LoadedModel") -> PassBudget:
    c, geos = lm.config, lm.arch.geometries(lm.model)
    size = lm.dtype.itemsize
    weights = weight_bytes(lm.model)
    heads = max(g.num_heads * g.head_dim for g in geos)  # query width
    kv = sum(2 * g.num_kv_heads * g.head_dim for g in geos)
    # residual + normed hidden states, the MLP's three intermediates, q/k/v/output and the fused-statistics copies
    token = size * (4 * c.hidden_size + 3 * getattr(c, "intermediate_size", 4 * c.hidden_size) + 10 * heads)
    token += FLOAT32 * 6 * heads  # float32 per-head statistics of the scoring pass
    return PassBudget(int(ACTIVATION_SHARE * weights), token, kv * size, 3 * FLOAT32 * c.vocab_size)


def text_batches(lm: "LoadedModel", sequences: Sequence[Sequence[int]], batch_size: int,
                 full_logits: bool = False) -> list[list[int]]:
    """The batches a pass over free text runs on ``lm``: longest first, within ``batch_size`` and the pass budget."""
    return longest_first(sequences, batch_size, pass_budget(lm).tokens(full_logits))


def longest_first(sequences: Sequence[Sequence[int]], batch_size: int, max_tokens: int | None = None
                  ) -> list[list[int]]:
    """Indices of ``sequences`` in batches, longest first (ties keep input order): at most ``batch_size`` rows, and
    at most ``max_tokens`` rows x longest length (never under one row)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    batches: list[list[int]] = []
    for i in order:
        rows = len(batches[-1]) + 1 if batches else 0
        longest = len(sequences[batches[-1][0]]) if batches else 0
        if batches and rows <= batch_size and (max_tokens is None or rows * longest <= max_tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
