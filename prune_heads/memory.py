"""How a run's passes hand memory back: one policy object for the whole process, chosen at the entry point.

The core marks the moments where memory can go back (after each pass of a stage, after each decoder layer of a long
pass once the original model is released, between stages); what happens then is the policy's. The default leaves
memory to the allocator (a garbage collection between stages); the command line installs the glibc policy
(``prune_heads_cli/memory.py``: malloc thresholds, ``malloc_trim``), whose measurements are documented there."""
from __future__ import annotations

import contextlib
import gc
from typing import ContextManager, Iterable


class MemoryPolicy:
    """Leave memory to the allocator: what a library user of the core gets unless they install another."""

    def after_pass(self) -> None:
        """A pass of a stage ended: its activations are free."""

    def per_layer(self, modules: Iterable) -> ContextManager[None]:
        """Inside, ``after_pass`` may run after each forward of ``modules`` (the decoder layers of a long pass)."""
        return contextlib.nullcontext()

    def between_stages(self) -> None:
        """A stage let go of a model or a large buffer: collect it before the next one allocates."""
        gc.collect()


_installed = MemoryPolicy()


def install(policy: MemoryPolicy) -> None:
    """Make ``policy`` the process's (the entry point does this once, before any model is loaded)."""
    global _installed
    _installed = policy


def policy() -> MemoryPolicy:
    return _installed
