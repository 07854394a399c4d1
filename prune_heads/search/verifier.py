"""Evaluate a head set the way it would ship: the one object the search, the GQA balancing and the export
re-verification ask "how does the model do without these heads?".

Without healing, a head set is evaluated as an ablation of the loaded model: the heads themselves, or for families
whose q/k norms span all heads (OLMo-2) the export plan, so the ablation computes exactly what the pruned model
will. With ``--heal-in-search`` a point is the pruned model after LoRA healing. Every evaluation is cached (work.py).
"""
from __future__ import annotations

from typing import Callable

from prune_heads.eval.passes import EncodedTask, EvalResult, split_blocks
from prune_heads.eval.work import Work
from prune_heads.heads import HeadSet
from prune_heads.io.cache import digest
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.planner import Planner
from prune_heads.plan.slicing import pruned_copy
from prune_heads.search.prefixes import Budget, decided_over_budget
from prune_heads.search.resolution import coefficient_of_variation

Healer = Callable[[object, object], tuple]  # (pruned model, plan) -> (healed model, record)


class Verifier:
    def __init__(self, work: Work, planner: Planner, enc: EncodedTask, budget: Budget, layout: str,
                 kl_sequences: list[list[int]] | None = None, kl_source: str | None = None, early_stop_blocks: int = 1,
                 heal: Healer | None = None, heal_key: dict | None = None, heal_in_search: bool = False, log=print):
        self.log = log
        self.work, self.planner, self.enc, self.budget, self.layout = work, planner, enc, budget, layout
        self.kl_sequences, self.kl_source = kl_sequences, kl_source
        self.heal, self.heal_key, self.heal_in_search = heal, heal_key, heal_in_search
        self.baseline = self.with_text_kl(work.evaluate(enc, None, "unablated"), None)
        # Early stop: a point is evaluated in blocks of subjects and dropped as soon as its CI puts it over budget.
        use_blocks = early_stop_blocks > 1 and budget.metric != "kl-text" and not heal_in_search
        self.blocks = split_blocks(enc, early_stop_blocks) if use_blocks else []

    @property
    def lm(self) -> LoadedModel:
        return self.work.lm

    def target(self, heads: HeadSet, layout: str | None = None):
        """What the ablation must zero to compute exactly what the export will ship."""
        if self.lm.arch.qk_norm != "across_heads" or not heads:
            return heads
        return self.planner.choose(heads, layout or self.layout).plan

    def with_text_kl(self, result: EvalResult, target) -> EvalResult:
        if self.kl_sequences is not None:
            kls = self.work.text_kls(self.kl_sequences, target).double()
            result.meta["kl_text"] = float(kls.mean())
            result.meta["kl_text_se"] = float(kls.std()) / len(kls) ** 0.5 if len(kls) > 1 else float("inf")
            result.meta["kl_text_cv"] = coefficient_of_variation(kls)
        return result

    def evaluate(self, heads: HeadSet, label: str) -> EvalResult:
        """The task without ``heads``, as it would ship (healed with --heal-in-search)."""
        if self.heal_in_search and heads:
            return self.evaluate_healed(heads, label)
        return self._blockwise(heads, label, lambda part, base: decided_over_budget(self.budget, part, base))

    def evaluate_complete(self, heads: HeadSet, label: str) -> EvalResult:
        """Like ``evaluate`` on every question (never stopped early), through the same cache entries, so a later
        ``evaluate`` of the same heads reuses it."""
        return self._blockwise(heads, label, lambda *_: False)

    def _blockwise(self, heads: HeadSet, label: str, stop) -> EvalResult:
        """The ablation of ``heads`` block by block, stopping once ``stop(partial, baseline part)`` says the point is
        decided (one pass without early-stop blocks), with the text KL when it is measured."""
        target = self.target(heads)
        if len(self.blocks) > 1 and heads:
            result = self.work.evaluate_sequential(self.blocks, target, label, self.baseline, stop)
            return self.with_text_kl(result, target)
        return self.with_text_kl(self.work.evaluate(self.enc, target, label), target)

    def evaluate_ablation(self, heads: HeadSet, label: str = "ablated") -> EvalResult:
        """The plain ablation on every question (no healing, no early stop): what the export is compared with."""
        return self.work.evaluate(self.enc, self.target(heads), label)

    def evaluate_group(self, sets: list[HeadSet], labels: list[str]) -> list[EvalResult]:
        """Several head sets in the same forward passes where that gives the same numbers, else one at a time."""
        if self.heal_in_search or self.blocks or self.lm.arch.qk_norm == "across_heads":
            return [self.evaluate(hs, lab) for hs, lab in zip(sets, labels)]
        results = self.work.evaluate_group(self.enc, sets, labels)
        return [self.with_text_kl(r, hs) for r, hs in zip(results, sets)]

    def evaluate_healed(self, heads: HeadSet, label: str) -> EvalResult:
        """--heal-in-search: the accuracy of the model that would ship, pruned and healed (cached per plan)."""
        lm, plan = self.lm, self.planner.choose(heads, self.layout).plan

        def build() -> LoadedModel:
            self.log(f"  healing the pruned model for {label}")
            healed, _ = self.heal(pruned_copy(lm.model, lm.arch, plan), plan)
            return LoadedModel(healed, lm.tokenizer, lm.arch, lm.source, lm.dtype, lm.device)

        key = {**self.work.model_key, "model": "healed:" + digest({"plan": plan.to_json(), **self.heal_key})}
        return self.work.evaluate_built(self.enc, build, key, f"{label}, healed")
