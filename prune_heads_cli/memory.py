"""The memory policy of the command line (``prune_heads.memory``): how glibc's malloc is asked to hold a run's memory
near its live tensors, how freed memory is handed back, and the CPU kernel caches' bounds. Nothing here imports torch
(``main`` sets the policy before anything is loaded)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
from typing import Iterable, Iterator

from prune_heads.memory import MemoryPolicy

# glibc's malloc serves a block from its heap unless it is at least the mmap threshold, and it raises that threshold
# to the largest block freed so far (up to 32 MiB): after the first pass every activation of a forward pass comes
# from the heap, where the small tensors a pass keeps (statistics, cache entries) split the freed activation blocks
# and the heap grows by about one activation per layer. Fixed, blocks of the threshold and more are mapped and
# unmapped on their own; the trim threshold keeps the heap's top for reuse instead of returning it after every pass.
# Each mapped block is faulted in page by page every time it is allocated, so the threshold trades the kernel's time
# for resident memory. Measured on SmolLM2-135M (bf16) scoring at 1 MiB: peak above the floor +136/+176 MiB ->
# +83/+94 MiB, at the same speed (a 256 KiB threshold: +53 MiB but 30-70% slower); on the README command (2-core
# Intel Xeon, 2026-12-06) 1 MiB spent 73 s of its 597 CPU-seconds in the kernel (32.5 million minor page faults,
# 5 min 14 s, peak RSS 1.10 GB) and 16 MiB 21 s of 555 (7.3 million, 4 min 52 s, 1.13 GB). Codes from glibc's
# malloc.h.
HEAP_POLICY = {-3: 16 << 20, -1: 64 << 20}  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
USER_HEAP_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once (release_free runs after every pass); None where it is not glibc's."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def steady_heap() -> bool:
    """Set :data:`HEAP_POLICY` for this process (before any model is loaded); not where the user set malloc's
    thresholds themselves, nor where the C library is not glibc. Returns whether it was set."""
    if any(os.environ.get(name) for name in USER_HEAP_SETTINGS):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and all(mallopt(code, value) == 1 for code, value in HEAP_POLICY.items())


# A hand-back (malloc_trim) returns every free page of the heap, and the next pass faults them in again: done after
# every decoder layer it cost the README command 212 s of its 788 CPU-seconds in the kernel (86 million minor page
# faults). So a pass hands back only once the resident set has grown this far above where the last hand-back left it:
# the resident set stays within this of its floor, and the pages are returned a few times per stage, not per layer.
RELEASE_SLACK = 64 << 20


class _Floor:
    """The resident set right after the last hand-back."""

    bytes = 0


def resident_bytes() -> int:
    """The process's resident set, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free(slack: int = RELEASE_SLACK) -> None:
    """Hand the heap's free pages back (``malloc_trim``, no garbage collection) once the resident set has grown
    ``slack`` bytes above where the last hand-back left it (0: now): each pass's blocks land at new places in the
    heap's free space and every page they touch stays resident after they are freed, so without this the resident set
    climbs through a stage towards the heap's whole free space (after the original model is released, all of its
    former place). Measured on SmolLM2-135M over the README's task passes: peak above the floor +136 -> +92 MiB
    trimming once per subject; the export's task passes on the reloaded model climbed +100 MiB within one long
    subject, hence the check after every pass and layer."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:  # not glibc: the allocator returns memory its own way
        return
    if slack and resident_bytes() < _Floor.bytes + slack:
        return
    trim(0)
    _Floor.bytes = resident_bytes()


def trim_heap() -> None:
    """Collect garbage and hand freed memory back to the system: glibc keeps freed blocks for reuse, so without
    ``malloc_trim`` what is allocated next (another model, a larger batch) would sit beside them in RSS."""
    gc.collect()
    release_free(slack=0)


@contextlib.contextmanager
def released_after_each(modules: Iterable) -> Iterator[None]:
    """Inside, :func:`release_free` runs after each forward of ``modules`` (torch modules: the decoder layers).

    Once the original model is released its former place in the heap is free, and glibc serves every block that fits
    from free heap space before it maps one (the mmap threshold only applies when the heap must grow): a long pass's
    per-layer activations then land on ever new free pages, which stay resident until the pass ends. Measured on the
    exported SmolLM2-135M's 1,481-token prefix pass: +103 MiB of RSS for 37 MiB of KV cache; handed back after every
    layer, the README command's task passes peaked 463 -> 395 MiB above the baseline."""
    handles = [module.register_forward_hook(lambda *_: release_free()) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class GlibcHeap(MemoryPolicy):
    """The glibc policy: freed pages handed back after each pass (and each layer of a long pass), the heap trimmed
    between stages. Where the C library is not glibc every hand-back is a no-op."""

    def after_pass(self) -> None:
        release_free()

    def per_layer(self, modules: Iterable):
        return released_after_each(modules)

    def between_stages(self) -> None:
        trim_heap()


# oneDNN (bf16 matmuls on CPU) and PyTorch's ideep layer above it keep every kernel they build, keyed by shape, up to
# 1,024 of each (pytorch/pytorch#27971). Task passes meet a new shape per subject and per chunk: measured on SmolLM2
# over the 19 README subjects, the kept kernels grew the resident set by 179 MiB (2/3 of the bf16 weights); with these
# caps by 38 MiB, at the same speed (no cache at all: 15 MiB but 34% slower). A value the user set is kept.
KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1"}


def bound_kernel_caches() -> None:
    """Cap the CPU kernel caches (read when the first kernel is built, so before any model runs)."""
    for name, value in KERNEL_CACHES.items():
        os.environ.setdefault(name, value)


def install_policy() -> None:
    """The process's memory policy, once, at the entry point: kernel caches bounded, malloc's thresholds set (unless
    the user set their own), the glibc hand-backs installed."""
    from prune_heads import memory

    bound_kernel_caches()
    steady_heap()
    memory.install(GlibcHeap())
