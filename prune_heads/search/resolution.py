"""Resolution: the interval half-width a search point will have at a question count, predicted before the search
spends it, and the question count that makes the budget resolvable (``--mmlu-per-subject auto``).

A point is judged by a paired per-question quantity: the change in correctness (-1, 0, +1) for an accuracy budget, the
answer KL for a ``kl`` budget. Its half-width at ``n`` questions is ``1.96 sd / sqrt(n)``, where ``sd`` is the
per-question standard deviation of a point *at the budget's edge*. It is estimated from a pilot ablation (the
search's own first grid point, so the search reuses it from the cache):

- accuracy: the pilot's per-question sd of the correctness change, but never less than the least a point at the edge
  can have: a delta of ``-b`` (b = budget / 100) needs at least a share ``b`` of questions to flip, so
  ``sd >= sqrt(b (1 - b))``;
- answer KL (and next-token KL per held-out text, for ``kl-text``): a scale quantity, so the pilot's coefficient
  of variation times the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prune_heads.eval.results import EvalResult, answer_kl, restricted
from prune_heads.search.budget import Budget

Z = 1.96  # the two-sided 95% interval the search prints (and the one-sided 97.5% bound of --decision confident)


@dataclass(frozen=True)
class Resolution:
    """What a question count can tell apart at the budget's edge, in the budget's unit (points or nats)."""

    budget: Budget
    edge_sd: float  # per-question sd of a point at the budget's edge (points for accuracy, nats for KL)
    questions: int  # the planned question count
    pilot: str  # what the sd was estimated from

    def half_width(self, n: int | None = None) -> float:
        n = self.questions if n is None else n
        return Z * self.edge_sd / math.sqrt(n) if n > 0 else float("inf")

    def questions_for(self, width: float) -> int:
        """The fewest questions whose predicted half-width is at most ``width``."""
        return max(1, math.ceil((Z * self.edge_sd / width) ** 2)) if width > 0 else 0

    @property
    def resolves(self) -> bool:
        return self.half_width() <= self.budget.limit

    def describe(self, full: int | None = None, task: str = "mmlu") -> str:
        unit = "nat" if self.budget.in_nats else "pt"
        what = "held-out texts" if self.budget.on_text else "questions"
        text = (f"{self.questions} {what} resolve +/-{self.half_width():.3g} {unit} at the budget's edge "
                f"(budget {self.budget.limit:g} {unit}; estimated from {self.pilot})")
        if full and full != self.questions and what == "questions":
            text += f"; the full {task} ({full:,} questions) would resolve +/-{self.half_width(full):.3g} {unit}"
        return text

    def to_json(self, full: int | None = None) -> dict:
        out = {"questions": self.questions, "predicted_half_width": round(self.half_width(), 6),
               "edge_sd": round(self.edge_sd, 6), "unit": "nats" if self.budget.in_nats else "points",
               "resolves_budget": self.resolves, "pilot": self.pilot,
               "questions_to_resolve_budget": self.questions_for(self.budget.limit)}
        if full:
            out.update(full_task_questions=full, full_task_half_width=round(self.half_width(full), 6))
        return out


def edge_sd(budget: Budget, pilot: EvalResult, baseline: EvalResult) -> float:
    """Per-question sd of a point at the budget's edge, from one pilot ablation (see the module's docstring)."""
    baseline = restricted(baseline, pilot)
    if budget.metric == "accuracy":
        b = min(budget.limit / 100.0, 0.5)
        d = (pilot.correct - baseline.correct).double()
        observed = float(d.std(unbiased=True)) if d.numel() > 1 else 0.0
        return 100.0 * max(observed, math.sqrt(b * (1 - b)))
    if budget.spec.proportion:  # one 0/1 change per text: a proportion at the budget's edge
        b = min(budget.limit / 100.0, 0.5)
        return 100.0 * math.sqrt(b * (1 - b))
    if budget.on_text:
        return pilot.meta["text_damage_cv"] * budget.limit
    return coefficient_of_variation(answer_kl(pilot, baseline).double()) * budget.limit


def coefficient_of_variation(values: torch.Tensor) -> float:
    """sd / mean of non-negative per-question values; when the pilot changed nothing, the worst case of a
    one-question effect (sd = mean x sqrt(n - 1))."""
    n = values.numel()
    mean = float(values.mean()) if n else 0.0
    if n < 2 or mean <= 0:
        return math.sqrt(max(n - 1, 1))
    return float(values.std(unbiased=True)) / mean


def predict(budget: Budget, pilot: EvalResult, baseline: EvalResult, questions: int, label: str) -> Resolution:
    return Resolution(budget, edge_sd(budget, pilot, baseline), questions, label)


def per_subject_for(resolution: Resolution, subjects: int, cap: int | None) -> tuple[int, bool]:
    """(questions per subject whose predicted half-width fits the budget, whether ``cap`` cut it short)."""
    need = math.ceil(resolution.questions_for(resolution.budget.limit) / max(subjects, 1))
    if cap is not None and need > cap:
        return max(cap, 1), True
    return max(need, 1), False
