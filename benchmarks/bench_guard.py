"""Benchmark 9: the long-context guard on the README command (embedded SmolLM2-135M-Instruct).

    python benchmarks/bench_guard.py [--calibrated] [--retrieval] [extra prune-heads flags...]

Runs the README command (`prune-heads --model smollm2-135m --out DIR`, the guard on by default) and prints what the
guard cost (its share of the command's time: target <= 15%), what it decided, and each probe per length, original
against the shipped model. ``--calibrated`` runs the same command again with ``--calibrate-probes`` and prints how much
the dormancy ranking and the chosen set change; ``--retrieval`` also ranks the heads that carry pass-key retrieval
(scoring/retrieval.py, on prompts the guard never reads) by dormancy, with and without the probe calibration.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, result


def run(extra: list[str], name: str) -> dict:
    out = Path(tempfile.mkdtemp()) / name
    cmd = [sys.executable, "-m", "prune_heads_cli", "--model", "smollm2-135m", "--out", str(out), "--no-progress",
           *extra]
    print("command:", " ".join(cmd[2:]), flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    print("\n".join(line for line in proc.stderr.splitlines() if "long-context" in line or "confirm" in line))
    report = json.loads((out / "report.json").read_text())
    report["wall_seconds"] = seconds
    return report


def say_guard(report: dict, prefix: str) -> None:
    g = report["guard"]
    result(f"{prefix}_seconds", round(report["wall_seconds"], 1))
    result(f"{prefix}_guard_seconds", g.get("seconds"))
    result(f"{prefix}_guard_share", round(g.get("seconds", 0) / report["wall_seconds"], 4))
    result(f"{prefix}_heads_removed", report["final"]["num_heads_removed"])
    result(f"{prefix}_heads", json.dumps(report["heads"], separators=(",", ":")))
    for point in g.get("judged", []):
        print(f"  guard on {point['num_heads']} heads: " + ("within tolerance" if point["within_tolerance"]
                                                           else "refused: " + point["reason"]))
    for probe, rows in ((g.get("chosen") or {}).get("per_length") or {}).items():
        for length, r in rows.items():
            result(f"{prefix}_{probe}_{length}", f"{r['original']:.3f}->{r['pruned']:.3f}(lost {r['change']:+.2f}"
                   f"{r['unit']},ok={r['ok']})")


def ranking(report: dict, scorer: str = "ahon_ln") -> list[tuple[int, int]]:
    """Heads, most dormant first (ahon_ln: a low output norm is dormant)."""
    scores = torch.tensor(report["scores"][scorer])
    order = torch.argsort(scores.flatten()).tolist()
    return [(i // scores.shape[1], i % scores.shape[1]) for i in order]


def spearman(a: list, b: list) -> float:
    pos_b = {h: i for i, h in enumerate(b)}
    ra = torch.arange(len(a), dtype=torch.float64)
    rb = torch.tensor([pos_b[h] for h in a], dtype=torch.float64)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def retrieval_heads(k: int = 13) -> list[tuple[int, int]]:
    from prune_heads.data.probes import passkey_probe
    from prune_heads.models.loading import load_model
    from prune_heads.scoring.retrieval import retrieval_scores

    lm = load_model("smollm2-135m", "float32", "cpu")
    scores = retrieval_scores(lm, passkey_probe(lm, (256,), 8, seed=7))
    top = torch.topk(scores.flatten(), k).indices.tolist()
    return [(i // scores.shape[1], i % scores.shape[1]) for i in top]


def main() -> None:
    args = sys.argv[1:]
    calibrated, with_retrieval = "--calibrated" in args, "--retrieval" in args
    extra = [a for a in args if a not in ("--calibrated", "--retrieval")]
    print(f"machine: {machine()}")
    plain = run(extra, "guarded")
    say_guard(plain, "readme")
    if not calibrated:
        return
    cal = run(extra + ["--calibrate-probes"], "calibrated")
    say_guard(cal, "calibrated")
    a, b = ranking(plain), ranking(cal)
    result("ranking_spearman", round(spearman(a, b), 4))
    for k in (9, 27, 54):
        result(f"top{k}_dormant_overlap", len(set(a[:k]) & set(b[:k])))
    chosen_a = {(int(layer), h) for layer, hs in plain["heads"].items() for h in hs}
    chosen_b = {(int(layer), h) for layer, hs in cal["heads"].items() for h in hs}
    result("chosen_common", len(chosen_a & chosen_b))
    if with_retrieval:
        heads = retrieval_heads()
        result("retrieval_heads", heads)
        for name, order in (("plain", a), ("calibrated", b)):
            ranks = sorted(order.index(h) for h in heads)
            result(f"{name}_retrieval_dormancy_ranks", ranks)


if __name__ == "__main__":
    main()
