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

METRICS = ("accuracy", "kl", "kl-text", "token-agreement", "same-generation")
# measured on held-out text (the next-token KL's texts): kl-text in nats; token-agreement in points of next-token
# predictions that change (100 - the share the ablated model predicts as the unablated one does, greedy);
# same-generation in points of texts whose greedy generation changes (on a generative lm-eval task: the ablated model's
# generation is not the unablated one's, token for token)
TEXT_METRICS = ("kl-text", "token-agreement", "same-generation")


MAX_NATS = 100.0  # a KL budget beyond this accepts any model


# --metric values that also name the task they are measured on (the accuracy of that task)
METRIC_TASKS = {"mmlu": "mmlu", "mmlu-cloze": "mmlu-cloze"}


METRIC_CHOICES = ("mmlu", "mmlu-cloze", "accuracy", "kl", "kl-text", "token-agreement", "same-generation")


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
        in_nats = metric in ("kl", "kl-text")
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
    def in_nats(self) -> bool:
        return self.metric in ("kl", "kl-text")

    @property
    def on_text(self) -> bool:
        """Whether the budget is measured on held-out text (TEXT_METRICS), not on the task's questions."""
        return self.metric in TEXT_METRICS

    def text_values(self, damage: TextDamage) -> torch.Tensor:
        """Per held-out text, what a text budget limits, in its unit (nats, or points)."""
        if self.metric == "kl-text":
            return damage.kl.double()
        if self.metric == "token-agreement":
            return 100.0 * (1.0 - damage.agreement.double())
        return 100.0 * (1.0 - damage.same.double())

    def reads(self, point: dict) -> float:
        """What the budget limits, read off an evaluated point's report.json record (nan where not measured)."""
        nan = float("nan")
        if self.metric == "accuracy":
            return -point["delta_points"]
        if self.metric in ("kl", "kl-text"):
            return point.get("kl_answer_nats" if self.metric == "kl" else "kl_text_nats", nan)
        share = point.get("token_agreement" if self.metric == "token-agreement" else "same_generation")
        return nan if share is None else 100.0 * (1.0 - share)

    @property
    def axis_label(self) -> str:
        return {"kl": "answer KL (nats)", "kl-text": "next-token KL (nats)",
                "token-agreement": "next-token predictions changed (points)",
                "same-generation": "generations changed (points)"}.get(self.metric, "accuracy drop (points)")

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
        if self.metric == "kl":
            return f"{self.limit:g} nats of answer KL{sure}"
        if self.metric == "kl-text":
            return f"{self.limit:g} nats of next-token KL on held-out text{sure}"
        if self.metric == "token-agreement":
            return f"{self.limit:g} points of next-token predictions changed on held-out text{sure}"
        if self.metric == "same-generation":
            return f"{self.limit:g} points of held-out generations changed{sure}"
        return f"{self.limit:g} accuracy points{sure}"


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
