"""Budget search: the largest prefix of the dormant-first ranking whose static ablation stays within budget.

Accuracy is not monotone in the number of heads removed, so the search keeps every evaluated point (the
curve) and picks the largest evaluated size that is within budget. A coarse grid runs upwards until
``patience`` grid points in a row fail, then bisection refines between the best passing size and the
next failing one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prune_heads.console import say
from prune_heads.eval.results import EvalResult, PairedDelta
from prune_heads.eval.textkl import text_measures
from prune_heads.heads import HeadSet
from prune_heads.plan.planner import objective_value
from prune_heads.search.budget import Budget, judge
from prune_heads.search.units import UnitRanking, head_units

DEFAULT_GRID = (0.025, 0.05, 0.075, 0.10, 0.125, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50)


@dataclass(frozen=True)
class SearchOptions:
    """How the search walks the ranking: the coarse grid (fractions of all heads), how many failing grid points in a
    row end it, the bisection steps after it, how many grid points share forward passes, and what the chosen point
    maximises (``objective``: params, kv-cache, flops or heads)."""

    grid: tuple[float, ...] = DEFAULT_GRID
    patience: int = 2
    refine_steps: int = 3
    parallel: int = 1
    objective: str = "params"  # the product's default (Settings takes these defaults); "heads" is the paper's count


class PointEvaluator(Protocol):
    """What the search asks of the model: its unablated result, the budget, a head set's evaluation (several at once
    when ``parallel > 1``), and what the export of a head set would save (None: not known)."""

    baseline: EvalResult
    budget: Budget

    def evaluate(self, heads: HeadSet, label: str) -> EvalResult: ...

    def evaluate_group(self, sets: list[HeadSet], labels: list[str]) -> list[EvalResult]: ...

    def savings(self, heads: HeadSet) -> dict | None: ...


@dataclass
class SearchPoint:
    num_heads: int
    fraction: float
    heads: HeadSet
    accuracy: float
    delta: PairedDelta
    within_budget: bool
    phase: str  # "baseline" | "grid" | "refine" | "balanced" | "step-back" (report.json: "phase")
    result: EvalResult = field(repr=False, compare=False, default=None)  # per-question results (not in to_json)
    kl: float = 0.0  # mean KL(unablated || ablated) over the four answer letters, nats
    agreement: float = 1.0  # share of questions answered as the unablated model does
    units: int = 0  # removal units in the prefix (units.py); equal to num_heads for per-head units
    savings: dict | None = None  # what the model that ships for these heads saves (Planner.savings)

    @property
    def kl_text(self) -> float | None:
        """Mean next-token KL from the unablated model on held-out text, nats (when it was measured)."""
        return None if self.result is None else self.result.meta.get("kl_text")

    def to_json(self) -> dict:
        extra = {} if self.result is None else text_measures(self.result.meta)
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
            "phase": self.phase,
            "units": self.units,
            **({"shipped": self.savings} if self.savings is not None else {}),
        }


@dataclass
class SearchResult:
    points: list[SearchPoint] = field(default_factory=list)
    best: SearchPoint | None = None

    def curve(self) -> list[SearchPoint]:
        return sorted(self.points, key=lambda p: p.num_heads)


class Prefixes:
    """Each prefix of the unit ranking evaluated once, in the order asked (each point said as it is judged);
    coarse-grid prefixes optionally prefetched together."""

    def __init__(self, ranking: UnitRanking, evaluator: PointEvaluator):
        self.ranking, self.evaluator = ranking, evaluator
        self.result = SearchResult()
        self.done: dict[int, SearchPoint] = {}
        self.precomputed: dict[int, EvalResult] = {}

    def label(self, k: int) -> str:
        if all(u.kind == "head" for u in self.ranking.units):
            return f"{k}/{len(self.ranking)} heads off"
        return f"{self.ranking.num_heads(k)}/{self.ranking.total_heads} heads off ({k} units)"

    def prefetch(self, ks: list[int]) -> None:
        todo = [k for k in ks if k not in self.done and k not in self.precomputed and k > 0]
        if len(todo) < 2:
            return
        sets = [self.ranking.heads(k) for k in todo]
        for k, res in zip(todo, self.evaluator.evaluate_group(sets, [self.label(k) for k in todo])):
            self.precomputed[k] = res

    def point(self, k: int, phase: str) -> SearchPoint:
        if k in self.done:
            return self.done[k]
        heads, ev = self.ranking.heads(k), self.evaluator
        res = (ev.baseline if k == 0 else self.precomputed.pop(k, None) or ev.evaluate(heads, self.label(k)))
        delta, kl, agree, ok = judge(ev.budget, res, ev.baseline)
        p = SearchPoint(len(heads), len(heads) / self.ranking.total_heads, heads, res.accuracy, delta, ok, phase, res,
                        kl, agree, k, ev.savings(heads))
        self.done[k] = p
        self.result.points.append(p)
        say_point(p)
        return p


def say_point(p: SearchPoint) -> None:
    """One line per evaluated point (none for the unablated one)."""
    if not p.num_heads:
        return
    mark = "within budget" if p.within_budget else "over budget"
    ships = f"  ships -{p.savings['attention_params_removed']:,} attn params" if p.savings else ""
    say(f"  {p.num_heads:4d} heads ({100 * p.fraction:5.1f}%){ships}: {100 * p.accuracy:6.2f}%  "
        f"delta {p.delta.delta:+.2f} pt [{p.delta.ci_low:+.2f}, {p.delta.ci_high:+.2f}]  "
        f"KL {p.kl:.4f} nat" + (f"  text KL {p.kl_text:.4f} nat" if p.kl_text is not None else "")
        + f"  agree {100 * p.agreement:5.1f}%  {mark}"
        + (f" (decided after {p.delta.n} questions)" if p.result.meta.get("stopped_early") else ""))


def search_budget(ranking: "list[tuple[int, int]] | UnitRanking", evaluator: PointEvaluator,
                  options: SearchOptions = SearchOptions()) -> SearchResult:
    """Grow prefixes of ``ranking`` (removal units, or (layer, head) pairs: one unit each); the grid is in fractions
    of all heads. With ``options.parallel > 1`` that many coarse-grid points are evaluated in the same forward passes
    (points past the stopping rule that were evaluated anyway stay on the curve). The chosen point is the passing
    point that maximises ``options.objective`` in the model that ships, the largest on ties."""
    if not isinstance(ranking, UnitRanking):
        ranking = UnitRanking(head_units(ranking), len(ranking))
    points = Prefixes(ranking, evaluator)
    points.point(0, "baseline")
    best_k, first_fail_above = _grid(points, ranking, options)
    # Refine between the best passing size and the first failing size above it.
    lo, hi = best_k, first_fail_above
    for _ in range(options.refine_steps):
        if hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if points.point(mid, "refine").within_budget:
            lo = mid
        else:
            hi = mid
    result = points.result
    result.best = max((p for p in result.points if p.within_budget),
                      key=lambda p: (objective_value(options.objective, p), p.num_heads))
    return result


def _grid(points: Prefixes, ranking: UnitRanking, options: SearchOptions) -> tuple[int, int | None]:
    """The coarse grid upwards until ``patience`` points in a row fail: (best passing size, first failing size
    above it)."""
    grid = options.grid
    sizes = sorted({ranking.prefix_for_fraction(f) for f in grid if 0 < f <= 1} - {0}) if len(ranking) else []
    best_k, fails_in_row, first_fail_above = 0, 0, None
    for i, k in enumerate(sizes):
        if options.parallel > 1 and i % options.parallel == 0:
            points.prefetch(sizes[i:i + options.parallel])
        if points.point(k, "grid").within_budget:
            best_k, fails_in_row, first_fail_above = k, 0, None
        else:
            fails_in_row += 1
            first_fail_above = first_fail_above or k
            if fails_in_row >= options.patience:
                break
    return best_k, first_fail_above
