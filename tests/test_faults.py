"""Faults a real user meets: a full disk, a resume of another run, a layer emptied of heads, figures that must be
right. Each failure is one ``error:`` line (exit 2), no traceback, every file that existed before byte-identical,
and nothing this run wrote left behind but its finished work (the cache), so a rerun resumes."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest
from helpers import cais_file, fill, free_up, snapshot
from tiny import run_cli, save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("faults") / "model", "llama")


@pytest.fixture
def mmlu(tmp_path):
    return cais_file(tmp_path, n_subjects=2, per_subject=9)


def one_error_line(code, err, expect):
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("WARNING")]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert expect in errors[0], errors[0]
    return errors[0]


def _only_the_cache_left(out):
    partial = out.parent / f".{out.name}.partial"
    assert not out.exists()
    if partial.exists():
        assert {p.name for p in partial.iterdir()} <= {"cache", ".prune-heads"}, list(partial.iterdir())
    return partial


def _main_args(model_dir, mmlu, out, *extra):
    return ["--model", model_dir, "--mmlu", mmlu, "--mmlu-per-subject", "all", "--calibration-size", "4",
            "--budget", "0.05nat", "--dtype", "float32", "--no-progress", "--no-speed", "--out", out, *extra]


def _fill_once_checked(monkeypatch, disk, leave):
    """The disk fills right after the export's up-front space check passed: the shards meet a full disk."""
    import exporters.export as export

    real = export.check_space

    def check_then_fill(directory, needed, what):
        real(directory, needed, what)
        fill(disk, leave)

    monkeypatch.setattr(export, "check_space", check_then_fill)


@pytest.mark.parametrize("fmt, leave", [("safetensors", 300_000), ("gguf", 100_000), ("safetensors", 800_000)])
def test_disk_full_during_the_export_leaves_only_the_cache_and_the_rerun_resumes(
        model_dir, mmlu, small_disk, monkeypatch, capsys, fmt, leave):
    out = small_disk / "pruned"
    (small_disk / "keep.txt").write_text("the user's file")
    before = snapshot(model_dir)
    _fill_once_checked(monkeypatch, small_disk, leave)
    code, _, err = run_cli(_main_args(model_dir, mmlu, out, "--format", fmt), capsys)
    line = one_error_line(code, err, "filled up while writing the ")
    assert "it needs about" in line and "are free now" in line and "rerun the same command" in line
    partial = _only_the_cache_left(out)
    assert any((partial / "cache").glob("*.safetensors"))  # the search's finished work stays
    assert snapshot(model_dir) == before and (small_disk / "keep.txt").read_text() == "the user's file"
    monkeypatch.undo()
    free_up(small_disk)
    code, _, err = run_cli(_main_args(model_dir, mmlu, out, "--format", fmt), capsys)
    assert code == 0 and "resuming" in err, err
    report = json.loads((out / "report.json").read_text())
    assert report["cache"]["computed"] <= 1  # at most the exported model's own task run
    assert not partial.exists()


def test_disk_full_while_the_cache_is_written_says_where(model_dir, mmlu, small_disk, capsys):
    out = small_disk / "pruned"
    fill(small_disk, 12_000)
    code, _, err = run_cli(_main_args(model_dir, mmlu, out), capsys)
    one_error_line(code, err, f"the disk holding {small_disk}")
    _only_the_cache_left(out)
    free_up(small_disk)
    code, _, err = run_cli(_main_args(model_dir, mmlu, out), capsys)
    assert code == 0, err


def test_the_up_front_estimate_is_what_is_written_and_admits_a_disk_that_suffices(model_dir, mmlu, small_disk,
                                                                                   tmp_path, capsys):
    import torch
    from tiny import tiny_model

    from exporters.export import export_bytes
    from prune_heads.heads import HeadSet
    from prune_heads.io.diskspace import with_margin
    from prune_heads.plan.planner import planner_for

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3], "2": [1, 2, 4, 5]}))
    args = ["export", "--model", model_dir, "--heads", heads, "--no-task-eval", "--dtype", "float32",
            "--no-progress", "--no-speed"]
    lm = tiny_model("llama")
    choice = planner_for(lm).choose(HeadSet.load(heads), "auto")
    needed = export_bytes(lm, choice, ("safetensors",), "f16", prompts=4 * 96)
    fill(small_disk, with_margin(needed) - 4096)  # just short of estimate + margin: refused before writing
    code, _, err = run_cli([*args, "--out", small_disk / "a"], capsys)
    one_error_line(code, err, "not enough disk space")
    assert not (small_disk / "a").exists() and not (small_disk / ".a.partial").exists()
    free_up(small_disk)
    fill(small_disk, with_margin(needed) + 64 * 1024)  # just enough: written and verified
    code, _, err = run_cli([*args, "--out", small_disk / "b"], capsys)
    assert code == 0, err
    weights = sum(p.stat().st_size for p in (small_disk / "b").glob("*.safetensors"))
    logits = 4 * 96 * lm.config.vocab_size * 4
    assert abs(weights + logits - needed) / needed < 0.02  # the estimate is the bytes written, not a bound
    assert torch.float32 == lm.dtype


