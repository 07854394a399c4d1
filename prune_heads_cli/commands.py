"""What each command does, as the named stages of ``prune_heads.run`` followed by an exporter.

Every command writes into a staging directory beside ``--out`` (``fileio.StagedDirectory``) that is renamed into
place only when the command finished: an interrupted run leaves nothing under the final name and resumes from its
cache when rerun. This is the only layer that knows both the core (``prune_heads``) and the exporters.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from exporters.export import ExportCheck, ExportResult, export_pruned
from exporters.lora import check_sliced, load_sliced, slice_adapter
from prune_heads.data.tasks import task_format
from prune_heads.eval.passes import EvalResult, agreement, answer_kl, encode, paired_delta
from prune_heads.eval.work import Work
from prune_heads.heads import SCORE_KEYS, HeadSet, ScoreTable, score_direction
from prune_heads.io.files import StagedDirectory, write_json, write_text
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import device_map_option, max_memory_option
from prune_heads.pipeline.inputs import Inputs, compare_texts, kl_text_sequences, round_robin
from prune_heads.pipeline.settings import Settings
from prune_heads.pipeline.stages import (
    Run,
    describe,
    echo,
    full_task_size,
    load,
    open_run,
    say_resolution,
    score,
    sized,
    verifier_for,
    warn_chance,
)
from prune_heads.report import plots
from prune_heads.report.report import (
    METRIC_NAMES,
    accuracy_summary,
    scores_payload,
    versions,
    write_eval_outputs,
)
from prune_heads.search.confirmation import confirm
from prune_heads.search.selection import Selection, gqa_costs, predict_resolution, select_heads
from prune_heads.search.verifier import Verifier


def run_identity(command: str, settings: Settings, inputs: Inputs, **extra) -> dict:
    """What defines a run's results (recorded in its --out; --resume continues only the same): the command, the
    model source and its content hash, the settings (all but how it is shown and resumed), and ``extra``."""
    src = inputs.source
    model = {"path": src.path, "file": src.gguf_file, "revision": src.revision, "fingerprint": src.fingerprint}
    shown = ("model", "progress", "resume")
    return {"command": command, "model": model,
            "settings": {k: v for k, v in settings.to_json().items() if k not in shown}, **extra}


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
    """Score, search, report, export: everything is written into a staging directory beside ``out`` and renamed
    into place only once the export has been reloaded and verified. Under torchrun every rank shares the scoring and
    evaluations up to the decision; rank 0 then writes and exports alone, and the others return None."""
    started = time.time()
    staged = ranks.agree(lambda: StagedDirectory(out, force, settings.resume, inputs=inputs.paths,
                                                        identity=run_identity("prune", settings, inputs)))
    with staged or contextlib.nullcontext():
        run = open_run(settings, inputs, staged, ranks=ranks)
        echo(describe(run))
        scores, calibration = score(run)
        verifier = verifier_for(run)
        run, (scores, calibration), verifier, resolution = _resolved(run, scores, calibration, verifier)
        warnings = _say_baseline(run, verifier, resolution)
        selection = select_heads(scores, settings.scorer, verifier, run.settings, echo)
        selection, confirmation = confirm(run, verifier, selection, settings.objective, echo)
        if not ranks.root:
            return None  # this rank's share is done: the decision is made, rank 0 writes it
        run.work.finish_alone()
        report = _prune_report(run, scores, calibration, verifier, selection, warnings)
        report["confirmation"] = confirmation
        report["resolution"] = resolution.to_json(full_task_size(run)) if resolution else None
        write_json(run.stage / "heads.json", selection.heads.to_json())
        export = _export(run, verifier, selection, report) if settings.export else None
        # Drawn once the export has let go of every model: matplotlib's renderer and font caches (~15 MiB kept)
        # never sit beside the reloaded weights, the run's memory peak.
        _plot_selection(run, scores, selection, report, verifier.baseline)
        report["cache"] = run.work.cache.stats
        report["processes"] = ranks.size  # torchrun's ranks that shared the scoring and evaluations
        report["seconds"] = round(time.time() - started, 1)
        write_json(run.stage / "report.json", report)
    echo(f"{'pruned model, report' if settings.export else 'report'}: {out}", fg="green")
    return PruneRun(run, scores, selection, report, export)


def _resolved(run: Run, scores, calibration, verifier: Verifier):
    """The resolution predicted from a pilot ablation; with --mmlu-per-subject auto, the run re-sized to it (scores
    come back from the cache when the calibration prompts are the same)."""
    resolution = predict_resolution(scores, run.settings.scorer, verifier, run.settings)
    if run.settings.size_questions and resolution:
        run, resolution = sized(run, resolution)
        return run, score(run), verifier_for(run), resolution
    return run, (scores, calibration), verifier, resolution


def _say_baseline(run: Run, verifier: Verifier, resolution) -> list[str]:
    """The unablated model's accuracy and what the questions resolve, printed; the warnings for the report."""
    s = run.settings
    warnings = [warn_chance(verifier.baseline, s.metric, s.task)]
    echo(f"unablated {s.task} accuracy {100 * verifier.baseline.accuracy:.2f}% on "
         f"{len(verifier.baseline.questions)} questions" + (f"; next-token KL measured on "
         f"{len(verifier.kl_sequences)} texts ({verifier.kl_source})" if verifier.kl_sequences else ""))
    warnings.append(say_resolution(run, resolution))
    return [w for w in warnings if w]


