"""The main job's decision, from an opened run to the confirmed heads: the stages of ``stages.py`` in their order,
each timed under its name. The command line (``prune_heads_cli/commands.py``, which then exports and reports) and the
Python API (``prune_heads.api.find_heads``, which returns it) both call ``decide``: one path, so both choose the same
heads from the same inputs.

    sizing -> scoring -> baseline -> search (ranking, resolution, the budget search) -> guard -> confirmation
"""
from __future__ import annotations

from dataclasses import dataclass

from prune_heads.console import say
from prune_heads.heads import score_direction
from prune_heads.models.counting import layer_tokens_counted
from prune_heads.pipeline.run_report import prune_report
from prune_heads.pipeline.stages import (
    Run,
    Scored,
    confirmed,
    full_task_size,
    guard_for,
    ranked,
    resolution_of,
    say_resolution,
    score,
    select,
    sized_to_budget,
    verifier_for,
    warn_chance,
)
from prune_heads.report.report import mark_refusals
from prune_heads.search.guard import Guard
from prune_heads.search.resolution import Resolution
from prune_heads.search.selection import Selection, gqa_costs
from prune_heads.search.units import UnitRanking
from prune_heads.search.verifier import Verifier
from prune_heads.timings import stage


@dataclass
class Decision:
    """What the main job decided and everything it decided from: the run (re-sized by `mmlu_per_subject` auto), the
    scores, the verifier with its baseline, the ranking, the search's choice, the guard, and the confirmed selection
    with the confirmation's and the guard's records (report.json's ``confirmation`` and ``guard``)."""

    run: Run
    scored: Scored
    verifier: Verifier
    ranking: UnitRanking
    resolution: Resolution | None
    warnings: list[str]  # the baseline's: chance level, what the questions resolve
    searched: Selection  # the search's choice, before confirmation and the guard
    guard: Guard | None
    selection: Selection  # the confirmed choice: what ships
    confirmation: dict
    guarded: dict


def decide(run: Run) -> Decision:
    """Score, search, guard and confirm: the heads the budget lets go, as the main command chooses them (the tokens
    each stage reads, layer by layer, counted on the run's clock)."""
    with layer_tokens_counted(run.lm.arch.decoder_layers(run.lm.model)):
        return _decided(run)


def _decided(run: Run) -> Decision:
    with stage("sizing"):
        run, resolution = sized_to_budget(run)  # from here on run.settings (with --mmlu-per-subject auto: sized)
    with stage("scoring"):
        scored = score(run)
    with stage("baseline"):
        verifier = verifier_for(run)
    with stage("search"):
        ranking = ranked(run, scored, verifier)
        resolution = resolution or resolution_of(run, ranking, verifier)
    warnings = say_baseline(run, verifier, resolution)
    with stage("search"):
        searched = select(run, ranking, scored, verifier)
    with stage("guard"):  # sized on a pilot read of the search's choice: the first point it will judge
        guard = guard_for(run, verifier.target(searched.heads) if searched.heads else None)
    with stage("confirmation"):  # the guard's reads inside count as "guard"
        selection, confirmation, guarded = confirmed(run, verifier, searched, guard, ranking)
    if guard is not None:
        guarded["seconds"] = round(guard.seconds, 1)
    return Decision(run, scored, verifier, ranking, resolution, warnings, searched, guard, selection, confirmation,
                    guarded)


def say_baseline(run: Run, verifier: Verifier, resolution: Resolution | None) -> list[str]:
    """The unablated model's accuracy and what the questions resolve, said; the warnings for the report."""
    s = run.settings
    warnings = [warn_chance(verifier.baseline, s.metric, s.task)]
    say(f"unablated {s.task} accuracy {100 * verifier.baseline.accuracy:.2f}% on "
        f"{len(verifier.baseline.questions)} questions" + (f"; next-token KL measured on "
        f"{len(verifier.kl_text.sequences)} texts ({verifier.kl_text.source})" if verifier.kl_text else ""))
    warnings.append(say_resolution(run, resolution))
    return [w for w in warnings if w]


def say_selection(decision: Decision) -> None:
    """The confirmed heads and what the export of them saves, said."""
    s, selection = decision.run.settings, decision.selection
    d = selection.delta
    say(f"{len(selection.heads)} of {selection.total} heads ({100 * len(selection.heads) / selection.total:.1f}%) "
        f"are within the budget ({s.budget}; {s.task} delta {d.delta:+.2f} pt, 95% CI [{d.ci_low:+.2f}, "
        f"{d.ci_high:+.2f}])", fg="green")
    if selection.savings:
        sh = selection.savings
        say(f"the {sh['layout']} export removes {sh['attention_params_removed']:,} attention parameters (deployment "
            f"efficiency {sh['deployment_efficiency']:.2f}), {sh['kv_cache_removed']:,} B/token of KV cache, "
            f"{sh['attention_flops_removed']:,} attention FLOPs/token (objective: {s.objective})", fg="green")


def decision_report(decision: Decision, warnings: list[str], confirmation: dict, guarded: dict) -> dict:
    """report.json's figures of the decision (the command adds the export, the cache, timings): ``warnings``,
    ``confirmation`` and ``guarded`` as the caller words them (the CLI names options by their flags)."""
    run, verifier, selection, scored = decision.run, decision.verifier, decision.selection, decision.scored
    s = run.settings
    gqa = gqa_costs(verifier, scored.table.mean(s.scorer), score_direction(s.scorer) == "low",
                    selection.search.best.heads)
    report = prune_report(run, scored, verifier, selection, gqa, warnings)
    report["confirmation"] = confirmation
    resolution = decision.resolution
    report["resolution"] = resolution.to_json(full_task_size(run)) if resolution else None
    report["guard"] = guarded
    report["search_points"] = mark_refusals(report["search_points"], confirmation, guarded)
    # What the points started from (eval/reuse.py): per task or probe and layer, the residual streams kept, their
    # bytes and tokens, how often they were read and how many passes started from them.
    report["layer_reuse"] = run.work.reuse.summary()
    return report
