"""Evaluate a head set the way it would ship: the one object the search, the GQA balancing and the export
re-verification ask "how does the model do without these heads?".

Without healing, a head set is evaluated as an ablation of the loaded model: the heads themselves, or for families
whose q/k norms span all heads (OLMo-2) the export plan, so the ablation computes exactly what the pruned model
will. With ``--heal-in-search`` a point is the pruned model after LoRA healing. Every evaluation is cached
(cached_steps.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from prune_heads.console import say
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import EncodedTask, split_blocks
from prune_heads.eval.results import EvalResult, in_order_of, restricted
from prune_heads.eval.textkl import HeldOutText
from prune_heads.heads import HeadSet
from prune_heads.io.cache import digest
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.healing import Healer
from prune_heads.plan.planner import Planner
from prune_heads.plan.slicing import pruned_copy
from prune_heads.search.budget import Budget, decided_over_budget
from prune_heads.search.resolution import coefficient_of_variation


@dataclass(frozen=True)
class VerifierSetup:
    """How a head set is judged: the budget, the export layout whose plan the ablation follows, early-stop blocks,
    the held-out texts of the next-token KL (and the further texts a point is confirmed on, when there are), and
    healing (with ``heal_in_search``: every point is judged healed)."""

    budget: Budget
    layout: str = "auto"
    early_stop_blocks: int = 1
    kl_text: HeldOutText | None = None
    healer: Healer | None = None
    heal_in_search: bool = False
    confirm_text: HeldOutText | None = None


class Verifier:
    """The search's evaluator (search.budget_search.PointEvaluator): the unablated baseline, the budget, each head set's
    evaluation as it would ship, and what its export saves."""

    def __init__(self, work: Work, planner: Planner, enc: EncodedTask, setup: VerifierSetup, baseline: EvalResult):
        self.work, self.planner, self.enc, self.setup = work, planner, enc, setup
        self.budget, self.layout, self.baseline = setup.budget, setup.layout, baseline
        # Early stop: a point is evaluated in blocks of subjects and dropped as soon as its CI puts it over budget.
        use_blocks = setup.early_stop_blocks > 1 and not self.budget.on_text and not setup.heal_in_search
        self.blocks = split_blocks(enc, setup.early_stop_blocks) if use_blocks else []

    @classmethod
    def measured(cls, work: Work, planner: Planner, enc: EncodedTask, setup: VerifierSetup) -> "Verifier":
        """A verifier with its baseline: the unablated model on the task (and the held-out texts), cached."""
        baseline = with_text_damage(work, setup.budget, setup.kl_text, work.task_result(enc, None, "unablated"), None)
        return cls(work, planner, enc, setup, baseline)

    @property
    def kl_text(self) -> HeldOutText | None:
        return self.setup.kl_text

    @property
    def heal_in_search(self) -> bool:
        return self.setup.heal_in_search

    def savings(self, heads: HeadSet) -> dict:
        """What the export of ``heads`` saves under this run's layout."""
        return self.planner.savings(heads, self.layout)

    @property
    def lm(self) -> LoadedModel:
        return self.work.lm

    def target(self, heads: HeadSet, layout: str | None = None):
        """What the ablation must zero to compute exactly what the export will ship."""
        if self.lm.arch.qk_norm != "across_heads" or not heads:
            return heads
        return self.planner.choose(heads, layout or self.layout).plan

    def evaluate(self, heads: HeadSet, label: str) -> EvalResult:
        """The task without ``heads``, as it would ship (healed with --heal-in-search), dropped early once its CI
        puts it over budget."""
        if self.heal_in_search and heads:
            return self.evaluate_healed(heads, label)
        return self._blockwise(heads, label, early_stop=True)

    def evaluate_complete(self, heads: HeadSet, label: str) -> EvalResult:
        """Like ``evaluate`` on every question (never stopped early), through the same cache entries, so a later
        ``evaluate`` of the same heads reuses it."""
        return self._blockwise(heads, label, early_stop=False)

    def _blockwise(self, heads: HeadSet, label: str, early_stop: bool) -> EvalResult:
        """The ablation of ``heads`` block by block (each block cached on its own), stopping once the questions so
        far decide the point over budget (one pass without early-stop blocks), with the text KL when measured."""
        target = self.target(heads)
        if len(self.blocks) > 1 and heads:
            result = self._sequential(target, label, early_stop)
            return with_text_damage(self.work, self.budget, self.kl_text, result, target)
        result = self.work.task_result(self.enc, target, label)
        return with_text_damage(self.work, self.budget, self.kl_text, result, target)

    def _sequential(self, target, label: str, early_stop: bool) -> EvalResult:
        """The questions evaluated so far, in block order, with ``meta["stopped_early"]`` when a block decided the
        point over budget; the full result in the baseline's order when every block ran."""
        done: list[EvalResult] = []
        for b, block in enumerate(self.blocks):
            done.append(self.work.task_result(block, target, f"{label} [{b + 1}/{len(self.blocks)}]"))
            width = max(r.loglik.shape[1] for r in done)
            partial = EvalResult([q for r in done for q in r.questions], torch.cat(
                [torch.nn.functional.pad(r.loglik, (0, width - r.loglik.shape[1]), value=float("-inf")) for r in done]),
                label)
            if b + 1 == len(self.blocks):
                return in_order_of(self.baseline, partial)
            if early_stop and decided_over_budget(self.budget, partial, restricted(self.baseline, partial)):
                partial.meta.update(stopped_early=True, questions_evaluated=len(partial.questions))
                return partial
        raise AssertionError("no blocks")

    def evaluate_ablation(self, heads: HeadSet, label: str = "ablated") -> EvalResult:
        """The plain ablation on every question (no healing, no early stop): what the export is compared with."""
        return self.work.task_result(self.enc, self.target(heads), label)

    def evaluate_group(self, sets: list[HeadSet], labels: list[str]) -> list[EvalResult]:
        """Several head sets in the same forward passes where that gives the same numbers, else one at a time."""
        if self.heal_in_search or self.blocks or self.lm.arch.qk_norm == "across_heads":
            return [self.evaluate(hs, lab) for hs, lab in zip(sets, labels)]
        results = self.work.task_results(self.enc, sets, labels)
        return [with_text_damage(self.work, self.budget, self.kl_text, r, hs) for r, hs in zip(results, sets)]

    def evaluate_healed(self, heads: HeadSet, label: str) -> EvalResult:
        """--heal-in-search: the accuracy of the model that would ship, pruned and healed (cached per plan)."""
        lm, plan, healer = self.lm, self.planner.choose(heads, self.layout).plan, self.setup.healer
        identity = "healed:" + digest({"plan": plan.to_json(), **healer.key})
        cached = self.work.cached_task_result_of(self.enc, identity, f"{label}, healed")
        if cached is not None:
            return cached
        say(f"  healing the pruned model for {label}")
        healed, _ = healer.heal(pruned_copy(lm.model, lm.arch, plan), plan)
        model = LoadedModel(healed, lm.tokenizer, lm.arch, lm.source, lm.dtype, lm.device)
        return self.work.task_result_of(self.enc, model, identity, f"{label}, healed")


