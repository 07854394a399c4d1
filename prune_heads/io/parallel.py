"""Several processes, one answer: the same command under ``torchrun --nproc-per-node N`` (or ``accelerate launch``)
shares the expensive work across processes with torch.distributed (NCCL between GPUs, gloo on CPU).

What is shared out (``cached_steps.py`` does it; this module only knows ranks):
- calibration inputs and held-out texts: whole batches of the single-process order (longest first), dealt
  round-robin, so every batch a rank runs is one a single process would run;
- the task's questions: contiguous spans of whole subjects (each rank runs its subjects' shared prefixes and question
  chunks exactly as one process would), cut inside a subject only when there are fewer subjects than ranks.
Results come back to every rank in question order, so every rank takes the same decisions on the same numbers.
Rank 0 alone reads the cache (a hit is broadcast) and writes it, the outputs and the export; once the budget is
decided the other ranks exit and rank 0 finishes alone (``Ranks.LOCAL`` from then on).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from prune_heads.errors import UserError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def root(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the others pass anything)."""
        if self.size == 1:
            return value
        box = [value if self.root else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, part: Any) -> list[Any]:
        """Every rank's ``part``, in rank order, on every rank."""
        if self.size == 1:
            return [part]
        parts: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(parts, part)
        return parts

    def raise_together(self, error: UserError | None) -> None:
        """After a step rank 0 did alone (creating the output directory, say): its UserError is raised on every
        rank, so no rank goes on to wait for one that has stopped."""
        message = self.broadcast(str(error) if error is not None else None)
        if error is not None:
            raise error
        if message is not None:
            raise UserError(message)

    def device(self, device: str, kind: str) -> str:
        """--device for this rank: on CUDA each rank takes its own GPU (cuda:LOCAL_RANK) unless one was named."""
        if self.size > 1 and kind == "cuda" and ":" not in device:
            return f"cuda:{self.local_rank}"
        return device

    def deal(self, items: Sequence) -> list:
        """This rank's share of ``items`` dealt round-robin (item i goes to rank i mod size)."""
        return list(items[self.rank :: self.size])

    def span(self, sizes: Sequence[int], cuts: Sequence[int] | None = None) -> tuple[int, int]:
        """This rank's contiguous run ``[lo, hi)`` of ``sum(sizes)`` elements, balanced by count; ``cuts`` (element
        offsets where a run may end, e.g. subject boundaries) are kept to when given."""
        total = sum(sizes)
        ends = [round(total * r / self.size) for r in range(self.size + 1)]
        if cuts:
            allowed = sorted(set(cuts) | {0, total})
            ends = [min(allowed, key=lambda c: (abs(c - e), c)) for e in ends]
            ends = [max(ends[: i + 1]) for i in range(len(ends))]  # never backwards
        return ends[self.rank], ends[self.rank + 1]


LOCAL = Ranks()


def launched_ranks() -> Ranks:
    """The ranks ``torchrun``/``accelerate launch`` started (their environment: WORLD_SIZE, RANK, LOCAL_RANK),
    joined into one process group; ``LOCAL`` when there is one process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return LOCAL
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank)


def leave(ranks: Ranks) -> None:
    """Leave the process group (at the end of a command)."""
    if ranks.size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
