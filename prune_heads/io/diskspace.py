"""Disk space: the bytes an export will write, checked before writing, and a full disk reported as one fact.

The estimate is what is actually written, not a bound: the pruned weights in the export's dtype (a tied LM head
once), the reference logits held on disk until the reload is checked, the GGUF when asked, plus ``MARGIN`` for the
tokenizer, config, card and manifest."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

from prune_heads.errors import DiskFull, UserError, is_disk_full

MARGIN_FRACTION, MARGIN_BYTES = 0.02, 32 << 20  # tokenizer, config, card, manifest, file-system slack


def with_margin(nbytes: int) -> int:
    return int(nbytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def free_bytes(directory: str | Path) -> int:
    return shutil.disk_usage(directory).free


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def check_space(directory: Path, needed: int, what: str) -> None:
    """Refuse before writing when ``directory``'s disk cannot hold ``needed`` bytes plus the margin."""
    free = free_bytes(directory)
    if free < with_margin(needed):
        raise UserError(f"not enough disk space in {directory}: {what} needs about {gib(with_margin(needed))} "
                        f"({gib(needed)} + {MARGIN_FRACTION:.0%} + {gib(MARGIN_BYTES)} margin), {gib(free)} are free; "
                        "free some space or choose another `out`")


@contextmanager
def disk_full_reported(directory: Path, what: str, needed: int | None = None):
    """A full disk inside the block (from any library) becomes ``DiskFull`` naming ``directory`` and ``needed``."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFull(directory, what, needed) from e
        raise
