"""``evaluate``: a task on a model in memory as the main command verifies it, unablated and with heads ablated."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prune_heads.api.held import Heads, heads_of, held, settings_of
from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.lm_eval_tasks import NOT_CHOICES
from prune_heads.data.tasks import MMLU_TASKS
from prune_heads.errors import UserError
from prune_heads.eval.results import EvalResult, PairedDelta, paired_delta
from prune_heads.heads import HeadSet
from prune_heads.pipeline.lm_eval_run import check_lm_eval_run, lm_eval_summary
from prune_heads.pipeline.stages import open_run
from prune_heads.search.budget import Budget, judge
from prune_heads.search.verifier import Verifier, VerifierSetup

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


@dataclass
class Evaluation:
    """A task read unablated and with ``heads`` ablated (``heads`` empty: unablated only).

    For a multiple-choice task (built-in, or an lm-eval one the main command verifies on): ``baseline`` and
    ``ablated`` hold every question's log-likelihoods (``.rows()``: one record per question), ``delta`` the paired
    difference in points with its 95% interval, ``within_budget`` whether the budget allows it (None without a
    budget). For any other lm-eval task (generative, perplexity): ``summary`` and ``rows`` are what ``prune-heads
    eval`` writes to summary.json and the task's JSONL (the paired difference on each task's primary metric, and for
    a generative task the agreement with the unablated model's own generations)."""

    task: str
    heads: HeadSet
    baseline: EvalResult | None = None
    ablated: EvalResult | None = None
    delta: PairedDelta | None = None
    budget: Budget | None = None
    within_budget: bool | None = None
    summary: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float | None:
        """The unablated accuracy (multiple choice), None otherwise."""
        return None if self.baseline is None else self.baseline.accuracy

    def records(self) -> list[dict]:
        """One record per question (multiple choice: each with the unablated and the ablated answer) or per
        document (lm-eval's rows)."""
        if self.baseline is None:
            return self.rows
        if self.ablated is None:
            return self.baseline.rows()
        return [{**r, "ablated": {"pred": a["pred"], "loglik": a["loglik"]}}
                for r, a in zip(self.baseline.rows(), self.ablated.rows())]


def evaluate(model: nn.Module, tokenizer: PreTrainedTokenizerBase, task: str = "mmlu", *,
             heads: Heads | None = None, budget: str | float | None = None,
             limit: int | str | None = None, progress: bool = True, **settings) -> Evaluation:
    """Read ``task`` on the model as the main command verifies it (``mmlu`` 5-shot, the other built-in tasks,
    ``lm-eval:NAME`` including generative and perplexity tasks), unablated and with ``heads`` (``{layer: [head]}``
    or a HeadSelection) ablated. ``limit``: questions per subject of MMLU, else the task's first ``limit`` questions
    (``"all"``: every one). ``budget`` (``"1%"``, ``"0.05nat"``): whether the ablation is within it."""
    lm = held(model, tokenizer)
    chosen = heads_of(heads or {}, lm)
    size = {}
    if limit is not None:
        size = {"mmlu_per_subject" if task in MMLU_TASKS else "task_limit": limit}
    run_settings, inputs = settings_of(lm, budget=budget, progress=progress, task=task, **size, **settings)
    if is_lm_eval(task) and NOT_CHOICES in inputs.questions.notes:  # generative or perplexity: lm-eval reads it
        check_lm_eval_run(run_settings, chosen or None)
        run = open_run(run_settings, inputs, None, encode=False, loaded=lm)
        summary, rows = lm_eval_summary(run, chosen or None)
        return Evaluation(task, chosen, summary=summary, rows=rows)
    if budget is not None and run_settings.budget.on_text:
        raise UserError(f"`budget` {budget} is measured on held-out text, which `evaluate` does not read; give a "
                        "budget in accuracy points or answer KL (1%, 0.05nat), or use find_heads")
    run = open_run(run_settings, inputs, None, loaded=lm)
    verifier = Verifier.measured(run.work, run.planner, run.enc, VerifierSetup(run_settings.budget, "auto"))
    if not chosen:
        return Evaluation(task, chosen, verifier.baseline)
    ablated = verifier.evaluate_ablation(chosen)
    evaluation = Evaluation(task, chosen, verifier.baseline, ablated, paired_delta(ablated, verifier.baseline))
    if budget is not None:
        evaluation.budget = run_settings.budget
        evaluation.within_budget = bool(judge(run_settings.budget, ablated, verifier.baseline)[3])
    return evaluation