# -- a run resumes only its own work -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("faults-other") / "qwen2", "qwen2")


def _export_args(model, heads, out, *extra):
    return ["export", "--model", model, "--heads", heads, "--no-task-eval", "--dtype", "float32", "--no-progress",
            "--no-speed", "--out", out, *extra]


def _family(out):
    """The exported family (a per-layer export's model type is pruned_<family>)."""
    return json.loads((out / "config.json").read_text())["model_type"].removeprefix("pruned_")


@pytest.mark.slow
def test_resume_refuses_the_finished_export_of_another_model(model_dir, other_model, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3]}))
    out = tmp_path / "pruned"
    code, _, err = run_cli(_export_args(model_dir, heads, out), capsys)
    assert code == 0, err
    before = snapshot(out)
    code, _, err = run_cli(_export_args(other_model, heads, out, "--resume"), capsys)
    line = one_error_line(code, err, "holds the results of another run (model ")
    assert str(model_dir) in line and "--force" in line
    assert snapshot(out) == before and _family(out) != "qwen2"
    other_heads = tmp_path / "other.json"  # the same model with other heads is another run too
    other_heads.write_text(json.dumps({"1": [1]}))
    code, _, err = run_cli(_export_args(model_dir, other_heads, out, "--resume"), capsys)
    one_error_line(code, err, "other settings: heads")
    assert snapshot(out) == before
    code, _, err = run_cli(_export_args(model_dir, heads, out, "--resume"), capsys)  # its own run: continues
    assert code == 0, err
    code, _, err = run_cli(_export_args(other_model, heads, out, "--force"), capsys)  # --force replaces
    assert code == 0 and _family(out) == "qwen2", err


@pytest.mark.slow
def test_unfinished_work_of_another_model_is_not_resumed(model_dir, other_model, mmlu, tmp_path, capsys):
    out = tmp_path / "pruned"
    partial = tmp_path / ".pruned.partial"
    code, _, err = run_cli(_main_args(model_dir, mmlu, out, "--no-export"), capsys)
    assert code == 0
    out.rename(partial)  # as an interrupted run leaves it: the cache and the marker under the hidden name
    for f in partial.iterdir():
        if f.name not in ("cache", ".prune-heads"):
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    before, old_entries = snapshot(partial), {p.name for p in (partial / "cache").iterdir()}
    code, _, err = run_cli(_main_args(other_model, mmlu, out), capsys)
    one_error_line(code, err, "holds the unfinished work of another run (model ")
    assert snapshot(partial) == before and not out.exists()
    code, _, err = run_cli(_main_args(other_model, mmlu, out, "--force"), capsys)  # discarded, then run afresh
    assert code == 0 and "resuming" not in err, err
    assert not old_entries & {p.name for p in (out / "cache").iterdir()}  # nothing of the other model's work kept


