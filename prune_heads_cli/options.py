"""The options the commands share (one definition each, typed by click), their parsing, and ``prepare``: flags over
the recipe into frozen Settings and loaded Inputs, every input checked before any weights load.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import click

from exporters.gguf.writer import GGUF_TYPES
from prune_heads.data.lm_eval_tasks import NOT_CHOICES
from prune_heads.data.tasks import TASKS
from prune_heads.errors import UserError
from prune_heads.heads import HeadSet
from prune_heads.io.files import check_path_names


class TaskType(click.ParamType):
    """A built-in task, or ``lm-eval:NAME[,NAME...]``."""

    name = "task"

    def convert(self, value, param, ctx):
        if value in TASKS or str(value).startswith("lm-eval:"):
            return value
        self.fail(f"{value!r} is not one of {', '.join(TASKS)} or lm-eval:NAME", param, ctx)

    def get_metavar(self, param, ctx=None):
        return "[" + "|".join(TASKS) + "|lm-eval:NAME]"


def _int_or_all(value: str | None, flag: str = "--mmlu-per-subject", auto: bool = False) -> int | None | str:
    if value is None:
        return None
    if str(value).lower() in ("all", "auto" if auto else "all"):
        return str(value).lower()
    try:
        n = int(value)
    except ValueError:
        also = ", 'all' or 'auto'" if auto else " or 'all'"
        raise UserError(f"{flag} {value!r} is not a number; give a positive integer{also}") from None
    if n <= 0:
        raise UserError(f"{flag} {value!r} must be a positive integer or 'all'")
    return n


def _subjects(value: str | None):
    if value is None:
        return None
    if value.lower() == "all":
        return "all"
    if value.isdigit():
        return int(value)
    return [s.strip() for s in value.split(",") if s.strip()]


def setting_options(commands: str):
    """The click options of every declared setting (pipeline/settings.py) whose flag ``commands`` offer (common,
    export, probes, main), in the declaration's order; each option's parameter is the setting's name."""
    from prune_heads.pipeline.settings import declarations

    def decorate(f):
        for name, declared in reversed(declarations().items()):
            if declared.flag is not None and declared.commands == commands:
                f = _option(name, declared)(f)
        return f

    return decorate


def _option(name: str, d):
    """One setting's click option: its flag (``--name-with-dashes`` unless declared), how it reads its value, its
    help (with the setting's default where the flag has a value to show)."""
    from prune_heads.pipeline.settings import default_of

    flag = d.flag or "--" + name.replace("_", "-")
    names = [flag, *([d.short] if d.short else [])]
    kw = {"help": d.help, "default": None, "metavar": d.metavar, "envvar": d.envvar}
    if d.kind == "switch":
        kw["is_flag"] = True
    elif d.kind == "off":
        kw.update(is_flag=True, flag_value=False)
    elif d.kind == "pair":
        names = [f"{flag}/--no-{flag[2:]}"]
    else:
        kw["type"] = _click_type(d)
    default = default_of(name)  # shown where no recipe has a say: a shipping command's own choices and values
    shown = (d.recipe is None and d.commands in ("main", "export") and d.kind in ("value", "pair", "gguf_type")
             and d.minimum is None)
    if shown and default is not None:
        kw.update(default=default, show_default=True)
    return click.option(*names, name, **kw)


def _click_type(d):
    """How a flag of the declared ``kind`` reads its value (checked by click: one line naming the flag)."""
    types = {"file": click.Path(dir_okay=False), "dir": click.Path(file_okay=False),
             "existing_file": click.Path(dir_okay=False, exists=True), "task": TaskType(), "int": int,
             "fraction": float, "gguf_type": click.Choice(list(GGUF_TYPES))}
    if d.kind in types:
        return types[d.kind]
    if d.choices:
        return click.Choice(list(d.choices))
    return click.IntRange(min=d.minimum) if d.minimum is not None else None


def common_options(f):
    """The options of every command that reads a model: --out, --force and the declared settings of all of them."""
    f = setting_options("common")(f)
    f = click.option("--force", is_flag=True, help="Replace a non-empty --out (the old one goes once the new one is "
                     "complete). An --out holding an input is refused even so.")(f)
    return click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path),
                        help="Output directory (must be empty unless --force).")(f)


export_options = setting_options("export")
# The long-context probes' inputs, shared by the main command (the guard), ``eval --probes`` and ``study --probe``.
probe_options = setting_options("probes")


