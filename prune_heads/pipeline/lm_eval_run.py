"""An lm-evaluation-harness task evaluated as ``prune-heads eval --task lm-eval:NAME`` evaluates it (the command
line writes what this returns; the Python API's ``evaluate`` returns it): lm-eval's own model interface
(``eval.lm_eval_bridge``) on the model, unablated and with heads ablated, document by document; per-document rows and
a summary with the paired difference on each task's primary metric, and for a generative task the agreement with the
unablated model's own generations. Multiple-choice, generative and perplexity tasks alike."""
from __future__ import annotations

from prune_heads.console import say
from prune_heads.data.lm_eval_index import samples
from prune_heads.data.lm_eval_tasks import load_tasks, primary_metric
from prune_heads.errors import UserError
from prune_heads.eval.lm_eval_results import document_rows, document_value, generation_summary, paired, paired_as
from prune_heads.heads import HeadSet
from prune_heads.pipeline.inputs import lm_eval_spec
from prune_heads.pipeline.settings import Settings
from prune_heads.pipeline.stages import Run
from prune_heads.report.report import versions


def lm_eval_summary(run: Run, heads: HeadSet | None) -> tuple[dict, list[dict]]:
    """(summary.json, the per-document rows) of the run's lm-eval ``task``, unablated and with ``heads`` ablated;
    every request's response is cached in the run's cache (lm-eval's CachingLM, per model and head set)."""
    from prune_heads.eval.lm_eval_bridge import evaluate_tasks

    settings = run.settings
    spec = lm_eval_spec(settings)
    base = evaluate_tasks(run.lm, load_tasks(spec), None, settings.batch_size, settings.task_limit,
                          settings.progress, run.work.lm_eval_cache(None))
    ablated = (evaluate_tasks(run.lm, load_tasks(spec), heads, settings.batch_size, settings.task_limit,
                              settings.progress, run.work.lm_eval_cache(heads)) if heads else None)
    summary = {"model": run.lm.source.to_json(), "settings": settings.to_json(), "versions": versions(),
               "task": settings.task, "ablated_heads": heads.to_json() if heads else {},
               "lm_eval": _lm_eval_results(base, ablated), "tasks": {}}
    rows = []
    for name, task in load_tasks(spec).items():
        rows += _lm_eval_task(name, task, settings, base, ablated, summary["tasks"])
    return summary, rows


def check_lm_eval_run(settings: Settings, heads: HeadSet | None) -> None:
    """What would fail or mislead only after the evaluation, refused before it: an `lm_eval_metric` a task does not
    report, and, with heads ablated, a task that samples (its same-generation and token agreement would compare two
    random draws)."""
    tasks = load_tasks(lm_eval_spec(settings))
    for task in tasks.values() if settings.lm_eval_metric else ():
        primary_metric(task, settings.lm_eval_metric)  # a metric the task does not report: before, not after
    sampled = [n for n, t in tasks.items() if samples(t)] if heads else []
    if sampled:
        raise UserError(f"lm-eval task {sampled[0]} samples its generations (do_sample: true), so comparing the "
                        "ablated model's with the unablated one's would measure chance; drop do_sample from its "
                        "generation_kwargs (greedy generation), or evaluate without `ablate`")


def say_lm_eval(summary: dict) -> None:
    """A line per task (its documents paired) and per group (lm-eval's aggregates)."""
    for name, t in summary["tasks"].items():
        d = t.get("paired")
        what = t["metric"] + (f" as {t['as']}" if t.get("as") else "")
        say(f"{name} {what} {t['unablated']:.4g}" + (f" -> {d['ablated']:.4g}, delta {d['delta']:+.4g} "
            f"{d['unit']} [{d['ci95'][0]:+.4g}, {d['ci95'][1]:+.4g}]" if d else "")
            + (f"; same generation {100 * t['generation']['same_generation']:.1f}%, tokens predicted "
               f"{100 * t['generation']['token_agreement']:.1f}%, KL {t['generation']['kl_per_token_nats']:.4f} "
               "nat/token" if "generation" in t else ""))
    groups = summary["lm_eval"].get("groups", {})
    for group, values in groups.get("unablated", {}).items():
        ablated = groups.get("ablated", {}).get(group, {})
        for key, value in values.items():
            if isinstance(value, float) and "_stderr" not in key:
                say(f"{group} (group, lm-eval's aggregate) {key} {value:.4g}"
                    + (f" -> {ablated[key]:.4g}" if isinstance(ablated.get(key), float) else ""))


def _lm_eval_results(base: dict, ablated: dict | None) -> dict:
    """lm-eval's own aggregates, per task and per group that aggregates (unablated, and ablated when heads are)."""
    runs = {"unablated": base, **({"ablated": ablated} if ablated else {})}
    out = {name: _plain(run["results"]) for name, run in runs.items()}
    groups = {name: _plain(run["groups"]) for name, run in runs.items() if run["groups"]}
    return {**out, **({"groups": groups} if groups else {})}


def _lm_eval_task(name: str, task, settings: Settings, base: dict, ablated: dict | None, into: dict) -> list[dict]:
    """One task's per-document rows; its summary goes ``into`` the summary's tasks."""
    from prune_heads.eval.lm_eval_bridge import generation_agreement

    metric = primary_metric(task, settings.lm_eval_metric)
    metrics = [m["metric"] for m in task.config.metric_list or []] or [metric]
    mine = sorted(base["samples"][name], key=lambda s: s["doc_id"])
    theirs = sorted(ablated["samples"][name], key=lambda s: s["doc_id"]) if ablated else None
    what = paired_as(mine[0], metric)[1] if mine else ""
    entry = {"output_type": task.OUTPUT_TYPE, "metric": metric, **({"as": what} if what else {}),
             "documents": len(mine), "unablated": sum(document_value(s, metric) for s in mine) / max(len(mine), 1)}
    agreement = None
    if theirs is not None:
        entry["paired"] = paired(mine, theirs, metric)
        if task.OUTPUT_TYPE == "generate_until":
            agreement = generation_agreement(ablated["model"], base["model"], theirs, mine)
            entry["generation"] = generation_summary(agreement)
    into[name] = entry
    return document_rows(name, metrics, mine, theirs, agreement)


def _plain(results: dict) -> dict:
    """lm-eval's aggregate results as JSON values (numpy numbers as floats, "N/A" kept)."""
    return {t: {k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for t, r in results.items()}
