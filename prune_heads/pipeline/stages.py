"""The stages every command is built from, each a function of a few lines that takes and returns typed results:

    open_run         Settings + Inputs -> Run (loaded model, cached work, encoded task, planner)
    sized_to_budget  Run -> (Run, Resolution): --mmlu-per-subject auto re-sizes the run from a pilot ablation
    score            Run -> Scored (ScoreTable + where the calibration came from; scoring/, cached)
    verifier_for     Run -> Verifier (search/verifier.py: the baseline, and each head set evaluated as it would ship)
    ranked           Run, Scored, Verifier -> UnitRanking (search/units.py: the removal units, most dormant first)
    resolution_of    Run, UnitRanking, Verifier -> Resolution (what the question count resolves at the budget's edge)
    select           Run, UnitRanking, Scored, Verifier -> Selection (search/selection.py: the budget search)
    guard_for        Run -> Guard | None (search/guard.py: the long-context probes, measured unablated; cached)
    confirmed        Run, Verifier, Selection, Guard, UnitRanking -> (Selection, confirmation record, guard record):
                     the chosen point confirmed on unseen questions and kept within the probes' tolerance, else
                     stepped back (with the guard: below the search's points, along the ranking)

Commands (``prune_heads_cli/commands.py``) chain these, hand the chosen heads to an exporter (``exporters``) and
assemble the report from the results (report/report.py).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from prune_heads.console import say, warn
from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.probes import ProbeOptions, ProbeSet, build_probes, probe_lengths
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import EncodedTask, encode_task
from prune_heads.eval.results import EvalResult, chance_warning
from prune_heads.eval.reuse import first_changed_layer
from prune_heads.heads import ScoreTable
from prune_heads.io.cache import tokens_digest
from prune_heads.io.files import sha256_file
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.io.staging import StagedDirectory
from prune_heads.models.loading import LoadedModel, LoadOptions, load_model, resolve_device, resolve_dtype
from prune_heads.models.placement import device_map_option, max_memory_option
from prune_heads.pipeline.inputs import (
    Inputs,
    calibration_sequences,
    heal_sequences,
    kl_texts,
    mmlu_selection,
    with_questions_per_subject,
)
from prune_heads.pipeline.settings import Settings
from prune_heads.plan.healing import HealConfig, Healer
from prune_heads.plan.planner import Planner, planner_for
from prune_heads.search.budget_search import SearchOptions
from prune_heads.search.confirmation import ConfirmationQuestions, confirm
from prune_heads.search.guard import Guard, GuardSetup
from prune_heads.search.guard_sizing import GENERATED, Sizing, resolutions, size, unresolved_warning
from prune_heads.search.pilot import predict_resolution
from prune_heads.search.ranking import SelectionOptions, unit_ranking
from prune_heads.search.resolution import Resolution, per_subject_for
from prune_heads.search.selection import Selection, select_heads
from prune_heads.search.units import UnitRanking
from prune_heads.search.verifier import Verifier, VerifierSetup


def warn_chance(result: EvalResult, metric: str = "accuracy", task: str = "mmlu") -> str | None:
    w = chance_warning(result, metric, task)
    if w:
        warn(w)
    return w


@dataclass(frozen=True)
class Scored:
    """Every score function on every head, and where the calibration sequences came from."""

    table: ScoreTable
    calibration: str


@dataclass
class Run:
    """One opened run: what every later stage reads."""

    settings: Settings
    inputs: Inputs
    base: LoadedModel  # the model that is pruned
    lm: LoadedModel  # the model that is scored and verified (base + --adapter merged, else the base)
    work: Work
    planner: Planner
    enc: EncodedTask | None
    staged: StagedDirectory | None  # None on the ranks other than 0 (they write nothing)

    @property
    def staging_dir(self) -> Path:
        """Where this run writes until it is complete (renamed into --out then)."""
        return self.staged.path


def load(settings: Settings, inputs: Inputs, offload_dir: Path | None = None, ranks: Ranks = LOCAL) -> LoadedModel:
    """The model, as the settings place it; under torchrun on the rank's own GPU, in the dtype rank 0 chose."""
    kind = resolve_device(settings.device).type
    dtype = settings.dtype
    if ranks.size > 1:  # --dtype auto measures this machine: one measurement (rank 0's) decides for every rank
        dtype = ranks.broadcast(resolve_dtype(dtype, torch.device(kind), inputs.config) if ranks.root else None)
    options = LoadOptions(settings.trust_remote_code, settings.revision, settings.allow_pickle,
                          device_map_option(settings.device_map), max_memory_option(settings.max_memory),
                          str(offload_dir) if offload_dir else None)
    return load_model(settings.model, dtype, ranks.device(settings.device, kind), options, inputs.source,
                      inputs.config)


