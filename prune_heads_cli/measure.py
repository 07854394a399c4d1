"""The measuring commands: ``score`` (every score function on every head), ``eval`` (the task, optionally ablated),
``compare`` (the attention behaviour of two models) and ``study`` (the paper's comparison of score functions). Each
writes into a staging directory renamed into place when it finished (``io.staging.StagedDirectory``)."""
from __future__ import annotations

from pathlib import Path

from prune_heads.console import say, warn
from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.lm_eval_tasks import NOT_CHOICES, load_tasks
from prune_heads.data.tasks import results_file, task_format
from prune_heads.errors import UserError
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.results import EvalResult, accuracy_summary, agreement, answer_kl, paired_delta
from prune_heads.eval.textkl import HeldOutText
from prune_heads.heads import SCORE_KEYS, HeadSet, ScoreTable
from prune_heads.io.files import write_json, write_jsonl, write_text
from prune_heads.io.staging import StagedDirectory
from prune_heads.models.tokens import encode
from prune_heads.pipeline.inputs import Inputs, compare_texts, kl_texts, lm_eval_spec, round_robin
from prune_heads.pipeline.lm_eval_run import check_lm_eval_run, lm_eval_summary, say_lm_eval
from prune_heads.pipeline.settings import Settings
from prune_heads.pipeline.stages import Run, load, open_run, run_identity, score, warn_chance
from prune_heads.report import plots
from prune_heads.report.report import scores_payload, versions, write_eval_outputs
from prune_heads.report.study import StudyPlan
from prune_heads.report.study_tasks import GenerationStudy, ProbeStudy, TaskStudy
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


def run_eval(settings: Settings, inputs: Inputs, out: Path, force: bool, heads: HeadSet | None) -> EvalResult | dict:
    """``prune-heads eval``: the task, optionally with heads ablated; TASK.jsonl and summary.json."""
    if is_lm_eval(settings.task):
        return run_lm_eval(settings, inputs, out, force, heads)
    identity = run_identity("eval", settings, inputs, heads=heads.to_json() if heads else None)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged)
        result = run.work.task_result(run.enc, heads, label="ablated" if heads else "")
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
         f"{out / results_file(settings.task)}", fg="green")
    return result


def run_lm_eval(settings: Settings, inputs: Inputs, out: Path, force: bool, heads: HeadSet | None) -> dict:
    """``prune-heads eval --task lm-eval:NAME``: ``pipeline.lm_eval_run.lm_eval_summary`` (lm-eval's own model
    interface, unablated and with ``heads`` ablated, document by document, every response cached in `out` as it is
    computed: an interrupted evaluation resumes, and a later one with more documents computes only the new ones); one
    JSONL record per document and summary.json."""
    _check_results_name(settings)
    check_lm_eval_run(settings, heads)
    identity = run_identity("eval", settings, inputs, heads=heads.to_json() if heads else None)
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged, encode=False)
        summary, rows = lm_eval_summary(run, heads)
        write_jsonl(staged.path / results_file(settings.task), rows)
        write_json(staged.path / "summary.json", summary)
    say_lm_eval(summary)
    say(f"lm-eval {', '.join(summary['tasks'])}: {out / results_file(settings.task)}", fg="green")
    return summary


def _check_results_name(settings: Settings) -> None:
    """A results file name longer than the file system allows, refused before the evaluation."""
    import os

    from prune_heads.io.files import NAME_MAX

    name = results_file(settings.task)
    if len(os.fsencode(name)) > NAME_MAX:
        raise UserError(f"the results file of `task` {settings.task[:60]}... would be named with "
                        f"{len(os.fsencode(name))} bytes, more than the {NAME_MAX} a file name may have; evaluate "
                        "fewer tasks at once, or name a group of them")


def _ablated_summary(run: Run, heads: HeadSet, result: EvalResult, summary: dict) -> str | None:
    """The ablated run against the unablated baseline on the same questions (and the text KL when asked)."""
    baseline = run.work.task_result(run.enc, None, label="unablated")
    summary["baseline"] = accuracy_summary(baseline)
    summary["paired_delta"] = paired_delta(result, baseline).to_json()
    summary["kl_answer_nats"] = round(float(answer_kl(result, baseline).mean()), 6)
    summary["agreement"] = round(agreement(result, baseline), 6)
    kl_text, _ = kl_texts(run.work, run.settings, run.inputs)
    if kl_text is not None:
        damage = run.work.text_damage(kl_text, heads)
        summary["kl_text"] = {**damage.means(), "source": kl_text.source}
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


