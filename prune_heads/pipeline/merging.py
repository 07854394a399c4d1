"""What a run is asked to do: command-line flags (or the API's keyword arguments) merged over the model's recipe,
checked and frozen into ``Settings`` (settings.py: every setting's declaration) before anything loads."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import fields

from prune_heads.data.lm_eval_index import is_lm_eval
from prune_heads.data.tasks import MMLU_TASKS, task_format
from prune_heads.errors import UserError
from prune_heads.models.loading import (
    EMBEDDED_MODELS,
    ModelSource,
    load_config,
    resolve_device,
    resolve_source,
)
from prune_heads.models.placement import device_map_option, max_memory_option
from prune_heads.pipeline.recipes import load_recipe, recipe_for
from prune_heads.pipeline.settings import Recipe, Settings, declarations, default_of, for_device
from prune_heads.search.budget import METRIC_TASKS, TEXT_METRICS, Budget


def recipe_values(rec: Recipe, device_type: str) -> dict:
    """The recipe's value of every setting it may give (its declared recipe key), for this kind of device, converted to
    the setting's type; the budget's unit and the generation budget (recipe keys of the budget) beside them."""
    values = {key: rec.values.get(key) for key in ("metric", "generation_budget")}
    for name, d in declarations().items():
        said, value = rec.lookup(d.recipe) if d.recipe else (False, None)
        if d.per_device:
            value = for_device(value, device_type)
        if said and (value is not None or d.from_recipe == "probes"):
            values[name] = _CONVERSIONS[d.from_recipe](name, value) if d.from_recipe else value
    return values


def _merged(name: str, value: dict) -> tuple:
    """A recipe's per-probe values over the setting's defaults."""
    return tuple({**dict(default_of(name)), **value}.items())


def _tolerances(name: str, value: dict) -> tuple:
    """The probes' tolerances over the defaults, each parsed (5pt, 0.05nat)."""
    from prune_heads.search.guard import parse_tolerance

    return tuple((probe, parse_tolerance(probe, v)) for probe, v in _merged(name, value))


# How a recipe's value becomes a setting's (``Declared.from_recipe``).
_CONVERSIONS = {
    "tuple": lambda name, v: tuple(v) if isinstance(v, list) else v,
    "dict": lambda name, v: dict(v),
    "sorted": lambda name, v: tuple(sorted(set(v))),
    "probes": lambda name, v: tuple(v or ()),  # `probes: []` (or null): no guard
    "merged": _merged,
    "tolerance": _tolerances,
}


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


def _check_declared(values: dict) -> None:
    """Each value against its declaration: one of its choices, at least its minimum (the command line's flags are
    checked so by click already; the API's keyword arguments and a recipe's values are checked here)."""
    for name, d in declarations().items():
        value = values.get(name)
        if value is None or value == default_of(name):  # a default is valid (heal_steps 0: no healing)
            continue
        if d.choices and value not in d.choices:
            raise UserError(f"`{name}` {value!r} is not one of {', '.join(d.choices)}")
        if d.minimum is not None and (isinstance(value, bool) or not isinstance(value, int) or value < d.minimum):
            raise UserError(f"`{name}` {value!r} must be a whole number of at least {d.minimum}")


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
         "`heal_steps` and `lora_adapter` do not combine: healing would change the base the adapter was trained on; "
         "heal without `lora_adapter`, or slice the adapter without healing"),
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
         "`lora_adapter` slices the adapter to fit the export; drop `no_export`"),
        (v("lora_adapter") and v("export_format") not in (None, "safetensors"),
         "`lora_adapter` slices a LoRA adapter for the safetensors export; use `export_format` safetensors with it"),
    ]
    for conflict, message in conflicts:
        if conflict:
            raise UserError(message)


def resolve_settings(model: str, recipe: str | None = None, overrides: dict | None = None, *,
                     source: ModelSource | None = None, config=None, **flags) -> Settings:
    """Read the model's config (cheap) to pick its recipe, then every setting: its declared default, over it the
    recipe's value, over that the flag's (or the API's keyword); every value and combination is checked here, before
    any weights or data load."""
    if config is None:
        source = source or resolve_source(model)
        config = load_config(source, flags.get("trust_remote_code") or False, flags.get("revision"))
    preferred = EMBEDDED_MODELS.get(model, {}).get("recipe")
    rec = load_recipe(recipe) if recipe else recipe_for(model, config.model_type, preferred)
    values = {name: default_of(name) for name in declarations() if name not in ("model", "recipe", "budget")}
    values.update(recipe_values(rec, resolve_device(flags.get("device") or "auto").type))
    values.update({key: value for key, value in flags.items() if value is not None})
    values.update(overrides or {})  # explicit values that may be None ("all")
    _check_declared(values)
    values["task"] = _task(values, flags)
    budget = dataclasses.replace(_budget(values, flags), rule=values.get("decision") or Settings.decision)
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