def quiet_progress_bars(quiet: bool) -> None:
    """--no-progress: every progress bar of the process off, the libraries' own included (transformers' weight
    loading and GGUF conversion, huggingface_hub's downloads, datasets' split generation, lm-eval's request building,
    request cache and bootstrap). Several of them create plain tqdm bars that no switch of theirs reaches, so tqdm
    itself is told: its constructor is wrapped once per process and reads the switch each command sets (a later command
    in the same process without --no-progress shows bars again)."""
    import tqdm.std

    _BARS["quiet"] = quiet
    init = tqdm.std.tqdm.__init__
    if getattr(init, "prune_heads_switch", False):
        return

    @functools.wraps(init)
    def switched(self, *args, **kwargs):
        if _BARS["quiet"]:
            kwargs["disable"] = True
        init(self, *args, **kwargs)

    switched.prune_heads_switch = True
    tqdm.std.tqdm.__init__ = switched


_BARS = {"quiet": False}


def load_heads(path: str, action: str) -> HeadSet:
    """A heads file as a HeadSet; heads listed twice and a file naming no heads are said (both are legal)."""
    from prune_heads.io.readers import read_heads

    raw = read_heads(path)
    twice = sorted({(layer, h) for layer, hs in raw.items() for h in hs if hs.count(h) > 1})
    if twice:
        shown = ", ".join(f"layer {layer} head {h}" for layer, h in twice[:4]) + (" ..." if len(twice) > 4 else "")
        click.secho(f"WARNING: heads file {path} lists {shown} more than once; each head is {action} once", err=True,
                    fg="yellow")
    heads = HeadSet.of(raw)
    if not heads:
        click.secho(f"WARNING: heads file {path} names no heads: nothing is {action} (the result is the unpruned "
                    "model)", err=True, fg="yellow")
    return heads


def check_heads(heads: HeadSet, config) -> None:
    """Head indices the model has, checked against its config before its weights load."""
    heads.validate(config.num_hidden_layers, [config.num_attention_heads] * config.num_hidden_layers)


def prepare(kw: dict, main_command: bool = False, any_lm_eval_task: bool = False, **extra):
    """(Settings, Inputs) of a command: flags over the recipe, checked, and every input read, before weights load.
    ``any_lm_eval_task``: the command evaluates generative and perplexity lm-eval tasks too (``eval``, ``study``);
    the others judge multiple-choice questions."""
    from prune_heads.models.loading import load_config, resolve_source
    from prune_heads.pipeline.inputs import load_inputs
    from prune_heads.pipeline.merging import resolve_settings
    from prune_heads.pipeline.settings import declarations

    if not main_command and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("under torchrun only the main command (prune-heads --model M ...) shares its work across "
                        "processes; run this command in one process")
    if not kw.get("model"):
        raise UserError("--model is required; pass a Hub id, a local directory, a .gguf file, or 'smollm2-135m'")
    if not kw.get("out"):
        raise UserError("--out is required; pass a directory for the results")
    check_path_names({"model": kw["model"], "out": kw["out"], **flag_paths(named=True)})
    quiet_progress_bars(kw.get("progress") is False)
    if not main_command:
        extra.setdefault("guard", ())  # the long-context guard belongs to the main command (eval: --probes)
    overrides = {}  # "all" (null in a recipe) means no limit; an explicit flag overrides the recipe.
    per_subject = _int_or_all(kw.get("mmlu_per_subject"), auto=True)
    if per_subject == "auto":
        if not main_command:
            raise UserError("--mmlu-per-subject auto sizes the main command's budget search; give a number or 'all' "
                            "here")
        extra["size_questions"], kw = True, {**kw, "mmlu_per_subject": None}
    for key, value in (("mmlu_per_subject", _int_or_all(kw.get("mmlu_per_subject"))),
                       ("mmlu_subjects", _subjects(kw.get("mmlu_subjects"))),
                       ("task_limit", _int_or_all(kw.get("task_limit"), "--task-limit"))):
        if value is not None:
            overrides[key] = None if value == "all" else value
    special = ("model", "recipe", "mmlu_per_subject", "mmlu_subjects", "task_limit")  # read above or below
    flags = {name: kw[name] for name in declarations() if name in kw and name not in special}
    source = resolve_source(kw["model"])
    config = load_config(source, kw.get("trust_remote_code") or False, kw.get("revision"))
    settings = resolve_settings(kw["model"], kw.get("recipe"), overrides, source=source, config=config,
                                **{**flags, **extra})
    if settings.export_format != "safetensors":  # the family's llama.cpp architecture, before anything loads
        settings = dataclasses.replace(settings, layout=gguf_layout(settings.layout, config))
    inputs = load_inputs(settings, source, config, flag_paths())
    if NOT_CHOICES in inputs.questions.notes and not any_lm_eval_task:
        raise UserError(f"`task` {settings.task} is not multiple choice (generative or perplexity): a budget reads "
                        f"generation on the unablated model's own generations (`metric` kl-text, token-agreement or "
                        f"same-generation with `kl_text` {settings.task}, a multiple-choice `task` beside it); "
                        "prune-heads eval and study measure it")
    return settings, inputs


