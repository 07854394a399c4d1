"""What a budget limits and how a point is judged against it: accuracy points on the task, or nats of KL (over the
answer choices, or next-token on held-out text), under the paper's point rule or the confident (non-inferiority) rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from prune_heads.errors import UserError
from prune_heads.eval.results import EvalResult, PairedDelta, agreement, answer_kl, paired_delta, restricted
from prune_heads.eval.textkl import TextDamage


@dataclass(frozen=True)
class Metric:
    """One quantity a budget can limit, registered once in ``REGISTRY``: everything else (``METRICS``, the choices of
    `metric`, the recipe schema, how a point is judged, read back, plotted and described) is derived from it.

    ``unit``: points or nats; ``on_text``: measured on held-out text (the next-token KL's texts), not on the task's
    questions; ``record``: the report.json field of a search point that holds it; ``damage``: the ``TextDamage``
    field it reads on text (``share``: a share kept, so the budget limits ``100 * (1 - share)`` points changed);
    ``proportion``: one 0/1 outcome per text (its resolution is a proportion's); ``phrase``, ``axis``, ``title`` and
    ``definition`` (``{task}`` filled in): how reports, plots and the card word it."""

    name: str
    unit: str
    on_text: bool
    record: str
    phrase: str
    axis: str
    title: str | None
    definition: str
    damage: str | None = None
    share: bool = False
    proportion: bool = False

    @property
    def in_nats(self) -> bool:
        return self.unit == "nats"


REGISTRY = {m.name: m for m in (
    Metric("accuracy", "points", False, "delta_points", "accuracy points", "accuracy drop (points)", None,
           "ablated {task} accuracy at most this many points below the unablated model on the same questions"),
    Metric("kl", "nats", False, "kl_answer_nats", "nats of answer KL", "answer KL (nats)", "answer KL",
           "mean KL(unablated || ablated) over the answer choices of the {task} prompts, at most this many nats"),
    Metric("kl-text", "nats", True, "kl_text_nats", "nats of next-token KL on held-out text", "next-token KL (nats)",
           "next-token KL on held-out text",
           "mean next-token KL(unablated || ablated) on held-out text, at most this many nats", damage="kl"),
    Metric("token-agreement", "points", True, "token_agreement",
           "points of next-token predictions changed on held-out text", "next-token predictions changed (points)",
           "next-token predictions changed on held-out text",
           "share of next-token predictions on held-out text (teacher-forced; on a generative task the unablated "
           "model's own generation) where the ablated model's greedy choice differs from the unablated one's, at most "
           "this many points (mean over texts)", damage="agreement", share=True),
    Metric("same-generation", "points", True, "same_generation", "points of held-out generations changed",
           "generations changed (points)", "held-out generations changed",
           "share of held-out documents whose greedy generation changes (teacher-forced on the unablated model's own "
           "generation: a different greedy choice at any generated token, the one that ended it included), at most "
           "this many points", damage="same", share=True, proportion=True),
)}
METRICS = tuple(REGISTRY)
TEXT_METRICS = tuple(name for name, m in REGISTRY.items() if m.on_text)


MAX_NATS = 100.0  # a KL budget beyond this accepts any model


# --metric values that also name the task they are measured on (the accuracy of that task)
METRIC_TASKS = {"mmlu": "mmlu", "mmlu-cloze": "mmlu-cloze"}


METRIC_CHOICES = (*METRIC_TASKS, *METRICS)


@dataclass(frozen=True)
class Budget:
    """``accuracy``: at most ``points`` accuracy points below the unablated model on the same questions.
    ``kl``: at most ``points`` nats of mean KL divergence from the unablated model's distribution over the choices
    (the four answer letters on MMLU; it measures damage even on a model that answers at chance).
    ``kl-text``: at most ``points`` nats of mean next-token KL from the unablated model on held-out text.
    ``token-agreement``: at most ``points`` points of next-token predictions on held-out text that change (greedy).
    ``same-generation``: at most ``points`` points of held-out texts whose greedy generation changes."""

    limit: float  # points (accuracy, token-agreement, same-generation), or nats for the KL metrics
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
                f"`budget` {text!r} is not a budget; write accuracy points as 1%, 0.5 or 2pt (at most that many points "
                "below the unablated model), or nats of KL as 0.05nat"
            )
        value, unit = float(m.group(1)), m.group(2) or ""
        unit_metric = "kl" if unit.startswith("nat") else ("accuracy" if unit else None)
        in_nats = metric in REGISTRY and REGISTRY[metric].in_nats
        if metric and unit_metric and in_nats != (unit_metric == "kl"):
            raise UserError(f"`budget` {text!r} is in {'nats' if unit_metric == 'kl' else 'points'}, but "
                            f"`metric` is {named}, which is measured in {'nats' if in_nats else 'points'}; use a "
                            f"budget in {'nats (0.05nat)' if in_nats else 'points (1%)'}, or `metric` "
                            f"{'kl or kl-text' if unit_metric == 'kl' else 'accuracy'}")
        metric = metric or unit_metric or "accuracy"
        if metric not in METRICS:
            raise UserError(f"`metric` {metric!r} is not one of {', '.join(METRIC_CHOICES)}")
        if value < 0 or (not in_nats and value > 100):
            raise UserError(f"`budget` {text!r} is out of range; it must be between 0 and 100 points")
        if metric != "accuracy" and value > MAX_NATS:
            raise UserError(f"`budget` {text!r} is out of range; a KL budget is at most {MAX_NATS:g} nats (0.02-0.1 "
                            "is typical)")
        return Budget(value, metric, str(text))

    @property
    def spec(self) -> Metric:
        """The registered metric this budget limits."""
        return REGISTRY[self.metric]

    @property
    def in_nats(self) -> bool:
        return self.spec.in_nats

    @property
    def on_text(self) -> bool:
        """Whether the budget is measured on held-out text (TEXT_METRICS), not on the task's questions."""
        return self.spec.on_text

    def text_values(self, damage: TextDamage) -> torch.Tensor:
        """Per held-out text, what a text budget limits, in its unit (nats, or points)."""
        values = getattr(damage, self.spec.damage).double()
        return 100.0 * (1.0 - values) if self.spec.share else values

    def reads(self, point: dict) -> float:
        """What the budget limits, read off an evaluated point's report.json record (nan where not measured)."""
        value = point.get(self.spec.record)
        if value is None:
            return float("nan")
        if self.metric == "accuracy":
            return -value
        return 100.0 * (1.0 - value) if self.spec.share else value

    @property
    def axis_label(self) -> str:
        return self.spec.axis

    def allows(self, delta: PairedDelta, kl: float = 0.0, kl_se: float = 0.0, text: float | None = None,
               text_se: float = 0.0, z: float = 1.96) -> bool:
        """``point``: the estimate is within budget. ``confident``: the one-sided 97.5% bound is (for accuracy the
        lower end of the paired difference's 95% interval, for a KL or a text measure the mean plus 1.96 standard
        errors). ``text``/``text_se``: a text budget's mean over the held-out texts (``text_values``)."""
        sure = self.rule == "confident"
        if self.metric == "kl":
            return kl + (z * kl_se if sure else 0.0) <= self.limit + 1e-12
        if self.on_text:
            if text is None:
                raise ValueError(f"a {self.metric} budget needs its measure on held-out text at every evaluated point")
            return text + (z * text_se if sure else 0.0) <= self.limit + 1e-9
        return (delta.ci_low if sure else delta.delta) >= -self.limit - 1e-9

    def __str__(self) -> str:
        sure = " (confident: 97.5% bound)" if self.rule == "confident" else ""
        return f"{self.limit:g} {self.spec.phrase}{sure}"


def judge(budget: Budget, result: EvalResult, baseline: EvalResult) -> tuple[PairedDelta, float, float, bool]:
    """(paired accuracy delta, mean answer KL in nats, answer agreement, within budget) of one evaluation, on the
    questions it covers."""
    baseline = restricted(baseline, result)
    delta = paired_delta(result, baseline)
    kls = answer_kl(result, baseline)
    kl = float(kls.mean())
    kl_se = float(kls.std(unbiased=True)) / kls.numel() ** 0.5 if kls.numel() > 1 else float("inf")
    ok = budget.allows(delta, kl, kl_se, result.meta.get("text_damage"), result.meta.get("text_damage_se", 0.0))
    return delta, kl, agreement(result, baseline), ok


def decided_over_budget(budget: Budget, partial: EvalResult, baseline_part: EvalResult, z: float = 1.96) -> bool:
    """Early stop: on the questions evaluated so far, does the 95% CI already put this point over budget? (accuracy:
    the paired difference's upper bound is below -budget; kl: the lower bound of the mean answer KL is above the
    budget). Points within budget are always evaluated on every question, so the chosen one is never partial."""
    if budget.metric == "accuracy":
        return paired_delta(partial, baseline_part, z).ci_high < -budget.limit
    if budget.metric == "kl":
        kl = answer_kl(partial, baseline_part)
        n = kl.numel()
        if n < 2:
            return False
        se = float(kl.std(unbiased=True)) / n ** 0.5
        return float(kl.mean()) - z * se > budget.limit
    return False  # a text budget is measured on other texts, all at once