def run_identity(command: str, settings: Settings, inputs: Inputs, **extra) -> dict:
    """What defines a run's results (recorded in its --out; --resume continues only the same): the command, the
    model source and its content hash, the settings (all but how it is shown and resumed), and ``extra``."""
    src = inputs.source
    model = {"path": src.path, "file": src.gguf_file, "revision": src.revision, "fingerprint": src.fingerprint}
    shown = ("model", "progress", "resume")
    return {"command": command, "model": model,
            "settings": {k: v for k, v in settings.to_json().items() if k not in shown}, **extra}


def open_run(settings: Settings, inputs: Inputs, staged: StagedDirectory | None, encode: bool = True,
             ranks: Ranks = LOCAL, loaded: LoadedModel | None = None) -> Run:
    """Load the model (``loaded``: one the caller holds, e.g. the Python API's) and merge --adapter into a copy, open
    the result cache (none without a staging directory), encode the task. Under torchrun (``ranks``), rank 0 holds the
    staging directory and the others ``None``."""
    base = loaded or load(settings, inputs, staged.offload_dir if settings.device_map else None, ranks)
    # With --adapter, everything is scored and verified on the user's actual model (base with the adapter merged);
    # the base is pruned and the adapter sliced to fit it.
    lm = with_adapter_merged(base, settings.lora_adapter) if settings.lora_adapter else base
    work = Work(lm, staged, settings.batch_size, settings.progress, ranks)
    enc = encode_task(lm, inputs.questions) if encode else None
    return Run(settings, inputs, base, lm, work, planner_for(lm), enc, staged)


def describe(run: Run) -> str:
    geos = run.lm.arch.geometries(run.lm.model)
    s = run.settings
    choice = run.lm.extra.get("dtype_choice")
    why = f" ({choice['reason']})" if choice and s.dtype == "auto" else ""
    return (f"{run.lm.source.spec}: {run.lm.config.model_type}, {len(geos)} layers x {geos[0].num_heads} heads "
            f"({geos[0].num_kv_heads} KV), {run.lm.dtype} on {run.lm.device}{why}; recipe {s.recipe.name}; "
            f"{len(run.enc)} {s.task} questions in {len(run.enc.subjects)} subjects")


def score(run: Run) -> Scored:
    """Every score function on every head over the calibration sequences."""
    seqs, source = calibration_sequences(run.lm, run.settings, run.inputs, run.enc)
    if run.settings.calibrate_probes:  # prompts like the guard's at its shortest length, never its own (another seed)
        probes = probes_for(run, ("passkey", "copy"), seed=run.settings.seed + 1, shortest=True)
        seqs = seqs + [list(it.ids) for p in probes for it in p.items]
        source += " + " + ", ".join(f"{len(p.items)} {p.name} probe prompts" for p in probes)
    return Scored(run.work.scores(seqs), source)


