"""The one batching rule of the passes over free text (scoring, next-token KL): longest first, ``batch_size`` at a
time, so similar lengths pad together. Sharing work across processes deals out these same batches (work.py)."""
from __future__ import annotations

from typing import Sequence


def longest_first(sequences: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``sequences`` in batches, longest first (ties keep input order)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
