"""The shipping commands, the main job and ``export``: the named stages of ``prune_heads.pipeline.stages`` followed
by an exporter, and the report assembled from their results (the measuring commands: measure.py).

Every command writes into a staging directory beside ``--out`` (``io.staging.StagedDirectory``) that is renamed into
place only when the command finished: an interrupted run leaves nothing under the final name and resumes from its
cache when rerun. This is the only layer that knows both the core (``prune_heads``) and the exporters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from exporters.export import ExportCheck, ExportOptions, ExportResult, export_pruned
from exporters.lora import check_sliced, load_sliced, slice_adapter
from prune_heads import timings
from prune_heads.console import say
from prune_heads.errors import UserError
from prune_heads.eval.results import EvalResult, agreement, paired_delta
from prune_heads.heads import HeadSet, ScoreTable
from prune_heads.io.files import write_json
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.io.staging import StagedDirectory
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import device_map_option, max_memory_option
from prune_heads.pipeline.decision import Decision, decide, decision_report, say_selection
from prune_heads.pipeline.inputs import Inputs
from prune_heads.pipeline.settings import Settings
from prune_heads.pipeline.stages import Run, describe, open_run, run_identity, warn_chance
from prune_heads.report import plots
from prune_heads.report.report import METRIC_NAMES, budget_definition
from prune_heads.search.selection import Selection
from prune_heads.search.verifier import Verifier, VerifierSetup
from prune_heads.timings import stage
from prune_heads_cli.console import worded, worded_json

# -- prune-heads (the main job) -----------------------------------------------------------------------------------


@dataclass
class PruneRun:
    """What the main command found and wrote."""

    run: Run
    scores: ScoreTable
    selection: Selection
    report: dict
    export: ExportResult | None


def run_prune(settings: Settings, inputs: Inputs, out: Path, force: bool, ranks: Ranks = LOCAL) -> PruneRun | None:
    """Score, search, confirm, export, report: everything is written into a staging directory beside ``out`` and
    renamed into place only once the export has been reloaded and verified. Under torchrun every rank shares the
    scoring and evaluations up to the decision; rank 0 then writes and exports alone, and the others return None."""
    clock = timings.start()
    staged = _staged_on_root(settings, inputs, out, force, ranks)
    with staged or contextlib.nullcontext():
        with stage("load"):
            run = open_run(settings, inputs, staged, ranks=ranks)
        say(describe(run))
        decision = decide(run)
        run = decision.run
        if not ranks.root:
            return None  # this rank's share is done: the decision is made, rank 0 writes it
        run.work.finish_alone()
        selection, verifier = decision.selection, decision.verifier
        warnings = [worded(w) for w in decision.warnings]
        confirmation, guarded = worded_json(decision.confirmation), worded_json(decision.guarded)
        say_selection(decision)
        write_json(run.staging_dir / "heads.json", selection.heads.to_json())
        with stage("export"):  # the reload check, vLLM, the task on the export and the speed are their own stages
            export = _export(run, verifier, selection, warnings, confirmation, guarded) if run.settings.export else None
        with stage("report"):
            report = _report(decision, warnings, confirmation, guarded, export)
            # Drawn once the export has let go of every model: matplotlib's renderer and font caches (~15 MiB kept)
            # never sit beside the reloaded weights, the run's memory peak.
            _plot_selection(run, decision.scored.table, selection, report, verifier.baseline)
        report["processes"] = ranks.size  # torchrun's ranks that shared the scoring and evaluations
        report["timings"] = clock.to_json()
        report["seconds"] = report["timings"]["total"]
        write_json(run.staging_dir / "report.json", worded_json(report))
    say(f"{'pruned model, report' if settings.export else 'report'}: {out}", fg="green")
    say(f"done in {clock.describe()}", fg="green")
    return PruneRun(run, decision.scored.table, selection, report, export and export.result)


def _staged_on_root(settings: Settings, inputs: Inputs, out: Path, force: bool, ranks: Ranks):
    """The staging directory, made by rank 0 alone (None on the other ranks); its refusal stops every rank."""
    staged, error = None, None
    if ranks.root:
        try:
            staged = StagedDirectory(out, force, settings.resume, inputs=inputs.paths,
                                     identity=run_identity("prune", settings, inputs))
        except UserError as e:
            error = e
    ranks.raise_together(error)
    return staged


def _report(decision: Decision, warnings: list[str], confirmation: dict, guarded: dict,
            export: "MainExport | None") -> dict:
    """report.json, assembled once from the decision and the export."""
    report = decision_report(decision, warnings, confirmation, guarded)
    if export is not None:
        if export.adapter is not None:
            report["adapter"] = export.adapter
        report["export"] = export.report()
    report["cache"] = decision.run.work.cache.stats
    return report


def _plot_selection(run: Run, scores: ScoreTable, selection: Selection, report: dict, baseline: EvalResult) -> None:
    s, spec, staging = run.settings, run.lm.source.spec, run.staging_dir
    plots.score_heatmap(scores.mean(s.scorer), s.scorer, selection.heads, staging / "scores_heatmap.png",
                        f"{spec}: {s.scorer} (red: {len(selection.heads)} removed heads)")
    plots.search_curve(report["search_points"], baseline.accuracy, s.budget, staging / "accuracy_vs_heads.png",
                       f"{spec}: {METRIC_NAMES.get(s.metric, s.task)} vs heads ablated by {s.scorer}")
    plots.shipped_curve(report["search_points"], s.budget, staging / "budget_vs_shipped.png",
                        f"{spec}: {METRIC_NAMES.get(s.metric, s.task + ' accuracy')} vs what the export saves")


@dataclass
class MainExport:
    """The export of the main job, and with --adapter the sliced adapter's check."""

    result: ExportResult
    adapter: dict | None = None

    def report(self) -> dict:
        r = self.result
        return {"layout": r.choice.layout, "reason": r.choice.reason, "options": r.choice.options, "stats": r.stats,
                "verification": r.verification, "task_eval": r.task_eval, "healing": r.manifest.get("healing"),
                "speed": r.speed, "gguf": r.gguf, "vllm": r.vllm}