def _prune_report(run: Run, scores, calibration, verifier: Verifier, selection: Selection, warnings) -> dict:
    from prune_heads.report.report import prune_report

    s = run.settings
    dormant_low = score_direction(s.scorer) == "low"
    searched = selection.search.best.heads
    gqa = gqa_costs(verifier, scores.mean(s.scorer), dormant_low, searched)
    d = selection.delta
    echo(f"{len(selection.heads)} of {selection.total} heads ({100 * len(selection.heads) / selection.total:.1f}%) "
         f"are within a {s.budget} budget on {s.task} (delta {d.delta:+.2f} pt, 95% CI [{d.ci_low:+.2f}, "
         f"{d.ci_high:+.2f}])", fg="green")
    if selection.shipped:
        sh = selection.shipped
        echo(f"the {sh['layout']} export removes {sh['attention_params_removed']:,} attention parameters (deployment "
             f"efficiency {sh['deployment_efficiency']:.2f}), {sh['kv_cache_removed']:,} B/token of KV cache, "
             f"{sh['attention_flops_removed']:,} attention FLOPs/token (objective: {s.objective})", fg="green")
    return prune_report(run, scores, calibration, verifier, selection, gqa, warnings)


def _plot_selection(run: Run, scores: ScoreTable, selection: Selection, report: dict, baseline: EvalResult) -> None:
    s, spec, stage = run.settings, run.lm.source.spec, run.stage
    plots.score_heatmap(scores.mean(s.scorer), s.scorer, selection.heads, stage / "scores_heatmap.png",
                        f"{spec}: {s.scorer} (red: {len(selection.heads)} removed heads)")
    plots.search_curve(report["points"], baseline.accuracy, s.budget.points, stage / "accuracy_vs_heads.png",
                       f"{spec}: {METRIC_NAMES.get(s.metric, s.task)} vs heads ablated by {s.scorer}",
                       metric=s.metric)
    plots.shipped_curve(report["points"], s.budget, stage / "budget_vs_shipped.png",
                        f"{spec}: {METRIC_NAMES.get(s.metric, s.task + ' accuracy')} vs what the export saves")


