"""Benchmark 4: the README's main command on the embedded model, end to end: wall time and peak memory.

    python benchmarks/bench_pipeline.py [--out /tmp/bench-pruned] [extra prune-heads flags...]

Target: under 10 minutes with the default settings on a 2-core CPU.
"""
from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, result


def main() -> None:
    extra = sys.argv[1:]
    out = Path(tempfile.mkdtemp()) / "pruned"
    cmd = [sys.executable, "-m", "prune_heads.cli", "--model", "smollm2-135m", "--budget", "1%", "--out", str(out),
           "--no-progress", *extra]
    print(f"machine: {machine()}")
    print("command:", " ".join(cmd[2:]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB on Linux
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        raise SystemExit(proc.returncode)
    print("\n".join(line for line in proc.stderr.splitlines() if "heads" in line or "MMLU" in line or "layout" in line))
    shutil.rmtree(out.parent, ignore_errors=True)
    result("pipeline_seconds", round(seconds, 1))
    result("pipeline_peak_rss_mb", round(peak_mb))


if __name__ == "__main__":
    main()