# -- every head set the README allows exports ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text", "phi3"])
def test_a_layer_left_with_no_heads_exports_in_every_family(family, mmlu, tmp_path, capsys):
    """Layer 0 emptied (the layer transformers reads the cache length from) and layer 2 thinned: the export is
    timed, reloaded, checked on logits, evaluated on the task, carded; where the layout ships the empty layer,
    greedy generation with a KV cache equals the ablated original's."""
    import torch
    from tiny import tiny_model
    from transformers import AutoModelForCausalLM

    from prune_heads.heads import HeadSet
    from prune_heads.plan.ablation import ablate
    from prune_heads.plan.planner import planner_for

    model = save_tiny(tmp_path / "m", family)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": list(range(6)), "2": [1, 4]}))
    out = tmp_path / "pruned"
    fmt = "both" if family in ("llama", "qwen2") else "safetensors"
    code, _, err = run_cli(["export", "--model", model, "--heads", heads, "--mmlu", mmlu, "--dtype", "float32",
                            "--no-progress", "--format", fmt, "--out", out], capsys)
    assert code == 0, err
    meta = json.loads((out / "prune_heads.json").read_text())
    assert meta["verified"] and meta["task_eval"]["n"] > 0 and "prefill_speedup" in meta["speed"]
    assert meta["verification"]["max_abs_logit_diff"] <= meta["verification"]["tolerance"]
    if fmt == "both":
        g = meta["gguf"]  # llama.cpp needs heads in layer 0: one silent (zero) head stands in there
        assert g["verified_in_llama_cpp"] and g["head_counts"][0] == int(g["zero_head_in_layer_0"]) == 1
    lm = tiny_model(family)
    plan = planner_for(lm).choose(HeadSet.load(heads), meta["layout"]).plan
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 45, 99, 120, 7, 250, 33]])
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with ablate(lm, plan):
        expected = lm.model.generate(ids, use_cache=False, **kw)
    assert torch.equal(shipped.generate(ids, use_cache=True, **kw), expected)


# -- figures that are right, from one source ----------------------------------------------------------------------------


