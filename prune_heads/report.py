"""What a run leaves behind: report.json (everything needed to audit it), heads.json, mmlu.jsonl."""
from __future__ import annotations

import platform
import sys
from pathlib import Path

from . import __version__
from .evaluation import EvalResult, indistinguishable_from_chance, wilson_interval
from .fileio import write_json, write_jsonl


def versions() -> dict:
    import torch
    import transformers

    return {
        "prune_heads": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def accuracy_summary(result: EvalResult) -> dict:
    n = len(result.questions)
    k = float(result.correct.sum())
    lo, hi = wilson_interval(k, n)
    return {
        "accuracy": round(result.accuracy, 6),
        "correct": int(k),
        "n": n,
        "ci95": [round(lo, 6), round(hi, 6)],
        "indistinguishable_from_chance": indistinguishable_from_chance(result),
    }


def chance_warning(result: EvalResult, metric: str = "mmlu") -> str | None:
    if not indistinguishable_from_chance(result):
        return None
    s = accuracy_summary(result)
    consequence = ("an accuracy budget on this model verifies nothing (the kl budget in use still measures how far "
                   "ablation moves its answers)" if metric == "kl" else
                   "an accuracy budget on this model verifies nothing; consider --budget 0.05nat (--metric kl)")
    return (
        f"the unablated model scores {100 * s['accuracy']:.1f}% on {s['n']} MMLU questions (95% CI "
        f"{100 * s['ci95'][0]:.1f}-{100 * s['ci95'][1]:.1f}%), which cannot be told apart from chance (25%): "
        + consequence
    )


def write_eval_outputs(out: Path, result: EvalResult, extra: dict) -> None:
    write_jsonl(out / "mmlu.jsonl", result.rows())
    write_json(out / "summary.json", {**extra, "mmlu": accuracy_summary(result)})
