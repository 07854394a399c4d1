"""Where a run's time goes: named stages on one clock per run (``report.json["timings"]``), and which stage raised the
process's peak resident set (``peak_rss_mb``: each stage that ended with a new peak, and that peak).

A stage entered inside another pauses the outer one, so each second is counted once, in the innermost stage running:
the guard's probes read during the confirmation walk count as ``guard``, the reload check inside the export as
``reload check``, and the stages' seconds add up to the time spent inside any stage. The core and the exporters mark
their stages (``with stage("scoring"):``); the entry point starts a clock per run (``start``) and reads it at the end.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator


class StageClock:
    """Seconds per named stage, the innermost running stage alone counting."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}  # stage -> the process's peak resident set when it last ended, bytes
        self.layer_tokens: dict[str, int] = {}  # stage -> tokens read by decoder layers (rows x tokens x layers run)
        self._running: list[str] = []
        self._since = time.perf_counter()
        self.started = self._since

    def _charge(self, now: float) -> None:
        if self._running:
            name = self._running[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
        self._since = now

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._charge(time.perf_counter())
        self._running.append(name)
        try:
            yield
        finally:
            self._charge(time.perf_counter())
            self._running.pop()
            peak = peak_resident_bytes()
            if peak and peak > max(self.peak_rss.values(), default=0):
                self.peak_rss[name] = peak  # this stage raised the process's peak

    def read(self, tokens: int) -> None:
        """``tokens`` went through one decoder layer, charged to the innermost running stage (``other`` outside)."""
        name = self._running[-1] if self._running else "other"
        self.layer_tokens[name] = self.layer_tokens.get(name, 0) + tokens

    @property
    def total(self) -> float:
        """Seconds since the clock started (stages and what ran between them)."""
        return time.perf_counter() - self.started

    def to_json(self) -> dict:
        """``{"stages": {name: seconds}, "other": seconds outside any stage, "total": seconds}``, in order of first
        entry; a stage that had nothing to do (under 10 ms: no GGUF asked, no vLLM found) is left out."""
        total = self.total
        staged = sum(self.seconds.values())
        return {"stages": {k: round(v, 2) for k, v in self.seconds.items() if v >= 0.01},
                "other": round(max(total - staged, 0.0), 2), "total": round(total, 2),
                "peak_rss_mb": {k: round(v / 2**20, 1) for k, v in self.peak_rss.items()},
                "layer_tokens": dict(self.layer_tokens)}

    def describe(self, top: int = 4) -> str:
        """``5 min 12 s (search 140 s, export 61 s, ...)``: the total and the dearest stages."""
        dearest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:top]
        return f"{duration(self.total)} ({', '.join(f'{k} {duration(v)}' for k, v in dearest)})"


def peak_resident_bytes() -> int:
    """The process's peak resident set so far (Linux's VmHWM; 0 where /proc has none)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"


_clock = StageClock()


def start() -> StageClock:
    """A fresh clock for a run (the previous run's stages are not counted again)."""
    global _clock
    _clock = StageClock()
    return _clock


def clock() -> StageClock:
    return _clock


def stage(name: str) -> contextlib.AbstractContextManager[None]:
    """``with stage("scoring"):`` the run's clock charges the time inside to ``name``."""
    return _clock.stage(name)