def _independent_count(directory, tied: bool) -> int:
    """Parameters in the written safetensors, read with safetensors itself (a tied LM head stored too: once)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    if tied:
        shapes.pop("lm_head.weight", None)
    return sum(math.prod(shape) for shape in shapes.values())


@pytest.mark.parametrize("family, layout, tied", [("llama", "per-layer", True), ("qwen2", "uniform", False),
                                                   ("llama", "masked", True), ("qwen2", "per-layer", False)])
def test_card_manifest_and_report_count_parameters_as_the_files_hold_them(family, layout, tied, mmlu, tmp_path,
                                                                           capsys):
    model = save_tiny(tmp_path / "m", family)
    assert json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False) == tied
    out = tmp_path / "pruned"
    code, _, err = run_cli(_main_args(model, mmlu, out, "--layout", layout), capsys)
    assert code == 0, err
    meta = json.loads((out / "prune_heads.json").read_text())
    report = json.loads((out / "report.json").read_text())
    stats = meta["stats"]
    assert stats == report["export"]["stats"]
    assert stats["after"]["parameters"] == _independent_count(out, tied)
    assert stats["before"]["parameters"] == _independent_count(model, tied)
    assert stats["tied_embeddings"] == tied
    card = (out / "README.md").read_text()
    assert f"| {stats['before']['parameters']:,} | {stats['after']['parameters']:,} |" in card
    assert ("counted once" in card) == tied
    title = card.split("\n# ", 1)[1].splitlines()[0]
    if layout == "masked":
        assert "padded to the original shape: no parameters removed" in title
        assert stats["after"]["parameters"] == stats["before"]["parameters"]
    else:
        removed = stats["before"]["parameters"] - stats["after"]["parameters"]
        assert f"{stats['removed']['query_heads']} query heads and {removed:,} parameters removed" in title
    assert "ranked by `ahon_ln`" in card and "None" not in card


# -- inputs that do not belong together ---------------------------------------------------------------------------------


def test_a_tokenizer_beyond_the_embedding_is_one_line_before_any_pass(mmlu, tmp_path, capsys):
    from tiny import tiny_model

    lm = tiny_model("llama", vocab_size=200)  # the tokenizer has 384 tokens
    model = tmp_path / "m"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    code, _, err = run_cli(["eval", "--model", model, "--mmlu", mmlu, "--out", tmp_path / "o", "--no-progress"],
                           capsys)
    one_error_line(code, err, "but the model's embedding has 200 rows")
    assert "384 tokens" in err and not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_a_missing_tokenizer_and_a_contradicted_vocab_size_are_named(model_dir, mmlu, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for f in bare.iterdir():
        if "token" in f.name:
            f.unlink()
    code, _, err = run_cli(["eval", "--model", bare, "--mmlu", mmlu, "--out", tmp_path / "o"], capsys)
    one_error_line(code, err, "has no tokenizer files")
    huge = tmp_path / "huge"
    shutil.copytree(model_dir, huge)
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "vocab_size": 10**12}))
    code, _, err = run_cli(["eval", "--model", huge, "--mmlu", mmlu, "--out", tmp_path / "o"], capsys)
    line = one_error_line(code, err, "vocab_size = 1,000,000,000,000, but the embedding weights are 384 x 96")
    assert "above" not in line


def test_an_adapter_of_another_base_is_refused_and_adapt_names_its_output(model_dir, tmp_path, capsys):
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from tiny import tiny_model

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3], "1": list(range(6))}))
    pruned = tmp_path / "pruned"
    assert run_cli(_export_args(model_dir, heads, pruned), capsys)[0] == 0

    def adapter(lm, name):
        torch.manual_seed(0)
        peft = get_peft_model(copy.deepcopy(lm.model), LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
        peft.save_pretrained(tmp_path / name)
        return tmp_path / name

    other = adapter(tiny_model("llama", hidden_size=72), "other")
    before = snapshot(tmp_path)
    code, _, err = run_cli(["adapt", other, "--pruned", pruned, "--out", tmp_path / "sliced"], capsys)
    one_error_line(code, err, "does not fit the pruned model's source")
    assert "trained on another base" in err and snapshot(tmp_path) == before
    deeper = adapter(tiny_model("llama", num_hidden_layers=6), "deeper")
    code, _, err = run_cli(["adapt", deeper, "--pruned", pruned, "--out", tmp_path / "sliced"], capsys)
    one_error_line(code, err, "has layer ")
    own = adapter(tiny_model("llama"), "own")  # its own base, with layer 1 emptied: sliced and loadable
    code, _, err = run_cli(["adapt", own, "--pruned", pruned, "--out", tmp_path / "sliced"], capsys)
    assert code == 0 and f"written to {tmp_path / 'sliced'} " in err and ".partial" not in err, err
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pruned)
    PeftModel.from_pretrained(base, tmp_path / "sliced")


def test_a_symlinked_out_is_written_through_and_the_link_kept(model_dir, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3]}))
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    code, _, err = run_cli(_export_args(model_dir, heads, link), capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "prune_heads.json").is_file() and not (tmp_path / ".link.partial").exists()
    code, _, err = run_cli(_export_args(model_dir, heads, link, "--force"), capsys)  # replaced through the link
    assert code == 0 and link.is_symlink() and (link / "prune_heads.json").is_file(), err


def test_heads_listed_twice_or_none_are_said(model_dir, mmlu, tmp_path, capsys):
    twice = tmp_path / "twice.json"
    twice.write_text('{"0": [1, 1, 3], "2": [0]}')
    code, _, err = run_cli(["eval", "--model", model_dir, "--mmlu", mmlu, "--ablate", twice, "--out", tmp_path / "a",
                            "--no-progress"], capsys)
    assert code == 0 and "lists layer 0 head 1 more than once; each head is ablated once" in err, err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    code, _, err = run_cli(_export_args(model_dir, empty, tmp_path / "b"), capsys)
    assert code == 0 and "names no heads: nothing is removed" in err, err


def test_an_empty_kl_text_is_named_as_such(model_dir, mmlu, tmp_path, capsys):
    empty = tmp_path / "held-out.txt"
    empty.write_text("\n\n")
    code, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--kl-text", empty, "--budget", "0.05nat", "--metric", "kl-text",
                            "--out", tmp_path / "o"], capsys)
    line = one_error_line(code, err, f"held-out text file {empty} is empty")
    assert "calibration" not in line


def test_ctrl_c_while_the_command_starts_prints_no_traceback(tmp_path):
    import signal
    import sys
    import time

    for delay in (0.2, 0.5, 1.0):
        proc = subprocess.Popen([sys.executable, "-m", "prune_heads_cli", "--model", "smollm2-135m", "--out",
                                 tmp_path / f"o{delay}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "Traceback" not in err, err
        assert not (tmp_path / f"o{delay}").exists()


@pytest.mark.slow
def test_no_export_reports_what_each_point_would_ship(model_dir, mmlu, tmp_path, capsys):
    code, _, err = run_cli(_main_args(model_dir, mmlu, tmp_path / "a", "--no-export"), capsys)
    assert code == 0 and "ships -0" not in err and "efficiency 0.00" not in err, err
    code, _, _ = run_cli(_main_args(model_dir, mmlu, tmp_path / "b"), capsys)
    assert code == 0
    without, exported = (json.loads((tmp_path / d / "report.json").read_text()) for d in "ab")
    assert [p.get("shipped") for p in without["search_points"]] == [p.get("shipped") for p in exported["search_points"]]
    assert max(p["shipped"]["attention_params_removed"] for p in without["search_points"] if p.get("shipped")) > 0
