"""Command line: ``prune-heads --model M --budget 1% --out DIR`` (the main job: score, search, export, verify) and
the commands ``score``, ``eval``, ``study``, ``compare``, ``export``, ``adapt`` and ``push``.

One command table; every setting's flag is generated from its one declaration (``prune_heads.pipeline.settings``,
through ``setting_options``), and a flag name means one thing everywhere. Flags left unset take the recipe's value
(``--recipe``, or the one matching the model; see ``recipes/``). Every value and flag combination is checked before
anything loads. Bad input ends with a one-line ``error: ...`` naming the problem and the fix, and exit code 2; an
unexpected failure with one line and the path of a log holding the traceback, exit code 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from prune_heads.data.probes import PROBES
from prune_heads.errors import DiskFull, UserError
from prune_heads.heads import SCORE_KEYS
from prune_heads.io.diskspace import failed_for_space
from prune_heads.search.budget import METRIC_CHOICES
from prune_heads_cli.console import learn_flags, show_core_messages, worded
from prune_heads_cli.edge import (
    disk_full,
    interrupted,
    left_behind,
    path_problem,
    terminate,
    unexpected,
    written_directory,
)
from prune_heads_cli.memory import install_policy
from prune_heads_cli.options import (
    STUDY_PROBE_PROMPTS,
    as_rank,
    check_heads,
    common_options,
    compare_flags,
    csv_list,
    eval_probe_flags,
    export_options,
    flag_paths,
    guard_flag,
    load_heads,
    prepare,
    probe_options,
    push_flags,
    setting_options,
    study_probe_flags,
)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@common_options
@setting_options("main")
@click.option("--metric", type=click.Choice(list(METRIC_CHOICES)), help="What the budget limits: accuracy points on "
              "--task (mmlu and mmlu-cloze: on that task); kl, the mean KL from the unablated model over the answer "
              "choices; on the --kl-text texts (a generative lm-eval task: the unablated model's own generations): "
              "kl-text, the mean next-token KL (nats); token-agreement, points of next-token predictions that change; "
              "same-generation, points of generations that change. All but accuracy have signal at chance level.")
@export_options
@click.option("--no-guard", is_flag=True, help="Turn the long-context guard off (the report says so).")
@probe_options
@click.option("--push-to", metavar="REPO", help="After a verified export, push it to this Hub repo (user/name).")
@click.option("--private", is_flag=True, help="With --push-to: create the repo private.")
@click.version_option(package_name="prune-heads")
@click.pass_context
def cli(ctx: click.Context, **kw):
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
    show_core_messages()
    if ctx.invoked_subcommand is not None:
        return
    from exporters.hub import push_export
    from prune_heads.io.parallel import launched_ranks, leave
    from prune_heads_cli.commands import run_prune

    push_to, private = push_flags(kw.pop("push_to"), kw.pop("private"), kw["export"] is False)
    guard = guard_flag(kw.pop("guard"), kw.pop("no_guard"))
    settings, inputs = prepare(kw, True, guard=guard, metric=kw.pop("metric"))
    ranks = launched_ranks()
    settings = as_rank(settings, ranks)
    run_prune(settings, inputs, kw["out"], kw["force"], ranks)
    if push_to and ranks.root:
        push_export(kw["out"], push_to, private=private)
    leave(ranks)




@cli.command()
@common_options
def score(**kw):
    """Score every head with every score function; write scores.json."""
    from prune_heads_cli.measure import run_score

    run_score(*prepare(kw), kw["out"], kw["force"])


@cli.command(name="eval")
@common_options
@click.option("--ablate", type=click.Path(dir_okay=False), help="heads.json of heads to zero ({layer: [head, ...]}).")
@click.option("--probes", metavar="PROBES", help="Also run these long-context probes (passkey, copy, text), unablated "
              "and with --ablate's heads, per length: probes.json.")
@probe_options
def eval_cmd(ablate, probes, guard_texts, probe_max_length, **kw):
    """Evaluate the task (MMLU 5-shot by default), optionally with heads ablated; write TASK.jsonl and summary.json
    (and probes.json with --probes)."""
    from prune_heads_cli.measure import run_eval

    heads = load_heads(ablate, "ablated") if ablate else None
    settings, inputs = prepare(kw, any_lm_eval_task=True, **eval_probe_flags(probes, guard_texts, probe_max_length))
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
def export_cmd(heads_file, no_task_eval, **kw):
    """Remove a given head set (no search), write the smaller model to --out and verify it."""
    from prune_heads_cli.commands import run_export

    heads = load_heads(heads_file, "removed")
    settings, inputs = prepare(kw)
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
    from prune_heads.io.files import check_path_names

    check_path_names({"DIRECTORY": directory})
    push_export(directory, repo_id, private, branch, commit_message, force)


@cli.command()
@click.argument("model_a")
@click.argument("model_b")
@common_options
@click.option("--study-a", type=click.Path(), help="MODEL_A's study (study.json or its directory): with --study-b, "
              "also compare the two rankings of score functions.")
@click.option("--study-b", type=click.Path(), help="MODEL_B's study (study.json or its directory).")
def compare(model_a, model_b, study_a, study_b, **kw):
    """Compare the attention behaviour of two models on the same texts: compare.json, compare.md, score_cdfs.png."""
    from prune_heads_cli.measure import run_compare

    compare_flags(kw.get("model"), study_a, study_b)
    pair = (prepare({**kw, "model": model_a}), prepare({**kw, "model": model_b}))
    run_compare(pair, kw["out"], kw["force"], (study_a, study_b) if study_a else None)




@cli.command()
@common_options
@click.option("--budget", "-b", default="1%", show_default=True, help="Accuracy points the curves are judged against.")
@click.option("--functions", default="all", show_default=True, help="Score functions to compare: 'all' or a comma "
              f"list of {', '.join(SCORE_KEYS)}.")
@click.option("--percents", default="0,5,10,15,20,25,30", show_default=True, help="% of pooled per-input head scores "
              "each threshold selects.")
@click.option("--modes", default="dynamic,static,random", show_default=True, help="Ablation modes: dynamic (per "
              "input, the paper's), static (heads fixed from the calibration set), random (baseline).")
@click.option("--probe", type=click.Choice(PROBES), help="Judge the curves by a long-context probe instead of the "
              "task: passkey (keys read back), copy (repeats predicted) or text (--guard-texts' next tokens).")
@click.option("--probe-prompts", type=click.IntRange(min=2), help="With --probe: prompts per length (default "
              f"{STUDY_PROBE_PROMPTS}).")
@probe_options
def study(budget, functions, percents, modes, probe, probe_prompts, guard_texts, probe_max_length, **kw):
    """Reproduce the paper's comparison of score functions on one model: accuracy vs % of heads zeroed per
    function (dynamic, static, random), max % within budget, AUC and ranking: study.json, study.md, PNGs. With
    --probe, the same comparison judged by long-context retrieval or copying; on a generative lm-eval task
    (--task lm-eval:NAME), by the unablated model's own generations (the share of its tokens predicted as it did)."""
    from prune_heads.report.study import StudyPlan, check_study_args
    from prune_heads_cli.measure import run_study

    funcs = list(SCORE_KEYS) if functions.strip().lower() == "all" else csv_list(functions, "functions")
    percent_values, mode_names = csv_list(percents, "percents", float), csv_list(modes, "modes")
    check_study_args(funcs, percent_values, mode_names)
    probe_flags = study_probe_flags(probe, probe_prompts, guard_texts, probe_max_length)
    settings, inputs = prepare(kw, budget=budget, metric="accuracy", any_lm_eval_task=not probe, **probe_flags)
    plan = StudyPlan(funcs, tuple(percent_values), tuple(mode_names), settings.budget.limit, settings.seed)
    run_study(settings, inputs, kw["out"], kw["force"], plan, probe)


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
    from exporters.lora import read_adapter_config, slice_adapter
    from exporters.manifest import read_manifest
    from prune_heads.io.files import check_path_names
    from prune_heads.io.staging import StagedDirectory

    check_path_names({"out": out, **flag_paths(named=True)})
    read_adapter_config(adapter_dir)
    read_manifest(pruned)
    with StagedDirectory(out, force, None, inputs=flag_paths()) as staged:
        slice_adapter(adapter_dir, pruned, staged.path)
    click.secho(f"sliced adapter written to {out} (load it with PeftModel.from_pretrained on {pruned})", err=True,
                fg="green")












learn_flags(cli)  # the console words the core's option names as these flags


def main(argv: list[str] | None = None) -> None:
    import signal

    install_policy()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Ctrl-C goes through the clean-up path
    signal.signal(signal.SIGTERM, terminate)
    try:
        cli.main(args=argv, prog_name="prune-heads", standalone_mode=False)
        left_behind()
    except DiskFull as e:
        disk_full(e.directory, e.what, e.needed)
    except UserError as e:
        click.secho(f"error: {worded(str(e))}", err=True, fg="red")
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        interrupted()
    except click.ClickException as e:  # usage errors (unknown option, bad choice): one line, like ours
        click.secho(f"error: {e.format_message()} (see prune-heads --help)", err=True, fg="red")
        sys.exit(2)
    except Exception as e:  # noqa: BLE001  (the outer handler: anything else is a bug, reported in one line)
        if path_problem(e):  # a name longer than the file system allows, or one it cannot encode
            click.secho(f"error: {path_problem(e)}", err=True, fg="red")
            sys.exit(2)
        if failed_for_space(e, written_directory(e)):  # a write outside the export (cache, report, plot)
            disk_full(written_directory(e), "the run's files")
        unexpected(e)
    sys.exit(0)


if __name__ == "__main__":
    main()