def sized(run: Run, resolution: Resolution) -> tuple[Run, Resolution]:
    """--mmlu-per-subject auto: the run on as many questions per subject as make the predicted half-width fit the
    budget, capped by what exists (half of the smallest subject while confirming: the rest confirms)."""
    s = run.settings
    available = mmlu_selection(run.inputs.all_questions, s, None).subjects
    cap = min(len(x.questions) for x in available)
    per_subject, capped = per_subject_for(resolution, len(available), cap // 2 if s.confirm and cap > 1 else cap)
    settings = dataclasses.replace(s, mmlu_per_subject=per_subject)
    inputs = with_questions_per_subject(settings, run.inputs)
    enc = encode_task(run.lm, inputs.questions)
    sized_resolution = dataclasses.replace(resolution, questions=len(enc))
    say(f"`mmlu_per_subject` auto: {per_subject} per subject, {len(enc)} questions in {len(enc.subjects)} subjects "
         f"(predicted +/-{sized_resolution.half_width():.3g} at the budget's edge"
         + (", capped by the questions that exist" if capped else "") + ")", fg="yellow" if capped else None)
    return dataclasses.replace(run, settings=settings, inputs=inputs, enc=enc), sized_resolution


def full_task_size(run: Run) -> int | None:
    """Questions in the whole task (what the paper's protocol evaluates); None for a budget on held-out text."""
    return None if run.settings.on_text else len(run.inputs.all_questions.questions)


def say_resolution(run: Run, resolution: Resolution | None) -> str | None:
    """Print what the question count resolves next to the budget; a red warning (returned) when it cannot."""
    if resolution is None:
        return None
    say("resolution: " + resolution.describe(full_task_size(run), run.settings.task))
    if resolution.resolves:
        return None
    unit = "nat" if resolution.budget.in_nats else "pt"
    fix = ("more held-out texts (kl_text_size: N in a `recipe` file)" if run.settings.on_text
           else f"`mmlu_per_subject` auto (about {resolution.questions_for(resolution.budget.limit):,} questions)")
    what = "held-out texts" if run.settings.on_text else "questions"
    warning = (f"the budget ({resolution.budget.limit:g} {unit}) is smaller than the +/-{resolution.half_width():.3g} "
               f"{unit} that {resolution.questions} {what} resolve: points within budget cannot be told from points "
               f"beyond it; use {fix}")
    warn(warning)
    return warning


def verifier_for(run: Run) -> Verifier:
    """The verifier of the main job, with its unablated baseline (cached)."""
    s = run.settings
    kl_text, confirm_text = kl_texts(run.work, s, run.inputs)
    setup = VerifierSetup(s.budget, s.layout, s.early_stop_blocks, kl_text, healer(run), s.heal_in_search,
                          confirm_text if s.confirm and s.on_text else None)
    return Verifier.measured(run.work, run.planner, run.enc, setup)


def selection_options(s: Settings) -> SelectionOptions:
    search = SearchOptions(s.grid, s.patience, s.refine_steps, s.parallel, s.objective)
    return SelectionOptions(s.scorer, s.units, s.gqa, search)


def sized_to_budget(run: Run) -> tuple[Run, Resolution | None]:
    """--mmlu-per-subject auto: a pilot ablation (the search's first point, on the run as opened) predicts the
    resolution, and the run is re-sized to it (its scores and baseline come back from the cache when its prompts are
    the same). Otherwise the run as it is, and no resolution yet."""
    if not run.settings.size_questions:
        return run, None
    scored = score(run)
    verifier = verifier_for(run)
    resolution = resolution_of(run, ranked(run, scored, verifier), verifier)
    return sized(run, resolution) if resolution else (run, None)


def ranked(run: Run, scored: Scored, verifier: Verifier) -> UnitRanking:
    """The removal units, most dormant first by the run's scorer."""
    return unit_ranking(scored.table, verifier, selection_options(run.settings))


def resolution_of(run: Run, ranking: UnitRanking, verifier: Verifier) -> Resolution | None:
    """What the run's question count resolves at the budget's edge, from a pilot ablation of the ranking's first grid
    point (cached: the search reuses it)."""
    return predict_resolution(ranking, verifier, run.settings.grid)


def select(run: Run, ranking: UnitRanking, scored: Scored, verifier: Verifier) -> Selection:
    return select_heads(ranking, scored.table, verifier, selection_options(run.settings))


def probes_for(run: Run, names: tuple[str, ...], seed: int | None = None, shortest: bool = False,
               prompts: dict[str, int] | None = None) -> tuple[ProbeSet, ...]:
    """The long-context probes ``names`` at the recipe's lengths (``shortest``: the shortest only), fitted to the
    model's context and `probe_max_length`, with the recipe's prompts per length (or ``prompts``)."""
    s = run.settings
    context = getattr(run.lm.config.get_text_config(), "max_position_embeddings", None)
    lengths = probe_lengths(s.probe_lengths, context, s.probe_max_length)[: 1 if shortest else None]
    counts = tuple({**dict(s.probe_prompts), **(prompts or {})}.items())
    options = ProbeOptions(names, lengths, counts, s.seed if seed is None else seed)
    return build_probes(run.lm, options, run.inputs.guard_texts, f"file {s.guard_texts}")


def guard_for(run: Run, pilot=None) -> Guard | None:
    """The long-context guard (None when `no_guard`), with the unablated model's probe results; given a ``pilot``
    ablation (the search's choice: the first point the guard judges, near the budget's edge), what its prompts
    resolve, and with `sizing` auto its generated probes sized to resolve."""
    s = run.settings
    if not s.guard:
        return None
    run.work.keep_layer = first_changed_layer(pilot)  # the unablated reads keep where the points to come start
    guard = Guard.measured(run.work, GuardSetup(probes_for(run, s.guard), s.guard_tolerance, s.budget.rule,
                                                s.guard_measure))
    if pilot is not None:
        guard = _resolved(run, guard, pilot)
    for base in guard.baselines:
        say(f"long-context probe {base.probe.name} unablated: " + base.describe())
    for row in guard.resolution:
        if row.resolves:
            say(f"long-context guard: {row.describe()}")
        else:
            warn(unresolved_warning(row))
    return guard


def _resolved(run: Run, guard: Guard, pilot) -> Guard:
    """The guard with its resolution predicted from a pilot read, re-built at the sizing's prompt counts when
    `sizing` is auto (the sizing is cached: a resumed run takes the same)."""
    s, probes = run.settings, guard.setup.probes
    rows = resolutions(guard.baselines, guard.read_all(pilot, "pilot"), guard.tolerances, s.guard_measure)
    generated = sorted(p.name for p in probes if p.name in GENERATED)
    if s.guard_sizing != "auto" or not generated:
        guard.resolution = rows
        return guard
    current = {p.name: len(p.items) // len(p.lengths) for p in probes}
    key = {"probes": [p.to_json() for p in probes], "tolerance": guard.tolerances, "pilot": run.work.ablation_key(
        pilot), "max_tokens": s.guard_max_tokens, "max_prompts": s.guard_max_prompts, "measure": s.guard_measure}
    hit = run.work.recall("guard_sizing", key)
    if hit is None:
        hit = run.work.remember("guard_sizing", key, size(rows, current, s.guard_max_tokens,
                                                          s.guard_max_prompts).to_tensors())
    sizing = Sizing.from_tensors(generated, hit)
    if any(sizing.prompts[p] != current[p] for p in generated):
        spent = guard.seconds
        setup = GuardSetup(probes_for(run, s.guard, prompts=sizing.prompts), s.guard_tolerance, s.budget.rule,
                           s.guard_measure)
        guard = Guard.measured(run.work, setup)
        guard.seconds += spent
        # What the resized probes resolve, from the pilot read again on them (the check of the search's choice, the
        # first point the guard judges, then reads it from the cache): more prompts, a closer estimate.
        rows = resolutions(guard.baselines, guard.read_all(pilot, "pilot"), guard.tolerances, s.guard_measure)
        counts = ", ".join(f"{n} {p} prompts per length" for p, n in sizing.prompts.items())
        say(f"long-context guard sized to resolve its tolerances: {counts}"
            + (f" (capped by {sizing.capped_by})" if sizing.capped_by else ""))
    guard.resolution, guard.sizing = rows, sizing
    return guard


def confirmed(run: Run, verifier: Verifier, selection: Selection, guard: Guard | None,
              ranking: UnitRanking) -> tuple[Selection, dict, dict]:
    s = run.settings
    questions = ConfirmationQuestions(run.inputs.confirmation, run.inputs.confirmation_source)
    if s.confirm and s.on_text and is_lm_eval(s.kl_text) and verifier.setup.confirm_text is None:
        questions = ConfirmationQuestions(None, f"not confirmed: {s.kl_text} has no documents after the "
                                                f"{s.kl_text_size} per task the search reads (`kl_text_size`)")
    return confirm(verifier, questions, selection, s.objective, guard, ranking)


def with_adapter_merged(lm: LoadedModel, adapter_dir: str) -> LoadedModel:
    """A copy of the model with a peft adapter merged in (the base stays untouched for pruning)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from prune_heads.errors import UserError
    from prune_heads.models.checks import check_finite

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        raise UserError(f"`lora_adapter` {adapter_dir} is not a peft adapter (no adapter_model.safetensors)")
    check_finite(load_file(str(weights)).items(), str(adapter_dir), "adapter tensors")
    merged = PeftModel.from_pretrained(copy.deepcopy(lm.model), adapter_dir).merge_and_unload().eval()
    source = copy.copy(lm.source)
    source.fingerprint = f"{lm.source.fingerprint}+adapter:{sha256_file(weights)}"  # keys the cache apart
    say(f"adapter {adapter_dir} merged for scoring and verification")
    return LoadedModel(merged, lm.tokenizer, lm.arch, source, lm.dtype, lm.device, {"adapter": str(adapter_dir)})


def healer(run: Run) -> Healer | None:
    """Healing as --heal-steps and the recipe set it up (None without --heal-steps)."""
    s = run.settings
    if not s.heal_steps:
        return None
    known = {k: v for k, v in s.heal.items() if k in HealConfig.__dataclass_fields__ and k not in ("steps", "seed")}
    config = HealConfig(steps=s.heal_steps, seed=s.seed, **known)
    seqs, source = heal_sequences(run.base, s, run.inputs, config.steps, config.batch_size, config.max_length)
    return Healer(config, seqs, source, run.base.arch, tokens_digest(seqs), s.progress)
