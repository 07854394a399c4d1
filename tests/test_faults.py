"""Faults a real user meets: a full disk, a resume of another run, a layer emptied of heads, figures that must be
right. Each failure is one ``error:`` line (exit 2), no traceback, every file that existed before byte-identical,
and nothing this run wrote left behind but its finished work (the cache), so a rerun resumes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest
from test_mmlu import _cais_file
from tiny import run_cli, save_tiny

MiB = 1 << 20


def _snapshot(directory):
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("faults") / "model", "llama")


@pytest.fixture
def mmlu(tmp_path):
    return _cais_file(tmp_path, n_subjects=2, per_subject=9)


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 40 MiB (tmpfs): writes past it fail with ENOSPC as on a full disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must be able to mount a tmpfs for the full-disk tests")
        pytest.skip("mounting a tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free (a file beside the run's, removed by ``free_up``)."""
    with open(disk / "filler", "ab") as f:
        missing = shutil.disk_usage(disk).free - leave
        while missing > 0:
            f.write(b"\0" * min(missing, 4 * MiB))
            missing = shutil.disk_usage(disk).free - leave


def free_up(disk) -> None:
    (disk / "filler").unlink()


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
            "--budget", "0.05nat", "--dtype", "float32", "--no-progress", "--out", out, *extra]


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
    before = _snapshot(model_dir)
    _fill_once_checked(monkeypatch, small_disk, leave)
    code, _, err = run_cli(_main_args(model_dir, mmlu, out, "--format", fmt), capsys)
    line = one_error_line(code, err, "filled up while writing the ")
    assert "it needs about" in line and "are free now" in line and "rerun the same command" in line
    partial = _only_the_cache_left(out)
    assert any((partial / "cache").glob("*.safetensors"))  # the search's finished work stays
    assert _snapshot(model_dir) == before and (small_disk / "keep.txt").read_text() == "the user's file"
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
    from prune_heads.diskspace import with_margin
    from prune_heads.heads import HeadSet
    from prune_heads.planning import planner_for

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [0, 3], "2": [1, 2, 4, 5]}))
    args = ["export", "--model", model_dir, "--heads", heads, "--no-task-eval", "--dtype", "float32",
            "--no-progress"]
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
