"""Budget search: the largest prefix of the dormant-first ranking whose static ablation stays within budget.

Accuracy is not monotone in the number of heads removed, so the search keeps every evaluated point (the
curve) and picks the largest evaluated size that is within budget. A coarse grid runs upwards until
``patience`` grid points in a row fail, then bisection refines between the best passing size and the
next failing one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from prune_heads.errors import UserError
from prune_heads.eval.passes import EvalResult, PairedDelta, agreement, answer_kl, paired_delta, restricted
from prune_heads.heads import HeadSet
from prune_heads.search.units import UnitRanking, head_units

DEFAULT_GRID = (0.025, 0.05, 0.075, 0.10, 0.125, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50)


METRICS = ("accuracy", "kl", "kl-text")
MAX_NATS = 100.0  # a KL budget beyond this accepts any model
# --metric values that also name the task they are measured on (the accuracy of that task)
METRIC_TASKS = {"mmlu": "mmlu", "mmlu-cloze": "mmlu-cloze"}
METRIC_CHOICES = ("mmlu", "mmlu-cloze", "accuracy", "kl", "kl-text")


@dataclass(frozen=True)
class Budget:
    """``accuracy``: at most ``points`` accuracy points below the unablated model on the same questions.
    ``kl``: at most ``points`` nats of mean KL divergence from the unablated model's distribution over the choices
    (the four answer letters on MMLU; it measures damage even on a model that answers at chance).
    ``kl-text``: at most ``points`` nats of mean next-token KL from the unablated model on held-out text."""

    points: float
    metric: str = "accuracy"
    text: str = field(default="", compare=False)  # as the user wrote it (reports quote it)
    rule: str = field(default="point", compare=False)  # --decision: point (the paper's) | confident (non-inferiority)

    @staticmethod
    def parse(text: str | float, metric: str | None = None) -> "Budget":
        named, metric = metric, ("accuracy" if metric in METRIC_TASKS else metric)
        raw = str(text).strip().lower()
        m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(%|pt|pts|points?|nats?)?", raw)
        if not m:
            raise UserError(
                f"--budget {text!r} is not a budget; write accuracy points as 1%, 0.5 or 2pt (at most that many points "
                "below the unablated model), or nats of KL as 0.05nat"
            )
        value, unit = float(m.group(1)), m.group(2) or ""
        unit_metric = "kl" if unit.startswith("nat") else ("accuracy" if unit else None)
        in_nats = metric in ("kl", "kl-text")
        if metric and unit_metric and in_nats != (unit_metric == "kl"):
            raise UserError(f"--budget {text!r} is in {'nats' if unit_metric == 'kl' else 'accuracy points'}, but "
                            f"--metric is {named}; use --metric {'kl' if unit_metric == 'kl' else 'accuracy'} or a "
                            f"budget in {'nats (0.05nat)' if in_nats else 'points (1%)'}")
        metric = metric or unit_metric or "accuracy"
        if metric not in METRICS:
            raise UserError(f"--metric {metric!r} is not one of {', '.join(METRIC_CHOICES)}")
        if value < 0 or (metric == "accuracy" and value > 100):
            raise UserError(f"--budget {text!r} is out of range; it must be between 0 and 100 accuracy points")
        if metric != "accuracy" and value > MAX_NATS:
            raise UserError(f"--budget {text!r} is out of range; a KL budget is at most {MAX_NATS:g} nats (0.02-0.1 "
                            "is typical)")
        return Budget(value, metric, str(text))

    @property
    def in_nats(self) -> bool:
        return self.metric in ("kl", "kl-text")

    def allows(self, delta: PairedDelta, kl: float = 0.0, kl_text: float | None = None, kl_se: float = 0.0,
               kl_text_se: float = 0.0, z: float = 1.96) -> bool:
        """``point``: the estimate is within budget. ``confident``: the one-sided 97.5% bound is (for accuracy the
        lower end of the paired difference's 95% interval, for a KL the mean plus 1.96 standard errors)."""
        sure = self.rule == "confident"
        if self.metric == "kl":
            return kl + (z * kl_se if sure else 0.0) <= self.points + 1e-12
        if self.metric == "kl-text":
            if kl_text is None:
                raise ValueError("a kl-text budget needs the next-token KL of every evaluated point")
            return kl_text + (z * kl_text_se if sure else 0.0) <= self.points + 1e-12
        return (delta.ci_low if sure else delta.delta) >= -self.points - 1e-9

    def __str__(self) -> str:
        sure = " (confident: 97.5% bound)" if self.rule == "confident" else ""
        if self.metric == "kl":
            return f"{self.points:g} nats of answer KL{sure}"
        if self.metric == "kl-text":
            return f"{self.points:g} nats of next-token KL on held-out text{sure}"
        return f"{self.points:g} accuracy points{sure}"


def judge(budget: Budget, result: EvalResult, baseline: EvalResult) -> tuple[PairedDelta, float, float, bool]:
    """(paired accuracy delta, mean answer KL in nats, answer agreement, within budget) of one evaluation, on the
    questions it covers."""
    baseline = restricted(baseline, result)
    delta = paired_delta(result, baseline)
    kls = answer_kl(result, baseline)
    kl = float(kls.mean())
    kl_se = float(kls.std(unbiased=True)) / kls.numel() ** 0.5 if kls.numel() > 1 else float("inf")
    ok = budget.allows(delta, kl, result.meta.get("kl_text"), kl_se, result.meta.get("kl_text_se", 0.0))
    return delta, kl, agreement(result, baseline), ok


def decided_over_budget(budget: Budget, partial: EvalResult, baseline_part: EvalResult, z: float = 1.96) -> bool:
    """Early stop: on the questions evaluated so far, does the 95% CI already put this point over budget? (accuracy:
    the paired difference's upper bound is below -budget; kl: the lower bound of the mean answer KL is above the
    budget). Points within budget are always evaluated on every question, so the chosen one is never partial."""
    if budget.metric == "accuracy":
        return paired_delta(partial, baseline_part, z).ci_high < -budget.points
    if budget.metric == "kl":
        kl = answer_kl(partial, baseline_part)
        n = kl.numel()
        if n < 2:
            return False
        se = float(kl.std(unbiased=True)) / n ** 0.5
        return float(kl.mean()) - z * se > budget.points
    return False  # kl-text is measured on other texts, all at once


@dataclass
class SearchPoint:
    num_heads: int
    fraction: float
    heads: HeadSet
    accuracy: float
    delta: PairedDelta
    within_budget: bool
    stage: str  # "baseline" | "grid" | "refine"
    result: EvalResult = field(repr=False, compare=False, default=None)  # per-question results (not in to_json)
    kl: float = 0.0  # mean KL(unablated || ablated) over the four answer letters, nats
    agreement: float = 1.0  # share of questions answered as the unablated model does
    units: int = 0  # removal units in the prefix (units.py); equal to num_heads for per-head units
    shipped: dict | None = None  # what the model that ships for these heads saves (planning.Planner.shipped)

    @property
    def kl_text(self) -> float | None:
        """Mean next-token KL from the unablated model on held-out text, nats (when it was measured)."""
        return None if self.result is None else self.result.meta.get("kl_text")

    def to_json(self) -> dict:
        extra = {} if self.kl_text is None else {"kl_text_nats": round(self.kl_text, 6)}
        return {
            "num_heads": self.num_heads,
            "fraction": round(self.fraction, 6),
            "accuracy": round(self.accuracy, 6),
            **self.delta.to_json(),
            "kl_answer_nats": round(self.kl, 6),
            "agreement": round(self.agreement, 6),
            **extra,
            **({"stopped_early": True} if self.result is not None and self.result.meta.get("stopped_early") else {}),
            "within_budget": self.within_budget,
            "stage": self.stage,
            "units": self.units,
            **({"shipped": self.shipped} if self.shipped is not None else {}),
        }


@dataclass
class SearchResult:
    points: list[SearchPoint] = field(default_factory=list)
    best: SearchPoint | None = None

    def curve(self) -> list[SearchPoint]:
        return sorted(self.points, key=lambda p: p.num_heads)


class _Evaluated:
    """Each prefix of the unit ranking evaluated once, in the order asked; coarse-grid prefixes optionally prefetched
    together. ``describe(heads)`` adds what the shipped model saves to each point."""

    def __init__(self, ranking: UnitRanking, evaluate_heads, baseline, budget, on_point, evaluate_group, describe):
        self.ranking, self.evaluate_heads, self.baseline, self.budget = ranking, evaluate_heads, baseline, budget
        self.on_point, self.evaluate_group, self.describe = on_point, evaluate_group, describe
        self.result = SearchResult()
        self.done: dict[int, SearchPoint] = {}
        self.precomputed: dict[int, EvalResult] = {}

    def label(self, k: int) -> str:
        if all(u.kind == "head" for u in self.ranking.units):
            return f"{k}/{len(self.ranking)} heads off"
        return f"{self.ranking.num_heads(k)}/{self.ranking.total_heads} heads off ({k} units)"

    def prefetch(self, ks: list[int]) -> None:
        todo = [k for k in ks if k not in self.done and k not in self.precomputed and k > 0]
        if self.evaluate_group is None or len(todo) < 2:
            return
        sets = [self.ranking.heads(k) for k in todo]
        for k, res in zip(todo, self.evaluate_group(sets, [self.label(k) for k in todo])):
            self.precomputed[k] = res

    def point(self, k: int, stage: str) -> SearchPoint:
        if k in self.done:
            return self.done[k]
        heads = self.ranking.heads(k)
        res = (self.baseline if k == 0 else self.precomputed.pop(k, None)
               or self.evaluate_heads(heads, self.label(k)))
        delta, kl, agree, ok = judge(self.budget, res, self.baseline)
        p = SearchPoint(len(heads), len(heads) / self.ranking.total_heads, heads, res.accuracy, delta, ok, stage, res,
                        kl, agree, k, self.describe(heads) if self.describe else None)
        self.done[k] = p
        self.result.points.append(p)
        if self.on_point:
            self.on_point(p)
        return p


def search_budget(
    ranking: "list[tuple[int, int]] | UnitRanking",
    evaluate_heads: Callable[[HeadSet, str], EvalResult],
    baseline: EvalResult,
    budget: Budget,
    grid: tuple[float, ...] = DEFAULT_GRID,
    patience: int = 2,
    refine_steps: int = 3,
    on_point: Callable[[SearchPoint], None] | None = None,
    evaluate_group: Callable[[list[HeadSet], list[str]], list[EvalResult]] | None = None,
    parallel: int = 1,
    describe: Callable[[HeadSet], dict] | None = None,
    objective: Callable[[SearchPoint], float] | None = None,
) -> SearchResult:
    """Grow prefixes of ``ranking`` (removal units, or (layer, head) pairs: one unit each); the grid is in fractions
    of all heads. ``evaluate_group`` with ``parallel > 1`` evaluates that many coarse-grid points in the same forward
    passes (points past the stopping rule that were evaluated anyway stay on the curve). The chosen point is the
    passing point that maximises ``objective`` (default: heads zeroed), the largest on ties."""
    if not isinstance(ranking, UnitRanking):
        ranking = UnitRanking(head_units(ranking), len(ranking))
    points = _Evaluated(ranking, evaluate_heads, baseline, budget, on_point, evaluate_group, describe)
    points.point(0, "baseline")
    sizes = sorted({ranking.prefix_for_fraction(f) for f in grid if 0 < f <= 1} - {0}) if len(ranking) else []
    best_k, fails_in_row, first_fail_above = 0, 0, None
    for i, k in enumerate(sizes):
        if parallel > 1 and i % parallel == 0:
            points.prefetch(sizes[i:i + parallel])
        if points.point(k, "grid").within_budget:
            best_k, fails_in_row, first_fail_above = k, 0, None
        else:
            fails_in_row += 1
            first_fail_above = first_fail_above or k
            if fails_in_row >= patience:
                break
    # Refine between the best passing size and the first failing size above it.
    lo, hi = best_k, first_fail_above
    for _ in range(refine_steps):
        if hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if points.point(mid, "refine").within_budget:
            lo = mid
        else:
            hi = mid
    result = points.result
    value = objective or (lambda p: p.num_heads)
    result.best = max((p for p in result.points if p.within_budget), key=lambda p: (value(p), p.num_heads))
    return result