def run_study(settings: Settings, inputs: Inputs, out: Path, force: bool, plan: StudyPlan,
              probe: str | None = None) -> dict:
    """``prune-heads study``: every score function's accuracy curve under dynamic, static and random ablation,
    the largest % of heads within budget, the normalised AUC, and the ranking (study.py), on the task or, with
    ``probe``, on a long-context probe (the share of keys retrieved, of repeated tokens predicted)."""
    from prune_heads.report.study import study_curves

    # The functions, percents and modes are left out: a study resumed with more of them extends the same study.
    identity = run_identity("study", settings, inputs, **({"probe": probe} if probe else {}))
    generative = not probe and NOT_CHOICES in inputs.questions.notes  # an lm-eval task that is not multiple choice
    with StagedDirectory(out, force, settings.resume, inputs=inputs.paths, identity=identity) as staged:
        run = open_run(settings, inputs, staged, encode=probe is None and not generative)
        task, eval_scores, calib_scores, calib = (_probe_study(run, probe) if probe else
                                                  _generation_study(run) if generative else _task_study(run))
        what = f"the {probe} probe" if probe else settings.task
        say(f"study of {run.lm.source.spec} on {what} ({task.inputs} {task.unit}): {len(plan.functions)} "
            f"functions x {len(plan.percents)} percents, modes {', '.join(plan.modes)}")
        warning = (_probe_floor(task, plan) if probe else None if generative
                   else warn_chance(task.baseline, "accuracy", settings.task))
        result = study_curves(task, eval_scores, calib_scores, plan)
        payload = {"model": run.lm.source.to_json(), "task": f"probe:{probe}" if probe else settings.task,
                   "settings": settings.to_json(), "versions": versions(), "calibration": calib,
                   "functions": plan.functions, "percents": list(plan.percents), "modes": list(plan.modes),
                   "seed": settings.seed, "baseline": task.baseline_summary(),
                   "warnings": [worded(w) for w in [warning] if w], **result, "cache": run.work.cache.stats}
        _write_study(run, payload, what)
    best = ", ".join(f"{m}: {f}" for m, f in result["best"].items())
    say(f"study written to {out} (best function {best})", fg="green")
    return payload


def _task_study(run: Run) -> tuple[TaskStudy, ScoreTable, ScoreTable, str]:
    """The task's questions: scores per prompt, and the unablated baseline."""
    eval_scores, calib_scores, calib = _study_scores(run)
    baseline = run.work.task_result(run.enc, None, "unablated")
    return TaskStudy(run.work, run.enc, baseline), eval_scores, calib_scores, calib


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


def _probe_study(run: Run, name: str) -> tuple[ProbeStudy, ScoreTable, ScoreTable, str]:
    """A long-context probe at the run's lengths: each prompt scored without its target (what the model reads before
    it answers), the static selections calibrated on the same prompts unless a calibration file is given."""
    from prune_heads.pipeline.inputs import calibration_sequences
    from prune_heads.pipeline.stages import probes_for

    probe = probes_for(run, (name,))[0]
    eval_scores = run.work.scores([list(it.ids[: len(it.ids) - it.target]) for it in probe.items])
    baseline = run.work.probe(probe, None, f"{name} unablated")
    say(f"{name} unablated: {baseline.describe()}")
    if run.inputs.calibration is not None:
        seqs, calib = calibration_sequences(run.lm, run.settings, run.inputs, None)
        calib_scores = run.work.scores(seqs)
    else:
        calib_scores, calib = eval_scores, f"the probe's {len(probe.items)} prompts (without their targets)"
    return ProbeStudy(run.work, probe, baseline), eval_scores, calib_scores, calib


STUDY_DOCUMENTS = 32  # documents of a generative task a study reads unless `task_limit` says otherwise


def _generation_study(run: Run) -> tuple[GenerationStudy, ScoreTable, ScoreTable, str]:
    """A generative (or perplexity) lm-eval task, label-free: the first ``task_limit`` documents (32) with the
    unablated model's own generations (cached); each document scored on its prompt (what the model reads before it
    generates), the static selections calibrated on the same prompts unless a calibration file is given."""
    from prune_heads.pipeline.inputs import calibration_sequences, lm_eval_rows

    s = run.settings
    tasks = load_tasks(lm_eval_spec(s))
    rows = [r for r in lm_eval_rows(run.work, s, tasks, s.task_limit or STUDY_DOCUMENTS) if r["generated"] > 0]
    if not rows:
        raise UserError(f"`task` {s.task}: no document has a generated token to read; check the task's stop "
                        "sequences (until), prompts and data")
    texts = HeldOutText([r["ids"] for r in rows], f"{len(rows)} documents of {s.task} with the unablated model's "
                        f"own greedy generations ({sum(r['generated'] for r in rows)} tokens read)",
                        [r["generated"] for r in rows])
    eval_scores = run.work.scores([r["ids"][: len(r["ids"]) - r["generated"]] for r in rows])
    if run.inputs.calibration is None:
        return GenerationStudy(run.work, texts), eval_scores, eval_scores, f"the {len(rows)} documents' prompts"
    calib_scores = run.work.scores(calibration_sequences(run.lm, s, run.inputs, None)[0])
    return GenerationStudy(run.work, texts), eval_scores, calib_scores, f"file {s.calibration}"


def _probe_floor(task: ProbeStudy, plan: StudyPlan) -> str | None:
    """A probe the unablated model already fails leaves no curve to judge."""
    accuracy = 100 * task.baseline.accuracy
    if accuracy > plan.budget_points:
        return None
    warning = (f"the unablated model scores {accuracy:.1f}% {task.measure} on the {task.probe.name} probe, within the "
               f"{plan.budget_points:g} pt budget of nothing: this study cannot tell the score functions apart; probe "
               "shorter lengths (`probe_max_length`) or study a model that passes the probe")
    warn(warning)
    return warning


def _write_study(run: Run, payload: dict, what: str) -> None:
    from prune_heads.report.study import markdown

    spec, staging, measure = run.lm.source.spec, run.staging_dir, payload["measure"]
    write_json(staging / "study.json", payload)
    write_text(staging / "study.md", markdown(payload, spec, what))
    plots.study_curves(payload, staging / "study_curves.png", f"{spec} on {what}: {measure} vs heads zeroed per score "
                       "function (legend: max % within budget)")
    plots.study_ranking(payload, staging / "study_ranking.png", f"{spec}: score functions ranked by max % of heads "
                        f"within {run.settings.budget.limit:g} pt of {measure}")
