"""Regression tests for data loss and unverified weights: nothing the user had is lost, an input is never an output,
and a checkpoint that does not hold every weight is refused instead of filled at random."""
from __future__ import annotations

import json

import pytest
from helpers import snapshot
from safetensors.torch import load_file, save_file
from tiny import run_cli, save_tiny


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny(tmp_path / "model", "llama")


@pytest.fixture
def heads(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"0": [0, 1]}))
    return path


def _export(model, heads, out, *extra):
    return ["export", "--model", model, "--heads", heads, "--out", out, "--no-mmlu", "--no-progress", *extra]


def test_resume_on_a_directory_the_user_filled_deletes_nothing(tmp_path, model_dir, heads, capsys):
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "notes" / "a.txt").write_text("more")
    before = snapshot(mine)
    code, _, err = run_cli(_export(model_dir, heads, mine, "--resume"), capsys)
    assert code == 2 and "was not written by prune-heads, so there is nothing to resume" in err
    assert snapshot(mine) == before and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_resume_continues_a_finished_run_of_ours(tmp_path, model_dir, heads, capsys):
    out = tmp_path / "out"
    assert run_cli(_export(model_dir, heads, out), capsys)[0] == 0
    code, _, err = run_cli(_export(model_dir, heads, out, "--resume"), capsys)
    assert code == 0, err
    assert (out / "prune_heads.json").is_file()


@pytest.mark.parametrize("where", ["model", "parent", "inside"])
def test_out_equal_to_containing_or_inside_the_model_is_refused_even_with_force(tmp_path, model_dir, heads, where,
                                                                                capsys):
    out = {"model": model_dir, "parent": tmp_path, "inside": model_dir / "pruned"}[where]
    before = snapshot(tmp_path)
    code, _, err = run_cli(_export(model_dir, heads, out, "--force"), capsys)
    assert code == 2 and "writing there would destroy it (even with --force)" in err
    assert snapshot(tmp_path) == before


def test_out_equal_to_an_input_file_directory_is_refused(tmp_path, model_dir, heads, capsys):
    calib = tmp_path / "data"
    calib.mkdir()
    (calib / "calib.txt").write_text("some text to score on\nand another line\n")
    code, _, err = run_cli(["score", "--model", model_dir, "--calibration", calib / "calib.txt", "--out", calib,
                            "--force", "--no-progress"], capsys)
    assert code == 2 and "contains the input" in err and (calib / "calib.txt").is_file()


@pytest.mark.parametrize("damage", ["missing", "unexpected"])
def test_a_checkpoint_without_every_weight_is_refused_not_filled_at_random(tmp_path, heads, damage, capsys):
    model = save_tiny(tmp_path / "broken", "llama")
    state = load_file(model / "model.safetensors")
    if damage == "missing":
        del state["model.layers.1.self_attn.k_proj.weight"]
    else:
        state["model.layers.1.self_attn.extra.weight"] = state["model.norm.weight"].clone()
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, _, err = run_cli(_export(model, heads, out), capsys)
    assert code == 2 and f"{'is missing' if damage == 'missing' else 'has unexpected'} weights" in err
    assert "self_attn" in err and not out.exists() and "Traceback" not in err


def _as_a_user_would_see_permissions(monkeypatch):
    """The permission rule a non-root user meets (root, as CI runs, is exempt from it): a name in a directory without
    write permission cannot be removed."""
    import errno
    import os
    import stat

    for name in ("unlink", "rmdir"):
        real = getattr(os, name)

        def guarded(path, *args, _real=real, **kwargs):
            parent = os.path.dirname(os.path.join(str(kwargs.get("dir_fd") and "") or "", str(path)))
            if "dir_fd" in kwargs and kwargs["dir_fd"] is not None:
                mode = os.fstat(kwargs["dir_fd"]).st_mode
            else:
                mode = os.stat(parent or ".").st_mode
            if not mode & stat.S_IWUSR:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return _real(path, *args, **kwargs)
        monkeypatch.setattr(os, name, guarded)


def _previous_run(out, read_only: bool):
    from prune_heads.io.staging import MARKER

    (out / "cache" / "deep").mkdir(parents=True)
    for f in (out / "report.json", out / "cache" / "a.safetensors", out / "cache" / "deep" / "b.sqlite", out / MARKER):
        f.write_text("{}")
    if read_only:  # what `chmod -R a-w` leaves
        for p in sorted(out.rglob("*"), key=lambda p: -len(p.parts)):
            p.chmod(0o444 if p.is_file() else 0o555)


def test_force_replaces_a_read_only_out_and_says_what_it_could_not_remove(tmp_path, model_dir, heads, monkeypatch,
                                                                          small_disk, capsys):
    """--force over a previous --out whose files and directories are read-only replaces it entirely (no hidden
    .NAME.old-* left behind); a part that cannot be removed at all (here a file system mounted inside it) is named in
    one warning with the directory kept, never left without a word."""
    import subprocess

    from prune_heads.io.staging import StagedDirectory

    out = tmp_path / "out"
    _previous_run(out, read_only=True)
    with monkeypatch.context() as patch:
        _as_a_user_would_see_permissions(patch)
        with StagedDirectory(out, force=True) as staged:
            (staged.path / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "heads.json", "model", "out"]
    assert (out / "new.txt").read_text() == "new" and StagedDirectory.left_behind == []
    # A file system mounted inside the previous --out: the rest goes, that part stays, and the command says where.
    (out / "mnt").mkdir()
    subprocess.run(["mount", "--bind", str(small_disk), str(out / "mnt")], check=True)
    try:
        code, _, err = run_cli(_export(model_dir, heads, out, "--force"), capsys)
        assert code == 0 and (out / "prune_heads.json").is_file(), err
        left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
        assert len(left) == 1 and [p.name for p in left[0].iterdir()] == ["mnt"]
        assert f"it is kept as {left[0]}: remove it yourself" in err and "Device or resource busy" in err
    finally:
        subprocess.run(["umount", "-l", str(next(tmp_path.glob(".out.old-*/mnt"), out / "mnt"))], check=False)
