"""``find_heads``: the main command's search, confirmation and long-context guard on a model in memory (the same
``pipeline.decision.decide`` the command line runs), returning the heads and everything they were decided from."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prune_heads import timings
from prune_heads.api.held import held, settings_of
from prune_heads.api.scores import HeadScores
from prune_heads.eval.results import EvalResult, PairedDelta
from prune_heads.heads import HeadSet
from prune_heads.io.files import write_json
from prune_heads.io.staging import StagedDirectory
from prune_heads.pipeline.decision import Decision, decide, decision_report, say_selection
from prune_heads.pipeline.stages import open_run, run_identity

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


@dataclass
class HeadSelection:
    """The heads ``find_heads`` chose and what they were decided from.

    ``heads``: the confirmed heads (``as_dict()``: ``{layer: [head, ...]}``, the heads.json form; ``prune`` and
    ``ablate`` take the HeadSelection itself); ``points``: every point the search tried (report.json's
    ``search_points``); ``confirmation`` and ``guard``: the confirmation's and the long-context guard's verdicts;
    ``baseline`` and ``result``: the task unablated and with the heads ablated; ``delta``: their paired difference;
    ``savings``: what the export of these heads removes; ``scores``: every score function on every head; ``report``:
    what report.json holds of the decision (the command line adds the export's figures)."""

    heads: HeadSet
    points: list[dict]
    confirmation: dict
    guard: dict
    baseline: EvalResult
    result: EvalResult
    delta: PairedDelta
    savings: dict
    scores: HeadScores
    report: dict

    def as_dict(self) -> dict[int, list[int]]:
        return {layer: list(heads) for layer, heads in self.heads.as_dict().items()}

    def __len__(self) -> int:
        return len(self.heads)


def find_heads(model: nn.Module, tokenizer: PreTrainedTokenizerBase, budget: str | float | None = "1%", *,
               task: str = "mmlu", out: str | Path | None = None, force: bool = False, progress: bool = True,
               **settings) -> HeadSelection:
    """The heads ``budget`` lets go (``"1%"``: one accuracy point of ``task``; ``"0.05nat"``: answer KL; None: the
    recipe's), found as ``prune-heads --model M --budget B`` finds them: every head scored, the budget search along
    the scorer's ranking, the chosen point confirmed on unseen questions and within the long-context guard.
    ``settings``: the command's settings by name (``recipe``, ``scorer``, ``mmlu_per_subject``, ``guard=()``, ...).

    Nothing is written unless ``out`` names a directory: then heads.json and report.json go there, and every
    expensive step is cached in it, so a call interrupted (or repeated) with the same ``out`` resumes (``force``:
    replace an ``out`` holding something else)."""
    lm = held(model, tokenizer, fingerprint=out is not None)
    run_settings, inputs = settings_of(lm, budget=budget, progress=progress, task=task, **settings)
    staged = None
    if out is not None:
        staged = StagedDirectory(Path(out), force, None, inputs=inputs.paths,
                                 identity=run_identity("find_heads", run_settings, inputs))
    clock = timings.start()
    with staged or contextlib.nullcontext():
        decision = decide(open_run(run_settings, inputs, staged, loaded=lm))
        say_selection(decision)
        report = decision_report(decision, decision.warnings, decision.confirmation, decision.guarded)
        report["cache"] = decision.run.work.cache.stats
        report["timings"] = clock.to_json()
        if staged is not None:
            write_json(staged.path / "heads.json", decision.selection.heads.to_json())
            write_json(staged.path / "report.json", report)
    return _selection(decision, report)


def _selection(decision: Decision, report: dict) -> HeadSelection:
    chosen, scored = decision.selection, decision.scored
    scores = HeadScores(dict(scored.table.per_input), scored.calibration, tuple(scored.table.token_counts))
    return HeadSelection(chosen.heads, report["search_points"], decision.confirmation, decision.guarded,
                     decision.verifier.baseline, chosen.result, chosen.delta, chosen.savings, scores, report)
