"""Study mode: the paper's comparison of score functions (``prune-heads study``).

For each score function, its per-input per-head scores on the evaluation inputs are pooled into one empirical
distribution, and thresholds are taken that select p = 0, 5, 10, ... % of it (respecting the function's
direction: for ``awft`` a high score marks a dormant head). Three ablation modes are then evaluated:

- dynamic (the paper's): on each input, the heads whose score *on that input* passes the threshold are zeroed;
- static: the p% most dormant heads by the calibration-set mean score, fixed for every input;
- random: p% of heads drawn at random (one seeded permutation, so the sets grow with p), a baseline.

Each (function, percent, mode) point records the % of heads actually zeroed (mean over inputs) and the accuracy on
what the study judges by (study_tasks.py): a multiple-choice task (the paper's MMLU), or a long-context probe (the
share of pass keys read back, of repeated tokens predicted), so the comparison can be repeated for retrieval.
Per function and mode: the largest % zeroed within the budget, by linear interpolation along the curve
(the last crossing of baseline - budget), and the normalised area under the accuracy curve (trapezoid area / x
range). Functions are ranked by the first, then the second. The max % comes with a 95% bootstrap interval over
questions, and the ranking says which functions cannot be told apart on these questions. Every evaluation is
cached (cached_steps.py), so a study resumes where it stopped and a later study with more functions reuses what is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from prune_heads.console import say
from prune_heads.errors import UserError
from prune_heads.eval.results import Judged, paired_delta
from prune_heads.heads import SCORE_KEYS, HeadSet, ScoreTable, score_direction
from prune_heads.io.readers import read_json
from prune_heads.plan.ablation import dynamic_masks
from prune_heads.report.markdown import plain
from prune_heads.report.study_tasks import StudyTask

DEFAULT_PERCENTS = (0, 5, 10, 15, 20, 25, 30)
MODES = ("dynamic", "static", "random")


def thresholds(per_input: torch.Tensor, direction: str, percents) -> dict[float, float]:
    """For each p, the threshold whose selection (``<=`` for "low", ``>=`` for "high") takes p% of the pooled
    per-input per-head scores. p = 0 selects nothing (an infinite threshold)."""
    pooled = per_input.double().flatten().sort().values
    if direction == "high":
        pooled = pooled.flip(0)
    n = pooled.numel()
    out = {}
    for p in percents:
        k = round(p / 100 * n)
        if k <= 0:
            out[p] = float("-inf") if direction == "low" else float("inf")
        else:
            out[p] = float(pooled[min(k, n) - 1])
    return out


def max_within(xs: list[float], ys: list[float], target: float) -> float:
    """The largest x at which the piecewise-linear curve (xs ascending) is still at or above ``target``: the last
    point if the curve ends there, else the last crossing from above to below, interpolated; 0 if it never is."""
    if not xs:
        return 0.0
    if ys[-1] >= target:
        return xs[-1]
    for i in range(len(xs) - 1, 0, -1):
        if ys[i - 1] >= target > ys[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return x0 + (y0 - target) / (y0 - y1) * (x1 - x0)
    return 0.0


def normalised_auc(xs: list[float], ys: list[float]) -> float:
    """Trapezoid area under the curve divided by its x range (the mean height); the single y if the range is 0."""
    if len(xs) < 2 or xs[-1] == xs[0]:
        return float(ys[0]) if ys else float("nan")
    area = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))
    return area / (xs[-1] - xs[0])


@dataclass
class StudyPoint:
    function: str  # a score key, or "random"
    mode: str
    percent: float  # the requested p
    threshold: float | None
    zeroed: float  # % of heads actually zeroed, mean over inputs
    accuracy: float
    delta: dict
    measures: dict  # the task's other figures against the unablated model (answer KL and agreement, probe losses)
    correct: torch.Tensor | None = field(default=None, repr=False)  # per input, 1.0 where right (the bootstrap's)

    def to_json(self) -> dict:
        thr = self.threshold
        return {"function": self.function, "mode": self.mode, "percent": self.percent,
                "threshold": None if thr is None or abs(thr) == float("inf") else round(thr, 8),
                "zeroed_percent": round(self.zeroed, 4), "accuracy": round(self.accuracy, 6), **self.delta,
                **self.measures}


@dataclass
class Curve:
    function: str
    mode: str
    points: list[StudyPoint] = field(default_factory=list)

    def xy(self) -> tuple[list[float], list[float]]:
        pts = sorted(self.points, key=lambda p: (p.zeroed, p.percent))
        return [p.zeroed for p in pts], [100 * p.accuracy for p in pts]


def _point(function, mode, percent, threshold, zeroed, result: Judged, task: StudyTask) -> StudyPoint:
    return StudyPoint(function, mode, percent, threshold, zeroed, float(result.correct.mean()),
                      paired_delta(result, task.baseline).to_json(), task.measures(result), result.correct)


def check_study_args(functions: list[str], percents, modes) -> None:
    """Score functions, percents and modes a study can run (checked before any model loads)."""
    unknown = [f for f in functions if f not in SCORE_KEYS]
    if unknown:
        raise UserError(f"unknown score function(s) {', '.join(unknown)}; choose from: {', '.join(SCORE_KEYS)}")
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise UserError(f"unknown study mode(s) {', '.join(bad_modes)}; choose from: {', '.join(MODES)}")
    if any(not 0 <= p <= 100 for p in percents):
        raise UserError(f"`percents` must lie between 0 and 100, got {', '.join(f'{p:g}' for p in percents)}")


@dataclass(frozen=True)
class StudyPlan:
    """What a study evaluates: score functions, percents of pooled per-input scores, ablation modes, the budget (in
    accuracy points) the curves are judged against, and the seed of the random-heads baseline."""

    functions: list[str]
    percents: tuple[float, ...]
    modes: tuple[str, ...]
    budget_points: float
    seed: int = 0


def study_curves(evaluator: StudyTask, eval_scores: ScoreTable, calib_scores: ScoreTable,
                 plan: StudyPlan) -> dict:
    """``eval_scores``: per-input scores on the evaluation inputs, in question order (dynamic thresholds and masks);
    ``calib_scores``: the calibration set (static selections). Every point is said as it is evaluated."""
    check_study_args(plan.functions, plan.percents, plan.modes)
    num_inputs, layers, heads = eval_scores.per_input[plan.functions[0]].shape
    curves: dict[tuple[str, str], Curve] = {}
    baseline = evaluator.baseline
    for function in plan.functions:
        for mode in plan.modes:
            if mode == "random":
                continue
            _add(curves, _point(function, mode, 0, None, 0.0, baseline, evaluator))
            if mode == "dynamic":
                _dynamic_curve(evaluator, curves, function, eval_scores.per_input[function], plan.percents)
            else:
                _static_curve(evaluator, curves, function, calib_scores.ranking(function), plan.percents,
                              (layers, heads))
    if "random" in plan.modes:
        total = layers * heads
        order = torch.randperm(total, generator=torch.Generator().manual_seed(plan.seed)).tolist()
        _add(curves, _point("random", "random", 0, None, 0.0, baseline, evaluator))
        _static_curve(evaluator, curves, "random", [(i // heads, i % heads) for i in order], plan.percents,
                      (layers, heads))
    summary = summarise(curves, float(baseline.correct.mean()), plan.budget_points, num_inputs, baseline.correct,
                        plan.seed)
    return {**summary, "unit": evaluator.unit, "measure": evaluator.measure}


def _add(curves: dict[tuple[str, str], Curve], point: StudyPoint) -> None:
    curves.setdefault((point.function, point.mode), Curve(point.function, point.mode)).points.append(point)
    if point.percent:
        say(f"  {point.function:10s} {point.mode:8s} p={point.percent:4g}%: {point.zeroed:5.1f}% zeroed  "
            f"{100 * point.accuracy:6.2f}%  delta {point.delta['delta_points']:+.2f} pt")


def _dynamic_curve(evaluator: StudyTask, curves: dict, function: str, per_input: torch.Tensor,
                   percents) -> None:
    """On each input, the heads whose score on that input passes the threshold of p% are zeroed."""
    direction = score_direction(function)
    for p, thr in thresholds(per_input, direction, percents).items():
        if p == 0:
            continue
        masks = dynamic_masks(per_input, thr, direction)  # [N, L, H], 1 keeps a head
        zeroed = 100 * float((masks == 0).double().mean())
        res = evaluator.evaluate(masks, f"{function} dynamic {p:g}%")
        _add(curves, _point(function, "dynamic", p, thr, zeroed, res, evaluator))


def _static_curve(evaluator: StudyTask, curves: dict, function: str, order: list[tuple[int, int]], percents,
                  grid: tuple[int, int]) -> None:
    """The first p% of ``order`` (a ranking by calibration score, or a random order) zeroed for every input."""
    layers, heads = grid
    total = layers * heads
    mode = "random" if function == "random" else "static"
    for p in percents:
        k = round(p / 100 * total)
        if k <= 0:
            continue
        hs = HeadSet.from_pairs(order[:k])
        label = f"random {p:g}%" if mode == "random" else f"{function} static {p:g}%"
        res = evaluator.evaluate(hs.mask(layers, heads), label)
        _add(curves, _point(function, mode, p, None, 100 * k / total, res, evaluator))


def summarise(curves: dict[tuple[str, str], Curve], baseline_accuracy: float, budget_points: float, inputs: int,
              baseline_correct: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Per curve: max % within budget and AUC; per mode: the ranking. With per-question results, each max % gets a
    bootstrap interval over questions, and each function lists those it cannot be told apart from (the 95% interval
    of the paired bootstrap difference of their max % contains 0)."""
    target = 100 * baseline_accuracy - budget_points
    summary: dict = {"baseline_accuracy": round(baseline_accuracy, 6), "budget_points": budget_points,
                     "inputs": inputs, "curves": [], "ranking": {}}
    boot = bootstrap_max_within(curves, baseline_correct, budget_points, seed=seed)
    by_mode: dict[str, list[dict]] = {}
    for key, curve in curves.items():
        xs, ys = curve.xy()
        row = {"function": key[0], "mode": key[1], "max_percent_within_budget": round(max_within(xs, ys, target), 4),
               "auc": round(normalised_auc(xs, ys), 4),
               "points": [p.to_json() for p in sorted(curve.points, key=lambda p: p.zeroed)]}
        if boot is not None:
            lo, hi = torch.quantile(boot[key], torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            row["max_percent_ci"] = [round(lo, 4), round(hi, 4)]
        summary["curves"].append(row)
        by_mode.setdefault(key[1], []).append(row)
    for mode, rows in by_mode.items():
        ordered = sorted(rows, key=lambda r: (-r["max_percent_within_budget"], -r["auc"], r["function"]))
        for rank, r in enumerate(ordered, 1):
            r["rank"] = rank
            if boot is not None:
                r["indistinguishable_from"] = [o["function"] for o in ordered if o is not r and not _apart(
                    boot[(r["function"], mode)], boot[(o["function"], mode)])]
        summary["ranking"][mode] = [r["function"] for r in ordered]
    if boot is not None:
        summary["bootstrap"] = {"resamples": int(next(iter(boot.values())).numel()), "seed": seed,
                                "over": "inputs (x values held at their full-sample zeroed %)"}
    summary["best"] = {mode: names[0] for mode, names in summary["ranking"].items() if names and mode != "random"}
    return summary


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the paired bootstrap difference's 95% interval excludes 0."""
    lo, hi = torch.quantile(a - b, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo > 0 or hi < 0


def bootstrap_max_within(curves: dict[tuple[str, str], Curve], baseline_correct: torch.Tensor | None,
                         budget_points: float, resamples: int = 1000, seed: int = 0) -> dict | None:
    """For each curve, ``resamples`` values of its max % within budget, on question sets drawn with replacement
    (the same draws for every curve, so differences are paired). None without per-question results."""
    if baseline_correct is None or any(p.correct is None for c in curves.values() for p in c.points):
        return None
    n = baseline_correct.numel()
    draws = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    weights = torch.zeros(resamples, n, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(resamples, n, dtype=torch.float64)) / n  # [B, N]
    targets = 100 * (weights @ baseline_correct.double()) - budget_points  # [B]
    out = {}
    for key, curve in curves.items():
        pts = sorted(curve.points, key=lambda p: (p.zeroed, p.percent))
        xs = [p.zeroed for p in pts]
        accs = 100 * weights @ torch.stack([p.correct.double() for p in pts]).T  # [B, P]
        out[key] = torch.tensor([max_within(xs, accs[b].tolist(), float(targets[b])) for b in range(resamples)],
                                dtype=torch.float64)
    return out


def markdown(study: dict, model: str, task: str) -> str:
    """The paper's table: function x {max % within budget, AUC, rank}, one block of columns per mode."""
    modes = [m for m in MODES if m in study["ranking"] and m != "random"]
    rows = {(r["function"], r["mode"]): r for r in study["curves"]}
    functions = sorted(
        {r["function"] for r in study["curves"] if r["mode"] != "random"},
        key=lambda f: rows.get((f, modes[0]), {}).get("rank", 0) if modes else 0,
    )
    unit, measure = study.get("unit", "questions"), study.get("measure", "accuracy")
    lines = [
        f"# Score functions on {plain(model)}",
        "",
        f"{plain(task)}, {study['inputs']} {unit}; unablated {measure} {100 * study['baseline_accuracy']:.2f}%; budget "
        f"{study['budget_points']:g} pt. *max %*: the largest % of heads zeroed within the budget (linear "
        f"interpolation along the curve); *AUC*: mean {measure} (%) over the zeroed range.",
        "",
    ]
    if "bootstrap" in study:
        lines += [f"Intervals: 95% bootstrap over {unit} ({study['bootstrap']['resamples']} resamples); *~ ranks*: "
                  "the functions this one cannot be told apart from (their paired difference's interval contains 0).",
                  ""]
    head = "| function |" + "".join(f" {m} max % | {m} AUC | {m} rank |" for m in modes)
    lines += [head, "|---|" + "---|---|---|" * len(modes)]
    for f in functions:
        lines.append(f"| `{f}` |" + "".join(_cells(rows.get((f, m)), rows, m) for m in modes))
    if ("random", "random") in rows:
        r = rows[("random", "random")]
        lines += [
            "",
            f"Random heads (baseline): max % within budget {r['max_percent_within_budget']:.2f}, AUC {r['auc']:.2f}.",
        ]
    for m, best in study["best"].items():
        lines.append(f"\nBest function ({m}): `{best}`.")
    return "\n".join(lines) + "\n"


def _cells(r: dict | None, rows: dict, mode: str) -> str:
    if r is None:
        return " | | |"
    ci = r.get("max_percent_ci")
    pct = f"{r['max_percent_within_budget']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    ties = sorted(rows[(f, mode)]["rank"] for f in r.get("indistinguishable_from", []) if (f, mode) in rows)
    rank = f"{r['rank']}" + (f" (~ {', '.join(map(str, ties))})" if ties else "")
    return f" {pct} | {r['auc']:.2f} | {rank} |"


def read_study(path: str | Path) -> dict:
    """study.json, given as the file or a study output directory."""
    p = Path(path)
    p = p / "study.json" if p.is_dir() else p
    if not p.is_file():
        raise UserError(f"{path} is not a study (no study.json); run prune-heads study `out` DIR first")
    study = read_json(p, "study")
    if not isinstance(study, dict) or "ranking" not in study:
        raise UserError(f"{p} has no function ranking; it was not written by prune-heads study")
    return study
