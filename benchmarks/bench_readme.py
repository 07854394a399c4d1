"""The README command, stage by stage, against what this machine can do (issue 52's targets).

Runs ``prune-heads --model smollm2-135m --out DIR --no-progress`` (the README's first command, ``--dtype auto``) in a
subprocess, then in this process, in the dtype the run picked:

- the machine's matmul peak: the best GFLOP/s of a ``[1024 x hidden] @ [hidden x intermediate]`` matmul (the MLP's
  shape, the largest of a layer) in that dtype;
- a plain transformers forward over 65,536 tokens (64 sequences of 1,024 tokens, batch 1, no cache, logits at the
  last position only): the reference the whole command is held against.

Per stage of the run (``report.json["timings"]``): seconds, the tokens its decoder layers read (rows x tokens x
layers, counted by the run: a point started above layer 0 pays only for the layers it runs), the FLOPs of the
layers' projections that implies (2 x a layer's projection parameters per token; attention scores and the LM head
are not counted, so the share is a lower bound) and that as a share of the measured peak. Then the targets, side by
side: the whole command <= 2 x the plain forward, peak RSS <= 1.0 GB, each verification stage >= 40% of peak.

    python benchmarks/bench_readme.py [--out DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, result

from prune_heads.models.loading import load_model

VERIFYING = ("baseline", "search", "guard", "confirmation")  # the stages made of verification points


def run_readme(out: Path) -> tuple[float, dict, int]:
    """Wall seconds, report.json and the peak RSS (bytes) of the README command."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "prune_heads_cli.main", "--model", "smollm2-135m", "--out", str(out),
                    "--no-progress"], check=True)
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return wall, json.loads((out / "report.json").read_text()), peak


def matmul_peak(hidden: int, intermediate: int, dtype: torch.dtype) -> float:
    """Best GFLOP/s of the MLP-shaped matmul over 20 tries (after a warm-up)."""
    a, b = torch.randn(1024, hidden, dtype=dtype), torch.randn(hidden, intermediate, dtype=dtype)
    best = float("inf")
    for i in range(22):
        t = time.perf_counter()
        torch.matmul(a, b)
        if i >= 2:
            best = min(best, time.perf_counter() - t)
    return 2 * 1024 * hidden * intermediate / best / 1e9


@torch.no_grad()
def plain_forward_seconds(model, vocab: int) -> float:
    """64 sequences of 1,024 random tokens through the model, one at a time."""
    g = torch.Generator().manual_seed(0)
    model(input_ids=torch.randint(0, vocab, (1, 1024), generator=g), use_cache=False, logits_to_keep=1)  # warm-up
    started = time.perf_counter()
    for _ in range(64):
        model(input_ids=torch.randint(0, vocab, (1, 1024), generator=g), use_cache=False, logits_to_keep=1)
    return time.perf_counter() - started


def layer_projection_params(model) -> int:
    layer = model.model.layers[0]
    return sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the output directory")
    args = parser.parse_args()
    out_root = Path(tempfile.mkdtemp(prefix="bench-readme-")) if args.out is None else args.out
    out = out_root / "pruned"
    print(f"machine: {machine()}; CPU flags: {cpu_flags()}", flush=True)
    wall, report, peak = run_readme(out)
    dtype = getattr(torch, str(report["dtype"]["dtype"]).removeprefix("torch."))
    lm = load_model("smollm2-135m", dtype=str(dtype).removeprefix("torch."), device="cpu")
    cfg = lm.config
    peak_gflops = matmul_peak(cfg.hidden_size, cfg.intermediate_size, dtype)
    plain = plain_forward_seconds(lm.model, cfg.vocab_size)
    per_token = 2 * layer_projection_params(lm.model)
    timings = report["timings"]
    print(f"dtype {dtype}; matmul peak {peak_gflops:.1f} GFLOP/s; plain forward of 65,536 tokens {plain:.1f} s")
    print(f"{'stage':<20}{'seconds':>10}{'layer tokens':>16}{'GFLOP':>10}{'GFLOP/s':>10}{'of peak':>9}")
    shares = {}
    for name, seconds in timings["stages"].items():
        tokens = timings.get("layer_tokens", {}).get(name, 0)
        gflop = tokens * per_token / 1e9
        share = gflop / seconds / peak_gflops if tokens and seconds else None
        shares[name] = share
        print(f"{name:<20}{seconds:>10.1f}{tokens:>16,}{gflop:>10.1f}{gflop / seconds:>10.1f}"
              f"{'' if share is None else f'{100 * share:.0f}%':>9}")
        key = name.replace(" ", "_")
        result(f"{key}_seconds", round(seconds, 1))
        result(f"{key}_layer_tokens", tokens)
        if share is not None:
            result(f"{key}_share_of_peak", round(share, 3))
    result("readme_seconds", round(wall, 1))
    result("readme_reported_seconds", timings["total"])
    result("plain_forward_65536_seconds", round(plain, 1))
    result("readme_over_plain_forward", round(wall / plain, 2))
    result("peak_rss_gb", round(peak / 1e9, 3))
    result("matmul_peak_gflops", round(peak_gflops, 1))
    result("reuse", json.dumps(report.get("layer_reuse", {}).get("starts", []), separators=(",", ":")))
    verifying = [shares[s] for s in VERIFYING if shares.get(s) is not None]
    met = {True: "met", False: "not met"}
    print(f"targets: whole command {wall / plain:.2f} x the plain forward (<= 2: {met[wall <= 2 * plain]}); "
          f"peak RSS {peak / 1e9:.2f} GB (<= 1.0: {met[peak <= 1e9]}); verification stages "
          f"{', '.join(f'{100 * v:.0f}%' for v in verifying)} of peak (>= 40% each: "
          f"{met[bool(verifying) and min(verifying) >= 0.4]})")
    if args.out is None and not args.keep:
        shutil.rmtree(out_root, ignore_errors=True)


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags)


if __name__ == "__main__":
    main()
