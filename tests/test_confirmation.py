"""Confirmation on questions the search never saw (confirmation.py), through the main command on a tiny model."""
from __future__ import annotations

import json

import pytest
from helpers import cais_file
from tiny import run_cli, save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("confirm"), "llama")


def _run(model_dir, tmp_path, capsys, *extra, code=0):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=14)  # 9 questions per subject after 5 exemplars
    got, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", out, "--calibration-size", "4",
                           "--dtype", "float32", "--no-progress", "--no-speed", *extra], capsys)
    assert got == code, err
    return (json.loads((out / "report.json").read_text()) if code == 0 else None), err


def test_the_chosen_point_is_confirmed_on_further_questions_of_the_same_subjects(model_dir, tmp_path, capsys):
    report, err = _run(model_dir, tmp_path, capsys, "--mmlu-per-subject", "3", "--budget", "100%")
    c = report["confirmation"]
    assert c["confirmed"] is True and c["questions"] == 6 and c["subjects"] == 2
    assert "further questions of the same subjects" in c["source"] and c["num_heads"] == report["final"]["num_heads_removed"]
    searched = {(r["subject"], r["index"]) for r in map(json.loads, (tmp_path / "run" / "mmlu.jsonl").read_text().splitlines())} \
        if (tmp_path / "run" / "mmlu.jsonl").is_file() else set()
    confirmed_on = {tuple(x) for x in c["question_ids"]}
    assert len(confirmed_on) == 6 and not searched & confirmed_on
    assert all(index >= 5 + 3 for _, index in confirmed_on)  # past the 5 exemplars and the 3 searched per subject
    assert "confirmation of" in err


def test_a_failing_confirmation_steps_back_along_the_curve(model_dir, tmp_path, capsys, monkeypatch):
    import prune_heads.search.confirmation as confirmation

    real = confirmation.judge
    calls = []

    def strict_for_the_first(budget, result, baseline):
        delta, kl, agree, ok = real(budget, result, baseline)
        calls.append(1)
        return delta, kl, agree, ok and len(calls) > 1  # the chosen point fails, the next one passes

    monkeypatch.setattr(confirmation, "judge", strict_for_the_first)
    report, err = _run(model_dir, tmp_path, capsys, "--mmlu-per-subject", "3", "--budget", "100%", "--no-export")
    c = report["confirmation"]
    assert [p["within_budget"] for p in c["tried"]] == [False, True] and c["confirmed"]
    assert c["tried"][1]["num_heads"] <= c["tried"][0]["num_heads"]
    assert report["final"]["num_heads_removed"] == c["tried"][1]["num_heads"]
    chosen = [p for p in report["search_points"] if p["chosen"]]
    assert len(chosen) == 1 and chosen[0]["num_heads"] == c["num_heads"]


def test_nothing_confirms_and_nothing_is_removed(model_dir, tmp_path, capsys, monkeypatch):
    import prune_heads.search.confirmation as confirmation

    real = confirmation.judge
    monkeypatch.setattr(confirmation, "judge", lambda *a: (*real(*a)[:3], False))
    report, err = _run(model_dir, tmp_path, capsys, "--mmlu-per-subject", "3", "--budget", "100%")
    assert report["confirmation"]["confirmed"] is False and report["final"]["num_heads_removed"] == 0
    assert "nothing confirms" in err
    meta = json.loads((tmp_path / "run" / "prune_heads.json").read_text())
    assert meta["heads_removed"] == 0 and meta["confirmation"]["confirmed"] is False


def test_every_question_searched_splits_only_when_asked(model_dir, tmp_path, capsys):
    report, _ = _run(model_dir, tmp_path / "a", capsys, "--mmlu-per-subject", "all", "--budget", "100%",
                     "--no-export")
    assert report["confirmation"]["confirmed"] is None and "--confirm-fraction" in report["confirmation"]["reason"]
    assert report["task"]["questions"] == 18
    report, _ = _run(model_dir, tmp_path / "b", capsys, "--mmlu-per-subject", "all", "--budget", "100%",
                     "--no-export", "--confirm-fraction", "0.5")
    assert report["task"]["questions"] == 8 and report["confirmation"]["questions"] == 10  # ceil(4.5) = 5 per subject
    assert report["confirmation"]["confirmed"] is True


def test_no_confirm_and_bad_fraction(model_dir, tmp_path, capsys):
    report, _ = _run(model_dir, tmp_path / "a", capsys, "--mmlu-per-subject", "3", "--no-confirm", "--no-export")
    assert report["confirmation"] == {"confirmed": None, "reason": "not confirmed: --no-confirm"}
    _, err = _run(model_dir, tmp_path / "b", capsys, "--confirm-fraction", "1.5", code=2)
    assert "--confirm-fraction" in err and len(err.strip().splitlines()) == 1
