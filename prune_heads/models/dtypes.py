"""``--dtype auto``: the fastest dtype this machine computes in, decided by measuring, not by assuming.

On a GPU: bfloat16 where supported, else float16. On a CPU it depends on the chip: with bf16 matrix units
(AVX512_BF16, AMX, Arm BF16) bfloat16 matmuls run 2-4x faster than float32; without them PyTorch emulates bf16 at
about a quarter of float32's speed. The flags in /proc/cpuinfo say what the chip has; 0.1 seconds of matmuls in each
dtype says what this PyTorch build makes of it, and decides. Memory can overrule speed: where the float32 weights
would not fit in available memory with room to verify, bfloat16 is used whatever its speed.
"""
from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512_BF16 / AMX; Arm's ARMv8.6 BF16 ("bf16" in Features)
FASTER = 1.2  # bfloat16 must beat float32 by this factor to be picked for speed
ROOM = 1.6  # float32 weights x this must fit in available memory (the run's peak is about 1.6x the weights)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    def to_json(self) -> dict:
        return {"dtype": str(self.dtype).replace("torch.", ""), "reason": self.reason}


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (MemAvailable for the CPU), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_bf16_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    words = set(text.split())
    return [flag for flag in BF16_FLAGS if flag in words]


def _gflops(dtype: torch.dtype, n: int = 512, seconds: float = 0.1) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(3):  # warm-up: kernels, caches, clocks
        torch.mm(a, b)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * n ** 3 * runs / (time.perf_counter() - start) / 1e9


@functools.lru_cache(maxsize=1)
def cpu_matmul_speeds() -> tuple[float, float]:
    """(float32, bfloat16) GFLOP/s of a 512x512 matmul on this CPU, measured once per process."""
    return _gflops(torch.float32), _gflops(torch.bfloat16)


def auto_dtype(device: torch.device, weights_float32_bytes: int | None = None,
               available: int | None = None) -> DtypeChoice:
    """The dtype ``--dtype auto`` picks on ``device``, and why (printed and recorded in the report)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "bfloat16: the GPU supports it")
        return DtypeChoice(torch.float16, "float16: the GPU has no bfloat16")
    f32, bf16 = cpu_matmul_speeds()
    flags = cpu_bf16_flags()
    measured = f"bf16 matmul {bf16:.0f} GFLOP/s vs float32 {f32:.0f} on this CPU ({platform.machine()}, " + (
        f"flags {', '.join(flags)})" if flags else "no bf16 flags)")
    if weights_float32_bytes and available and weights_float32_bytes * ROOM > available:
        return DtypeChoice(torch.bfloat16, f"bfloat16: the float32 weights ({weights_float32_bytes / 2**30:.1f} GiB) "
                           f"would not fit in {available / 2**30:.1f} GiB available with room to verify; {measured}")
    if bf16 > FASTER * f32:
        return DtypeChoice(torch.bfloat16, f"bfloat16: {measured}")
    return DtypeChoice(torch.float32, f"float32: {measured}")
