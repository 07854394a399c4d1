"""The measuring commands: ``score`` (every score function on every head), ``eval`` (the task, optionally ablated),
``compare`` (the attention behaviour of two models) and ``study`` (the paper's comparison of score functions). Each
writes into a staging directory renamed into place when it finished (``io.files.StagedDirectory``)."""
from __future__ import annotations

from pathlib import Path

from prune_heads.console import say
from prune_heads.data.tasks import task_format
from prune_heads.eval.results import EvalResult, accuracy_summary, agreement, answer_kl, paired_delta
from prune_heads.eval.work import Work
from prune_heads.heads import SCORE_KEYS, HeadSet, ScoreTable
from prune_heads.io.files import StagedDirectory, write_json, write_text
from prune_heads.models.tokens import encode
from prune_heads.pipeline.inputs import Inputs, compare_texts, kl_text_sequences, round_robin
from prune_heads.pipeline.settings import Settings
from prune_heads.pipeline.stages import Run, load, open_run, score, warn_chance
from prune_heads.report import plots
from prune_heads.report.report import scores_payload, versions, write_eval_outputs
from prune_heads_cli.commands import run_identity
from prune_heads_cli.console import worded

# -- score, eval ----------------------------------------------------------------------------------------------------


def run_score(settings: Settings, inputs: Inputs, out: Path, force: bool) -> dict:
    """``prune-heads score``: every score function on every head; scores.json."""
    identity = run_identity("score", settings, inputs)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged, encode=inputs.calibration is None)
        scored = score(run)
        table = scored.table
        payload = {"model": run.lm.source.to_json(), "recipe": settings.recipe.to_json(),
                   "settings": settings.to_json(), "versions": versions(), **scores_payload(table, scored.calibration)}
        write_json(staged.path / "scores.json", payload)
    say(f"scored {len(table.token_counts)} inputs ({sum(table.token_counts)} tokens): {out / 'scores.json'}",
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
        summary["warnings"] = [worded(warning)] if warning else []
        if settings.guard:
            summary["probes"] = _probes(run, heads)
            write_json(staged.path / "probes.json", summary["probes"])
        summary["cache"] = run.work.cache.stats
        write_eval_outputs(staged.path, result, summary, settings.task)
    say(f"{settings.task} accuracy {100 * result.accuracy:.2f}% on {len(result.questions)} questions: "
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


def _probes(run: Run, heads: HeadSet | None) -> dict:
    """``eval --probes``: each long-context probe per length, unablated and (with ``heads``) ablated, paired per prompt
    as the guard judges it."""
    from prune_heads.pipeline.stages import probes_for
    from prune_heads.search.guard import DEFAULT_TOLERANCE, compare

    out = {}
    for probe in probes_for(run, run.settings.guard):
        base = run.work.probe(probe, None, f"{probe.name} unablated")
        say(f"{probe.name} unablated: {base.describe()}")
        out[probe.name] = {**probe.to_json(), "original": base.summary()}
        if heads:
            ablated = run.work.probe(probe, heads, f"{probe.name} ablated")
            tolerance = dict(run.settings.guard_tolerance).get(probe.name, DEFAULT_TOLERANCE[probe.name])
            rows = compare(base, ablated, tolerance, run.settings.budget.rule)
            say(f"{probe.name} ablated: {ablated.describe()}")
            out[probe.name].update(ablated=ablated.summary(), change=[r.to_json() for r in rows])
    return out


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
    say(f"compared {names[0]} and {names[1]} on {len(texts)} texts: {out / 'compare.md'}", fg="green")
    return result


def run_study(settings: Settings, inputs: Inputs, out: Path, force: bool, functions: list[str], percents: list[float],
              modes: list[str]) -> dict:
    """``prune-heads study``: every score function's accuracy curve under dynamic, static and random ablation,
    the largest % of heads within budget, the normalised AUC, and the ranking (study.py)."""
    from prune_heads.report.study import StudyEvaluator, StudyPlan, study_curves

    # The functions, percents and modes are left out: a study resumed with more of them extends the same study.
    identity = run_identity("study", settings, inputs)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged)
        say(f"study of {run.lm.source.spec} on {settings.task} ({len(run.enc)} questions): {len(functions)} "
             f"functions x {len(percents)} percents, modes {', '.join(modes)}")
        eval_scores, calib_scores, calib = _study_scores(run)
        baseline = run.work.evaluate(run.enc, None, "unablated")
        warning = warn_chance(baseline, "accuracy", settings.task)
        plan = StudyPlan(functions, tuple(percents), tuple(modes), settings.budget.limit, settings.seed)
        result = study_curves(StudyEvaluator(run.work, run.enc, baseline), eval_scores, calib_scores, plan)
        payload = {"model": run.lm.source.to_json(), "task": settings.task, "settings": settings.to_json(),
                   "versions": versions(), "calibration": calib, "functions": functions, "percents": list(percents),
                   "modes": list(modes), "seed": settings.seed, "baseline": accuracy_summary(baseline),
                   "warnings": [worded(w) for w in [warning] if w], **result, "cache": run.work.cache.stats}
        _write_study(run, payload, result)
    best = ", ".join(f"{m}: {f}" for m, f in result["best"].items())
    say(f"study written to {out} (best function {best})", fg="green")
    return payload


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
                        f"within {run.settings.budget.limit:g} pt")
