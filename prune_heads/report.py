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


def chance_level(result: EvalResult) -> float:
    """Accuracy of guessing: the mean over questions of 1 / number of choices (0.25 on MMLU, 0.5 on PIQA)."""
    return sum(1 / len(q.choices) for q in result.questions) / max(1, len(result.questions))


def accuracy_summary(result: EvalResult) -> dict:
    n = len(result.questions)
    k = float(result.correct.sum())
    lo, hi = wilson_interval(k, n)
    return {
        "accuracy": round(result.accuracy, 6),
        "correct": int(k),
        "n": n,
        "ci95": [round(lo, 6), round(hi, 6)],
        "chance": round(chance_level(result), 6),
        "indistinguishable_from_chance": indistinguishable_from_chance(result, chance_level(result)),
    }


def chance_warning(result: EvalResult, metric: str = "accuracy", task: str = "mmlu") -> str | None:
    chance = chance_level(result)
    if not indistinguishable_from_chance(result, chance):
        return None
    s = accuracy_summary(result)
    if metric in ("kl", "kl-text"):
        consequence = (f"an accuracy budget on this model verifies nothing (the {metric} budget in use still measures "
                       "how far ablation moves the model)")
    else:
        consequence = ("an accuracy budget on this model verifies nothing; consider --budget 0.05nat (--metric kl)"
                       + (" or --metric mmlu-cloze" if task == "mmlu" else ""))
    return (
        f"the unablated model scores {100 * s['accuracy']:.1f}% on {s['n']} {task} questions (95% CI "
        f"{100 * s['ci95'][0]:.1f}-{100 * s['ci95'][1]:.1f}%), which cannot be told apart from chance "
        f"({100 * chance:.0f}%): " + consequence
    )


def write_eval_outputs(out: Path, result: EvalResult, extra: dict, task: str = "mmlu") -> None:
    write_jsonl(out / f"{task}.jsonl", result.rows())
    write_json(out / "summary.json", {**extra, "accuracy": accuracy_summary(result), task: accuracy_summary(result)})