def _export(run: Run, verifier: Verifier, selection: Selection, report: dict) -> ExportResult:
    """The chosen heads, physically removed, written, reloaded and re-verified (with --adapter: the base is
    checked on logits and the sliced adapter on the task)."""
    s = run.settings
    info = {"scorer": s.scorer, "budget": s.budget.text, "warnings": report["warnings"],
            "budget_definition": report["budget"]["definition"], "task": s.task,
            "confirmation": {k: v for k, v in report.get("confirmation", {}).items() if k != "question_ids"}}
    if s.lora_adapter:
        result = export_pruned(run.base, selection.heads, run.stage, s.layout, s.max_shard_size, info=info,
                               progress=s.progress, log=echo, planner=run.planner, **_formats(s))
        report["adapter"] = _export_sliced_adapter(run, verifier, result.choice.plan, selection.result)
    else:
        # With --heal-in-search the chosen point was judged healed; before/after healing compares the ablation.
        ablated = verifier.evaluate_ablation(selection.heads) if s.heal_in_search else selection.result
        check = ExportCheck(run.enc, verifier.baseline, ablated, run.work.exported_evaluator(run.enc), s.batch_size)
        result = export_pruned(run.lm, selection.heads, run.stage, s.layout, s.max_shard_size, check=check, info=info,
                               progress=s.progress, log=echo, heal=verifier.heal, planner=run.planner, **_formats(s),
                               **_shipping(run))
    report["export"] = {"layout": result.choice.layout, "reason": result.choice.reason,
                        "options": result.choice.options, "stats": result.stats,
                        "verification": result.verification, "task_eval": result.task_eval,
                        "healing": result.manifest.get("healing"), "speed": result.speed, "gguf": result.gguf}
    return result


def _shipping(run: Run) -> dict:
    """The command is done with the original once the export has its reference logits (its weights are released
    before the reload), and the reload is placed as the run's model was (--device-map, --max-memory)."""
    s = run.settings
    placement = None
    if s.device_map:
        placement = {"device_map": device_map_option(s.device_map), "max_memory": max_memory_option(s.max_memory),
                     "offload_folder": str(run.staged.offload_dir)}
    return {"release_source": True, "placement": placement}


def _formats(s: Settings) -> dict:
    formats = ("safetensors", "gguf") if s.export_format == "both" else (s.export_format,)
    return {"formats": formats, "gguf_type": s.gguf_type}


def _export_sliced_adapter(run: Run, verifier: Verifier, plan, ablated: EvalResult) -> dict:
    """Slice --adapter into stage/adapter, reload pruned base + sliced adapter, and check it against the verified
    (merged, ablated) model: logits on sample prompts, then the task."""
    from prune_heads.io.cache import digest

    merged = run.lm
    out = slice_adapter(run.settings.lora_adapter, run.stage, run.stage / "adapter", log=echo)
    model = load_sliced(merged, run.stage, out)
    check = check_sliced(merged, model, plan, run.enc)
    reloaded = LoadedModel(model, merged.tokenizer, merged.arch, merged.source, merged.dtype, merged.device)
    result = run.work.evaluate(run.enc, None, "pruned base + sliced adapter", lm=reloaded,
                               model_key={**run.work.model_key, "model": f"sliced-adapter:{digest(plan.to_json())}"})
    echo(f"pruned base + sliced adapter: max |logit diff| {check['max_abs_logit_diff']:.3g}, "
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
        geometries = run.lm.arch.geometries(run.lm.model)
        heads.validate(len(geometries), [g.num_heads for g in geometries])
        check, warnings = None, []
        if with_task:
            verifier = Verifier(run.work, run.planner, run.enc, settings.budget, settings.layout)
            warnings = [w for w in [warn_chance(verifier.baseline, task=settings.task)] if w]
            check = ExportCheck(run.enc, verifier.baseline, verifier.evaluate_ablation(heads),
                                run.work.exported_evaluator(run.enc), settings.batch_size)
        result = export_pruned(run.lm, heads, staged.path, settings.layout, settings.max_shard_size, check=check,
                               info={"heads_file": source, "warnings": warnings}, progress=settings.progress,
                               log=echo, planner=run.planner, **_formats(settings), **_shipping(run))
        write_json(staged.path / "heads.json", heads.to_json())
    echo(f"exported {len(heads)} removed heads ({result.choice.layout} layout): {out}", fg="green")
    return result


# -- score, eval ----------------------------------------------------------------------------------------------------


def run_score(settings: Settings, inputs: Inputs, out: Path, force: bool) -> dict:
    """``prune-heads score``: every score function on every head; scores.json."""
    identity = run_identity("score", settings, inputs)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged, encode=inputs.calibration is None)
        table, calibration = score(run)
        payload = {"model": run.lm.source.to_json(), "recipe": settings.recipe.to_json(),
                   "settings": settings.to_json(), "versions": versions(), **scores_payload(table, calibration)}
        write_json(staged.path / "scores.json", payload)
    echo(f"scored {len(table.token_counts)} inputs ({sum(table.token_counts)} tokens): {out / 'scores.json'}",
         fg="green")
    return payload


