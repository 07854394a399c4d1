"""Shared bits of the benchmark scripts: machine description and RESULT lines."""
from __future__ import annotations

import os
import platform
import time

import torch


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {gpu}, torch {torch.__version__}"


def result(name: str, value) -> None:
    print(f"RESULT {name}={value}", flush=True)


def timed(fn, repeats: int = 1):
    """Best wall time of ``repeats`` calls and the last return value."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, out
