"""Interrupted runs resume without repeating finished work; hostile or broken inputs lose nothing."""
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import cais_file
from tiny import tiny_model

from prune_heads.errors import UserError
from prune_heads.io.staging import StagedDirectory
from prune_heads_cli.main import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    model = d / "model"
    lm = tiny_model("qwen2")
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    mmlu = cais_file(d, n_subjects=3, per_subject=11)
    return model, mmlu


def args(setup, out, *extra):
    model, mmlu = setup
    return ["--model", str(model), "--mmlu", str(mmlu), "--out", str(out), "--mmlu-per-subject", "all", "--dtype", "float32",
            "--calibration-size", "6", "--budget", "5pt", "--no-progress", *extra]


def cli(argv, env_extra=None, **kw):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "prune_heads_cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


def finished(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def entries(partial, kind=""):
    return sorted((partial / "cache").glob(f"{kind}*.safetensors")) if (partial / "cache").is_dir() else []


def wait_for(predicate, timeout=120):
    t = time.time()
    while time.time() - t < timeout:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    code, _, err = finished(cli(args(setup, out)))
    assert code == 0, err
    return json.loads((out / "report.json").read_text())


def _same_result(report, reference):
    assert report["heads"] == reference["heads"]
    assert [(p["num_heads"], p["accuracy"]) for p in report["search_points"]] == [(p["num_heads"], p["accuracy"]) for p in reference["search_points"]]
    assert report["scores"] == reference["scores"]
    assert report["export"]["task_eval"] == reference["export"]["task_eval"]


@pytest.mark.slow
def test_sigkill_during_evaluation_then_resume(setup, reference, tmp_path):
    out = tmp_path / "run"
    partial = tmp_path / ".run.partial"
    proc = cli(args(setup, out), {"PRUNE_HEADS_TEST_PAUSE_AFTER_CACHE_WRITE": "0.3"})
    assert wait_for(lambda: len(entries(partial, "eval")) >= 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # nothing under the final name
    done_before = len(entries(partial))
    code, _, err = finished(cli(args(setup, out)))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    _same_result(report, reference)
    total = reference["cache"]["computed"]
    # Every entry finished before the kill loads once more, beside the reuse a run makes of its own entries (the search
    # reads back the pilot evaluation, resolution.py).
    assert report["cache"]["loaded"] == done_before + reference["cache"]["loaded"]
    assert report["cache"]["computed"] == total - done_before  # no finished evaluation repeated
    assert "resuming" in err and not partial.exists()


@pytest.mark.slow
def test_sigkill_during_export_then_resume_repeats_nothing(setup, reference, tmp_path):
    out = tmp_path / "run"
    partial = tmp_path / ".run.partial"
    proc = cli(args(setup, out), {"PRUNE_HEADS_TEST_PAUSE_AFTER_CACHE_WRITE": "0.5"})
    assert wait_for(lambda: (partial / "model.safetensors").exists() and (partial / "config.json").exists())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and not (partial / "prune_heads.json").exists()
    code, _, err = finished(cli(args(setup, out)))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    _same_result(report, reference)
    assert report["cache"]["computed"] <= 1 and report["cache"]["loaded"] >= reference["cache"]["computed"] - 1
    assert json.loads((out / "prune_heads.json").read_text())["verified"]


@pytest.mark.slow
def test_corrupted_cache_entry_is_detected_and_recomputed(setup, reference, tmp_path):
    out = tmp_path / "run"
    code, _, err = finished(cli(args(setup, out)))
    assert code == 0, err
    victim = entries(out, "eval")[1]
    data = bytearray(victim.read_bytes())
    data[-8:] = b"\x00\xff" * 4  # flip the tail of the tensor data
    victim.write_bytes(bytes(data))
    code, _, err = finished(cli(args(setup, out, "--resume")))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["cache"]["corrupt"] == 1 and report["cache"]["computed"] == 1
    assert "corrupt" in err
    _same_result(report, reference)


@pytest.mark.slow
def test_a_changed_setting_recomputes_only_what_it_affects(setup, reference, tmp_path):
    out = tmp_path / "run"
    code, _, err = finished(cli(args(setup, out)))
    assert code == 0, err
    first = json.loads((out / "report.json").read_text())
    a = args(setup, out, "--resume")
    a[a.index("--budget") + 1] = "0.5pt"  # a tighter budget: new search points, same scores and baseline
    code, _, err = finished(cli(a))  # --resume continues only the same run: refused, nothing touched
    assert code == 2 and "holds the results of another run (other settings: budget '5pt' there, '0.5pt' now)" in err
    assert json.loads((out / "report.json").read_text()) == first
    a[a.index("--resume")] = "--force"  # replaced, reusing the cache of the same model
    code, _, err = finished(cli(a))
    assert code == 0, err
    second = json.loads((out / "report.json").read_text())
    assert second["scores"] == first["scores"]
    old = {p["num_heads"] for p in first["search_points"]}
    new = {p["num_heads"] for p in second["search_points"]} - old
    # Computed now: only search points never evaluated before, plus the export's own MMLU run if the chosen set changed.
    exported = 0 if second["heads"] == first["heads"] else 1
    assert second["cache"]["computed"] == len(new) + exported
    assert second["cache"]["loaded"] >= 2  # at least the scores and the baseline came from the cache


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_says_how_to_resume(setup, tmp_path):
    out = tmp_path / "run"
    partial = tmp_path / ".run.partial"
    proc = cli(args(setup, out), {"PRUNE_HEADS_TEST_PAUSE_AFTER_CACHE_WRITE": "0.5"})
    assert wait_for(lambda: len(entries(partial, "eval")) >= 1)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finished(proc)
    assert code == 130
    assert "rerun the same command to resume" in err and "Traceback" not in err
    assert not out.exists() and entries(partial)


def test_full_disk_leaves_no_partial_export(setup, tmp_path, monkeypatch, capsys):
    import shutil

    from exporters.export import ExportOptions, export_pruned
    from prune_heads.heads import HeadSet

    lm = tiny_model("llama")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(UserError, match="not enough disk space"):
        export_pruned(lm, HeadSet.of({0: [1]}), tmp_path, ExportOptions(progress=False))
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(shutil, "disk_usage", real)

    import transformers.modeling_utils as mu

    def full(state_dict, filename, metadata=None):  # writes part of the shard, then the disk is full
        with open(filename, "wb") as f:
            f.write(b"\0" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mu, "safe_save_file", full)
    with pytest.raises(UserError, match="filled up while writing the .* export"):
        export_pruned(lm, HeadSet.of({0: [1]}), tmp_path, ExportOptions(progress=False))
    assert not list(tmp_path.iterdir())


def test_pickled_weights_are_refused_unless_allowed(tmp_path, capsys):
    lm = tiny_model("llama")
    d = tmp_path / "pickled"
    d.mkdir()
    lm.model.config.save_pretrained(d)
    torch.save(lm.model.state_dict(), d / "pytorch_model.bin")  # what a stranger's old checkpoint looks like
    lm.tokenizer.save_pretrained(d)
    assert (d / "pytorch_model.bin").exists() and not list(d.glob("*.safetensors"))
    with pytest.raises(SystemExit) as e:
        main(["score", "--model", str(d), "--out", str(tmp_path / "o"), "--calibration-size", "2", "--no-progress",
              "--mmlu", str(cais_file(tmp_path))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--allow-pickle" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main(["score", "--model", str(d), "--out", str(tmp_path / "o"), "--calibration-size", "2", "--no-progress",
              "--mmlu", str(cais_file(tmp_path)), "--allow-pickle"])
    assert e.value.code == 0 and (tmp_path / "o" / "scores.json").is_file()


def test_two_runs_cannot_share_an_output(tmp_path):
    first = StagedDirectory(tmp_path / "out", force=False)
    with pytest.raises(UserError, match="another prune-heads run"):
        StagedDirectory(tmp_path / "out", force=False)
    first.commit()
    assert (tmp_path / "out").is_dir() and not (tmp_path / ".out.partial").exists()