def run_eval(settings: Settings, inputs: Inputs, out: Path, force: bool, heads: HeadSet | None) -> EvalResult:
    """``prune-heads eval``: the task, optionally with heads ablated; TASK.jsonl and summary.json."""
    identity = run_identity("eval", settings, inputs, heads=heads.to_json() if heads else None)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged)
        result = run.work.evaluate(run.enc, heads, label="ablated" if heads else "")
        data = inputs.questions
        summary = {"model": run.lm.source.to_json(), "settings": settings.to_json(), "versions": versions(),
                   "task": settings.task, "metric": task_format(settings.task).metric, "source": data.source,
                   "skipped_rows": data.skipped_rows, "ablated_heads": heads.to_json() if heads else {}}
        warning = _ablated_summary(run, heads, result, summary) if heads else warn_chance(result, task=settings.task)
        summary["warnings"] = [warning] if warning else []
        summary["cache"] = run.work.cache.stats
        write_eval_outputs(staged.path, result, summary, settings.task)
    echo(f"{settings.task} accuracy {100 * result.accuracy:.2f}% on {len(result.questions)} questions: "
         f"{out / (settings.task + '.jsonl')}", fg="green")
    return result


def _ablated_summary(run: Run, heads: HeadSet, result: EvalResult, summary: dict) -> str | None:
    """The ablated run against the unablated baseline on the same questions (and the text KL when asked)."""
    baseline = run.work.evaluate(run.enc, None, label="unablated")
    summary["baseline"] = accuracy_summary(baseline)
    summary["paired_delta"] = paired_delta(result, baseline).to_json()
    summary["kl_answer_nats"] = round(float(answer_kl(result, baseline).mean()), 6)
    summary["agreement"] = round(agreement(result, baseline), 6)
    kl_seqs, kl_source = kl_text_sequences(run.lm, run.settings, run.inputs)
    if kl_seqs:
        summary["kl_text"] = {"nats": round(run.work.text_kl(kl_seqs, heads), 6), "source": kl_source}
    return warn_chance(baseline, task=run.settings.task)


# -- compare, study -------------------------------------------------------------------------------------------------


def run_compare(pair: tuple[tuple[Settings, Inputs], tuple[Settings, Inputs]], out: Path, force: bool,
                studies: tuple | None = None) -> dict:
    """``prune-heads compare A B``: score both models on the same texts and compare their attention behaviour;
    with both models' study results, also the rank correlation of their score-function rankings."""
    from prune_heads.report.compare import compare_tables, markdown, study_ranking_correlation
    from prune_heads.report.study import read_study

    study_pair = [read_study(p) for p in studies] if studies else None
    (settings_a, inputs_a), _ = pair
    texts = compare_texts(settings_a, inputs_a)
    with StagedDirectory(out, force, inputs=inputs_a.paths + pair[1][1].paths) as staged:
        tables, names = [], []
        for settings, inputs in pair:
            lm = load(settings, inputs)
            work = Work(lm, staged, settings.batch_size, settings.progress)
            tables.append(work.scores([encode(lm, t)[: settings.max_length] for t in texts]))
            names.append(lm.source.spec)
            del lm, work
        result = {"models": names, "texts": len(texts), **compare_tables(*tables)}
        if study_pair:
            result["study_rankings"] = study_ranking_correlation(*study_pair)
        write_json(staged.path / "compare.json", result)
        write_text(staged.path / "compare.md", markdown(result, *names))
        plots.score_cdfs({k: tables[0].mean(k) for k in SCORE_KEYS}, {k: tables[1].mean(k) for k in SCORE_KEYS},
                         names[0], names[1], list(SCORE_KEYS), staged.path / "score_cdfs.png")
    echo(f"compared {names[0]} and {names[1]} on {len(texts)} texts: {out / 'compare.md'}", fg="green")
    return result


