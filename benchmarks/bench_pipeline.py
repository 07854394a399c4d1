"""Benchmark 4: the README's main command on the embedded model, end to end: wall time and peak memory, and what
the export ships (attention parameters removed, deployment efficiency, KV cache) with its measured speed-up.

    python benchmarks/bench_pipeline.py [extra prune-heads flags...]

Target: under 10 minutes with the default settings on a 2-core CPU.
"""
from __future__ import annotations

import json
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
    cmd = [
        sys.executable,
        "-m",
        "prune_heads_cli",
        "--model",
        "smollm2-135m",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]
    print(f"machine: {machine()}")
    print("command:", " ".join(cmd[2:]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB on Linux
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        raise SystemExit(proc.returncode)
    print(
        "\n".join(
            line for line in proc.stderr.splitlines() if "heads" in line or "mmlu" in line.lower() or "layout" in line
        )
    )
    report = json.loads((out / "report.json").read_text())
    total = report["task"]["questions"]
    searched = [p for p in report["search_points"] if p["num_heads"] > 0]
    evaluated = sum(p["n"] for p in searched)
    print(
        f"search: {len(searched)} points, {sum(1 for p in searched if p.get('stopped_early'))} stopped early; "
        f"{evaluated} question evaluations of {len(searched) * total} without early stop"
    )
    shipped, speed = report["final"].get("shipped") or {}, (report.get("export") or {}).get("speed") or {}
    shutil.rmtree(out.parent, ignore_errors=True)
    result("pipeline_seconds", round(seconds, 1))
    result("heads_zeroed", report["final"]["num_heads_removed"])
    result("shipped_attention_params_removed", shipped.get("attention_params_removed"))
    result("deployment_efficiency", shipped.get("deployment_efficiency"))
    result("shipped_kv_cache_removed_bytes_per_token", shipped.get("kv_cache_removed"))
    result("export_prefill_speedup", speed.get("prefill_speedup"))
    result("export_decode_speedup", speed.get("decode_speedup"))
    result("export_flops_predicted_prefill_speedup", speed.get("flops_predicted_prefill_speedup"))
    result("pipeline_peak_rss_mb", round(peak_mb))
    result("early_stop_question_fraction", round(evaluated / max(1, len(searched) * total), 3))


if __name__ == "__main__":
    main()
