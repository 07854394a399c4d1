"""The benchmark scripts the issues name run here in their quick forms (their figures come from real runs on the
machines benchmarks/RESULTS.md names; these check the scripts themselves)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _results(out: str) -> dict[str, str]:
    return dict(line.removeprefix("RESULT ").split("=", 1) for line in out.splitlines() if line.startswith("RESULT "))


@pytest.mark.slow
def test_gpu_throughput_quick_on_the_cpu_reports_the_point_with_and_without_layer_reuse():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--device", "cpu", "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = _results(done.stdout)
    assert int(got["verification_point_questions"]) == 4 and float(got["verification_point_seconds"]) > 0
    assert int(got["reuse_layer"]) == 1 and float(got["reuse_kept_gib"]) > 0
    # the same point's log-likelihoods, in full and started at layer 1 (float32 on the CPU)
    assert float(got["reuse_max_loglik_difference"]) < 1e-3
    assert float(got["verification_point_reuse_seconds"]) > 0 and float(got["reuse_speedup"]) > 0