def run_study(settings: Settings, inputs: Inputs, out: Path, force: bool, functions: list[str], percents: list[float],
              modes: list[str]) -> dict:
    """``prune-heads study``: every score function's accuracy curve under dynamic, static and random ablation,
    the largest % of heads within budget, the normalised AUC, and the ranking (study.py)."""
    from prune_heads.report.study import run_study as study_curves

    # The functions, percents and modes are left out: a study resumed with more of them extends the same study.
    identity = run_identity("study", settings, inputs)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged)
        echo(f"study of {run.lm.source.spec} on {settings.task} ({len(run.enc)} questions): {len(functions)} "
             f"functions x {len(percents)} percents, modes {', '.join(modes)}")
        eval_scores, calib_scores, calib = _study_scores(run)
        baseline = run.work.evaluate(run.enc, None, "unablated")
        warning = warn_chance(baseline, "accuracy", settings.task)
        result = study_curves(eval_scores, calib_scores, lambda mask, label: run.work.evaluate(run.enc, mask, label),
                              baseline, functions, percents, modes, settings.budget.points, settings.seed,
                              _study_point_printer)
        payload = {"model": run.lm.source.to_json(), "task": settings.task, "settings": settings.to_json(),
                   "versions": versions(), "calibration": calib, "functions": functions, "percents": list(percents),
                   "modes": list(modes), "seed": settings.seed, "baseline": accuracy_summary(baseline),
                   "warnings": [w for w in [warning] if w], **result, "cache": run.work.cache.stats}
        _write_study(run, payload, result)
    best = ", ".join(f"{m}: {f}" for m, f in result["best"].items())
    echo(f"study written to {out} (best function {best})", fg="green")
    return payload


def _study_point_printer(p) -> None:
    if p.percent:
        echo(f"  {p.function:10s} {p.mode:8s} p={p.percent:4g}%: {p.zeroed:5.1f}% zeroed  "
             f"{100 * p.accuracy:6.2f}%  delta {p.delta['delta_points']:+.2f} pt")


def _study_scores(run: Run) -> tuple[ScoreTable, ScoreTable, str]:
    """Per-input scores of the evaluation prompts (dynamic ablation thresholds each input by its own scores), and
    of the calibration set (static selections)."""
    from prune_heads.pipeline.inputs import calibration_sequences

    s, enc = run.settings, run.enc
    eval_scores = run.work.scores([it.context for it in enc.items])
    if run.inputs.calibration is not None:
        calib_scores = run.work.scores(calibration_sequences(run.lm, s, run.inputs, enc)[0])
        return eval_scores, calib_scores, f"file {s.calibration}"
    # The calibration set is a round-robin sample of the evaluation inputs: reuse their scores.
    offsets, start = [], 0
    for subject in enc.subjects:
        offsets.append(list(range(start, start + len(subject.items))))
        start += len(subject.items)
    rows = round_robin(offsets, s.calibration_size)
    calib_scores = ScoreTable({k: v[rows] for k, v in eval_scores.per_input.items()},
                              [eval_scores.token_counts[i] for i in rows])
    return eval_scores, calib_scores, f"{len(rows)} of the evaluation prompts (round-robin over subjects)"


def _write_study(run: Run, payload: dict, result: dict) -> None:
    from prune_heads.report.study import markdown

    spec, task, stage = run.lm.source.spec, run.settings.task, run.stage
    write_json(stage / "study.json", payload)
    write_text(stage / "study.md", markdown(result, spec, task))
    plots.study_curves(result, stage / "study_curves.png", f"{spec} on {task}: accuracy vs heads zeroed per score "
                       "function (legend: max % within budget)")
    plots.study_ranking(result, stage / "study_ranking.png", f"{spec}: score functions ranked by max % of heads "
                        f"within {run.settings.budget.points:g} pt")