def with_text_damage(work: Work, budget: Budget, kl_text: HeldOutText | None, result: EvalResult,
                     target) -> EvalResult:
    """``result`` with ``target``'s next-token damage on the held-out texts in its meta, when they are measured: the
    KL (``kl_text``: mean, standard error, coefficient of variation), the shares ``token_agreement`` and
    ``same_generation``, and under a text budget what it limits (``text_damage``, its standard error and coefficient
    of variation, in the budget's unit)."""
    if kl_text is not None:
        damage = work.text_damage(kl_text, target)
        kls = damage.kl.double()
        result.meta["kl_text"], result.meta["kl_text_se"] = mean_se(kls)
        result.meta["kl_text_cv"] = coefficient_of_variation(kls)
        result.meta["token_agreement"] = float(damage.agreement.double().mean())
        result.meta["same_generation"] = float(damage.same.double().mean())
        if budget.on_text:
            values = budget.text_values(damage)
            result.meta["text_damage"], result.meta["text_damage_se"] = mean_se(values)
            result.meta["text_damage_cv"] = coefficient_of_variation(values)
    return result


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """The mean of per-text values and its standard error (infinite from one text)."""
    return float(values.mean()), float(values.std()) / len(values) ** 0.5 if len(values) > 1 else float("inf")
