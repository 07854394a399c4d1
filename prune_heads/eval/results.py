"""What an evaluation found: per-question log-likelihoods of every choice (``EvalResult``) and the paired statistics
the budget is judged by (accuracy delta with its CI, answer KL, agreement), on the same questions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from prune_heads.data.tasks import LETTERS, Question


@dataclass
class EvalResult:
    """Per-question log-likelihoods of the choices, in question order (-inf pads questions with fewer choices)."""

    questions: list[Question]
    loglik: torch.Tensor  # [N, C] float64
    label: str = ""
    meta: dict = field(default_factory=dict)  # extra measurements of the same ablation (kl_text: next-token KL)

    @property
    def gold(self) -> torch.Tensor:
        return torch.tensor([q.gold for q in self.questions])

    @property
    def scores(self) -> torch.Tensor:
        """What the prediction maximises: the log-likelihood (acc), or per character of the choice (acc_norm)."""
        if not self.questions or self.questions[0].norm_lengths is None:
            return self.loglik
        lengths = torch.ones_like(self.loglik)
        for i, q in enumerate(self.questions):
            lengths[i, : len(q.norm_lengths)] = torch.tensor(q.norm_lengths, dtype=torch.float64).clamp(min=1.0)
        return self.loglik / lengths

    @property
    def pred(self) -> torch.Tensor:
        return self.scores.argmax(dim=-1)

    @property
    def correct(self) -> torch.Tensor:
        return (self.pred == self.gold).double()

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean()) if len(self.questions) else float("nan")

    def rows(self) -> list[dict]:
        return [
            {
                "subject": q.subject,
                "index": q.index,
                "gold": LETTERS[q.gold],
                "pred": LETTERS[int(p)],
                "loglik": [round(float(x), 6) for x in ll[: len(q.choices)]],
            }
            for q, p, ll in zip(self.questions, self.pred, self.loglik)
        ]


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def indistinguishable_from_chance(result: EvalResult, chance: float = 0.25) -> bool:
    lo, hi = wilson_interval(float(result.correct.sum()), len(result.questions))
    return lo <= chance <= hi


@dataclass(frozen=True)
class PairedDelta:
    """Ablated minus baseline accuracy on the same questions, in accuracy points, with a 95% CI."""

    delta: float
    ci_low: float
    ci_high: float
    n: int

    def to_json(self) -> dict:
        return {
            "delta_points": round(self.delta, 4),
            "ci95_points": [round(self.ci_low, 4), round(self.ci_high, 4)],
            "n": self.n,
        }


def restricted(baseline: EvalResult, result: EvalResult) -> EvalResult:
    """``baseline`` on exactly ``result``'s questions, in its order (a point stopped early covers only some)."""
    if len(result.questions) == len(baseline.questions):
        return baseline
    position = {(q.subject, q.index): i for i, q in enumerate(baseline.questions)}
    rows = torch.tensor([position[(q.subject, q.index)] for q in result.questions])
    return EvalResult(result.questions, baseline.loglik[rows], baseline.label, baseline.meta)


def in_order_of(reference: EvalResult, result: EvalResult) -> EvalResult:
    """``result`` (the same questions in another order) laid out in ``reference``'s question order."""
    position = {(q.subject, q.index): i for i, q in enumerate(result.questions)}
    rows = torch.tensor([position[(q.subject, q.index)] for q in reference.questions])
    return EvalResult(reference.questions, result.loglik[rows], result.label, result.meta)


def answer_kl(ablated: EvalResult, baseline: EvalResult) -> torch.Tensor:
    """Per question, KL(unablated || ablated) in nats between the two models' distributions over the choices (each
    model's log-likelihoods of the choices renormalised over them: the four answer letters for MMLU)."""
    p = torch.log_softmax(baseline.loglik.double(), dim=-1)
    q = torch.log_softmax(ablated.loglik.double(), dim=-1)
    terms = torch.where(torch.isfinite(p), p.exp() * (p - q), torch.zeros_like(p))  # -inf pads: missing choices
    return terms.sum(-1).clamp(min=0.0)


def agreement(ablated: EvalResult, baseline: EvalResult) -> float:
    return float((ablated.pred == baseline.pred).double().mean())


class Judged(Protocol):
    """Anything judged item by item: ``correct`` is 1.0/0.0 per question, or a share per prompt (a probe's token
    accuracy)."""

    @property
    def correct(self) -> torch.Tensor: ...


def paired_delta(ablated: Judged, baseline: Judged, z: float = 1.96) -> PairedDelta:
    """Ablated minus baseline, item by item, in points, with a normal 95% interval."""
    d = (ablated.correct - baseline.correct) * 100.0
    n = d.numel()
    mean = float(d.mean())
    se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("inf")
    return PairedDelta(mean, mean - z * se, mean + z * se, n)


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
    if metric != "accuracy":
        consequence = (f"an accuracy budget on this model verifies nothing (the {metric} budget in use still measures "
                       "how far ablation moves the model)")
    else:
        consequence = ("an accuracy budget on this model verifies nothing; consider `budget` 0.05nat (`metric` kl)"
                       + (" or `metric` mmlu-cloze" if task == "mmlu" else ""))
    return (
        f"the unablated model scores {100 * s['accuracy']:.1f}% on {s['n']} {task} questions (95% CI "
        f"{100 * s['ci95'][0]:.1f}-{100 * s['ci95'][1]:.1f}%), which cannot be told apart from chance "
        f"({100 * chance:.0f}%): " + consequence
    )