def _export(run: Run, verifier: Verifier, selection: Selection, warnings: list[str],
            confirmation: dict, guarded: dict) -> MainExport:
    """The chosen heads, physically removed, written, reloaded and re-verified (with --adapter: the base is
    checked on logits and the sliced adapter on the task)."""
    s = run.settings
    info = {"scorer": s.scorer, "budget": s.budget.text, "warnings": warnings,
            "budget_definition": budget_definition(s.budget, s.task), "task": s.task,
            "confirmation": {k: v for k, v in confirmation.items() if k != "question_ids"},
            "long_context": {**{k: v for k, v in guarded.items() if k != "judged"},
                             **({"before_healing": True} if s.heal_steps else {})}}
    if s.lora_adapter:
        result = export_pruned(run.base, selection.heads, run.staging_dir, _options(s, run, shipping=False), info=info,
                               planner=run.planner)
        return MainExport(result, _export_sliced_adapter(run, verifier, result.choice.plan, selection.result))
    # With --heal-in-search the chosen point was judged healed; before/after healing compares the ablation.
    ablated = verifier.evaluate_ablation(selection.heads) if s.heal_in_search else selection.result
    check = ExportCheck(run.enc, verifier.baseline, ablated, run.work, s.batch_size)
    return MainExport(export_pruned(run.lm, selection.heads, run.staging_dir, _options(s, run), check=check,
                                       info=info, healer=verifier.setup.healer, planner=run.planner))


def _options(s: Settings, run: Run, shipping: bool = True) -> ExportOptions:
    """The export's options from the settings. ``shipping``: the command is done with the original once the export
    has its reference logits (its weights are released before the reload), and the reload is placed as the run's
    model was (--device-map, --max-memory)."""
    formats = ("safetensors", "gguf") if s.export_format == "both" else (s.export_format,)
    placement = None
    if shipping and s.device_map:
        placement = {"device_map": device_map_option(s.device_map), "max_memory": max_memory_option(s.max_memory),
                     "offload_folder": str(run.staged.offload_dir)}
    return ExportOptions(s.layout, s.max_shard_size, formats, s.gguf_type, s.progress, s.measure_speed, shipping,
                         placement, vllm_python=s.vllm_python)


def _export_sliced_adapter(run: Run, verifier: Verifier, plan, ablated: EvalResult) -> dict:
    """Slice --adapter into the staging directory's adapter/, reload pruned base + sliced adapter, and check it against
    the verified (merged, ablated) model: logits on sample prompts, then the task."""
    from prune_heads.io.cache import digest

    merged = run.lm
    out = slice_adapter(run.settings.lora_adapter, run.staging_dir, run.staging_dir / "adapter", check=False)
    model = load_sliced(merged, run.staging_dir, out)
    check = check_sliced(merged, model, plan, run.enc)
    reloaded = LoadedModel(model, merged.tokenizer, merged.arch, merged.source, merged.dtype, merged.device)
    result = run.work.task_result_of(run.enc, reloaded, f"sliced-adapter:{digest(plan.to_json())}",
                                     "pruned base + sliced adapter")
    say(f"pruned base + sliced adapter: max |logit diff| {check['max_abs_logit_diff']:.3g}, "
         f"{run.settings.task} {100 * result.accuracy:.2f}%")
    d = paired_delta(result, verifier.baseline)
    return {"directory": "adapter", "max_abs_logit_diff": check["max_abs_logit_diff"], "tolerance": check["tolerance"],
            "task_eval": {"n": len(result.questions), "accuracy": round(result.accuracy, 6), **d.to_json(),
                          "agreement_with_verified": round(agreement(result, ablated), 6)}}


# -- export: a given head set, no search --------------------------------------------------------------------------


def run_export(settings: Settings, inputs: Inputs, heads: HeadSet, out: Path, force: bool,
               with_task: bool = True, heads_file: str | Path | None = None) -> ExportResult:
    """``prune-heads export``: a given head set (read from ``heads_file``, named in the card with its hash), no
    search. Verifies logits, and the task unless ``with_task`` is off."""
    from prune_heads.io.files import sha256_file

    source = {"name": Path(heads_file).name, "sha256": sha256_file(heads_file)} if heads_file else None
    identity = run_identity("export", settings, inputs, heads=heads.to_json(), with_task=with_task)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged, encode=with_task)
        check, warnings = None, []  # heads are checked against the config before loading, and by export_pruned
        if with_task:
            setup = VerifierSetup(settings.budget, settings.layout)
            verifier = Verifier.measured(run.work, run.planner, run.enc, setup)
            warnings = [worded(w) for w in [warn_chance(verifier.baseline, task=settings.task)] if w]
            check = ExportCheck(run.enc, verifier.baseline, verifier.evaluate_ablation(heads), run.work,
                                settings.batch_size)
        result = export_pruned(run.lm, heads, staged.path, _options(settings, run), check=check,
                               info={"heads_file": source, "warnings": warnings}, planner=run.planner)
        write_json(staged.path / "heads.json", heads.to_json())
    say(f"exported {len(heads)} removed heads ({result.choice.layout} layout): {out}", fg="green")
    return result


