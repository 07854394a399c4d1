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


NEARLY_FULL = 4 << 20  # free bytes below which a failed write is taken to have met a full disk


def failed_for_space(error: BaseException, directory: Path) -> bool:
    """Whether ``error``, raised while writing under ``directory``, is a full disk: decided by the disk itself (its
    free space now, or the error's errno), since libraries word a full disk each their own way (torch's zip writer:
    "unexpected pos 704 vs 598" after "basic_ios::clear: iostream error")."""
    if is_disk_full(error):
        return True
    try:
        existing = next((p for p in (Path(directory), *Path(directory).parents) if p.exists()), None)
        return existing is not None and free_bytes(existing) < NEARLY_FULL
    except (OSError, ValueError):  # a path the file system cannot even look up: not a full disk
        return False


@contextmanager
def disk_full_reported(directory: Path, what: str, needed: int | None = None):
    """A full disk inside the block (from any library) becomes ``DiskFull`` naming ``directory`` and ``needed``."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if failed_for_space(e, directory):
            raise DiskFull(directory, what, needed) from e
        raise