OUTPUT_PARAMS = ("out",)  # the path flags a command writes; every other path flag is an input


def flag_paths(named: bool = False) -> tuple[str, ...] | dict[str, str]:
    """Every local path this command's flags and arguments read: each parameter typed ``click.Path`` (the heads file,
    --ablate, --adapter, texts, ...) but the output (``named``: keyed by parameter name). With the settings' own
    paths they guard --out (never an input, not even with --force), so a new path flag is guarded by being declared a
    path."""
    ctx, found = click.get_current_context(silent=True), {}
    while ctx is not None:
        found.update({p.human_readable_name if isinstance(p, click.Argument) else p.name: str(ctx.params[p.name])
                      for p in ctx.command.params if isinstance(p.type, click.Path)
                      and p.name not in OUTPUT_PARAMS and ctx.params.get(p.name)})
        ctx = ctx.parent
    return found if named else tuple(found.values())


def gguf_layout(layout: str, config) -> str:
    """The layout of a GGUF export: refused where llama.cpp cannot build the family (or not per layer), auto made
    uniform where it cannot build per-layer heads."""
    from exporters.gguf.families import gguf_family
    from prune_heads.models.adapters import adapter_for

    return gguf_family(adapter_for(config.model_type).name).layout(layout)


def as_rank(settings, ranks):
    """Under torchrun: ranks other than 0 print nothing (rank 0 speaks for the run); refused combinations fail on
    every rank with the same line."""
    import dataclasses

    if ranks.size == 1:
        return settings
    if settings.device_map:
        raise UserError("--device-map places one model across devices in one process; under torchrun each rank "
                        "holds a whole model: drop --device-map, or run without torchrun")
    if not ranks.root:
        sys.stdout = sys.stderr = open(os.devnull, "w")
        return dataclasses.replace(settings, progress=False)
    return settings


def csv_list(value: str, what: str, convert=str) -> list:
    try:
        items = [convert(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{what} {value!r} is not a comma list of numbers, e.g. 0,5,10,15,20,25,30") from None
    if not items:
        raise UserError(f"--{what} is empty")
    return items

STUDY_PROBE_PROMPTS = 16  # a study on a probe: prompts per length (the guard reads fewer: it pairs, not ranks)


# -- flag rules across a command's flags (the settings' own rules are in pipeline/merging.py) ------------------


def push_flags(push_to: str | None, private: bool, no_export: bool) -> tuple[str | None, bool]:
    """The main command's --push-to and --private, which need an export and a repo to create."""
    if push_to and no_export:
        raise UserError("--push-to needs an export; drop --no-export")
    if private and not push_to:
        raise UserError("--private applies to the repo --push-to creates; add --push-to user/name or drop --private")
    return push_to, private


def guard_flag(guard: str | None, no_guard: bool) -> tuple[str, ...] | None:
    """--guard's probes, () for --no-guard, None for the recipe's."""
    if guard and no_guard:
        raise UserError("--guard and --no-guard contradict each other; pass one")
    return () if no_guard else tuple(csv_list(guard, "guard")) if guard else None


def eval_probe_flags(probes: str | None, guard_texts: str | None, max_length: int | None) -> dict:
    """``eval --probes``: the probes it runs, unablated and ablated, and their inputs."""
    if guard_texts and not probes:
        raise UserError("--guard-texts feeds the probe text; add --probes text (or passkey,copy,text)")
    return {"guard": tuple(csv_list(probes, "probes")) if probes else (), "guard_texts": guard_texts,
            "probe_max_length": max_length}


def study_probe_flags(probe: str | None, prompts: int | None, guard_texts: str | None, max_length: int | None) -> dict:
    """The settings a study on a probe needs (the probe, its prompts per length and inputs); none without one."""
    if not probe:
        if prompts or guard_texts or max_length:
            raise UserError("--probe-prompts, --guard-texts and --probe-max-length go with --probe; add --probe "
                            "passkey, copy or text")
        return {}
    if guard_texts and probe != "text":
        raise UserError(f"--guard-texts feeds the probe text, not {probe}; pass --probe text")
    return {"guard": (probe,), "guard_texts": guard_texts, "probe_max_length": max_length,
            "probe_prompts": ((probe, prompts or STUDY_PROBE_PROMPTS),)}


def compare_flags(model: str | None, study_a: str | None, study_b: str | None) -> None:
    """``compare``: the two models are its arguments, and their studies come in pairs."""
    if model:
        raise UserError("compare takes the two models as arguments: prune-heads compare MODEL_A MODEL_B --out DIR")
    if bool(study_a) != bool(study_b):
        raise UserError("--study-a and --study-b go together: pass both models' study results, or neither")
