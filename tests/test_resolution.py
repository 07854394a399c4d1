"""Resolution before spending (resolution.py): the half-width a point will have, predicted from one pilot ablation,
matches the spread observed over many question sets where the truth is known; and through the main command, the
prediction is printed next to the budget, warned about when the budget is smaller, and --mmlu-per-subject auto sizes
the question set to it."""
from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cais_file
from tiny import run_cli, save_tiny

from prune_heads.data.tasks import Question
from prune_heads.eval.results import EvalResult, answer_kl, paired_delta
from prune_heads.search.budget import Budget
from prune_heads.search.resolution import Resolution, per_subject_for, predict

PILOT, PLANNED, DRAWS = 400, 1000, 800


def _result(correct: torch.Tensor) -> EvalResult:
    """Answers right where ``correct`` (choice 0 is gold), else choice 1."""
    loglik = torch.full((len(correct), 4), -4.0, dtype=torch.float64)
    loglik[:, 0] = torch.where(correct, -0.1, -3.0)
    loglik[:, 1] = torch.where(correct, -3.0, -0.1)
    return EvalResult([Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(len(correct))], loglik)


def _pair(n: int, g: torch.Generator, flip_down: float, flip_up: float) -> tuple[EvalResult, EvalResult]:
    base = torch.rand(n, generator=g) < 0.6
    u = torch.rand(n, generator=g)
    ablated = torch.where(base, u >= flip_down, u < flip_up)
    return _result(ablated), _result(base)


@pytest.mark.parametrize("flip_down,flip_up", [(0.10, 0.08), (0.20, 0.15)])
def test_predicted_accuracy_half_width_matches_the_observed_spread(flip_down, flip_up):
    g = torch.Generator().manual_seed(0)
    ablated, base = _pair(PILOT, g, flip_down, flip_up)
    predicted = predict(Budget(1.0), ablated, base, PLANNED, "pilot").half_width()
    deltas = torch.tensor([paired_delta(*_pair(PLANNED, g, flip_down, flip_up)).delta for _ in range(DRAWS)])
    observed = 1.96 * float(deltas.std())
    assert abs(predicted - observed) <= 0.2 * observed, (predicted, observed)


def _kl_pair(n: int, g: torch.Generator, scale: float) -> tuple[EvalResult, EvalResult]:
    """Baseline answers uniform-ish, the ablation shifts the gold logit by a per-question amount ~ scale x Exp(1)."""
    questions = [Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(n)]
    base = torch.randn(n, 4, generator=g, dtype=torch.float64)
    shift = torch.zeros(n, 4, dtype=torch.float64)
    shift[:, 0] = scale * torch.empty(n, dtype=torch.float64).exponential_(generator=g)
    return EvalResult(questions, base + shift), EvalResult(questions, base)


def test_predicted_kl_half_width_at_the_budgets_edge_matches_the_observed_spread():
    """The pilot is a much smaller ablation than a point at the edge: KL's spread scales with its mean."""
    g = torch.Generator().manual_seed(1)
    pilot = _kl_pair(PILOT, g, 0.1)
    edge_scale = 0.5
    edge_mean = float(answer_kl(*_kl_pair(20000, g, edge_scale)).mean())
    budget = Budget.parse(f"{edge_mean}nat")
    predicted = predict(budget, *pilot, PLANNED, "pilot").half_width()
    means = torch.tensor([float(answer_kl(*_kl_pair(PLANNED, g, edge_scale)).mean()) for _ in range(DRAWS)])
    observed = 1.96 * float(means.std())
    assert abs(predicted - observed) <= 0.2 * observed, (predicted, observed)


def test_accuracy_edge_never_below_what_a_delta_of_the_budget_needs():
    """A pilot that changed nothing still predicts the least spread a point at the edge must have."""
    base = _result(torch.rand(500, generator=torch.Generator().manual_seed(2)) < 0.5)
    r = predict(Budget(1.0), base, base, 114, "pilot")
    assert r.edge_sd == pytest.approx(100 * math.sqrt(0.01 * 0.99))
    assert r.half_width() == pytest.approx(1.96 * 100 * math.sqrt(0.0099 / 114))
    assert not r.resolves and r.questions_for(1.0) == math.ceil(1.96 ** 2 * 0.0099 / 0.0001)


def test_questions_for_and_per_subject_sizing():
    r = Resolution(Budget(1.0), edge_sd=30.0, questions=100, pilot="p")
    need = r.questions_for(1.0)
    assert need == math.ceil((1.96 * 30) ** 2) and r.half_width(need) <= 1.0 < r.half_width(need - 1)
    assert per_subject_for(r, 19, None) == (math.ceil(need / 19), False)
    assert per_subject_for(r, 19, 40) == (40, True)


# -- through the main command ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("resolution"), "llama")


def _run(model_dir, tmp_path, capsys, *extra, code=0):
    out = tmp_path / "run"
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=40)  # 35 questions per subject after 5 exemplars
    got, _, err = run_cli(["--model", model_dir, "--mmlu", mmlu, "--out", out, "--calibration-size", "4",
                           "--dtype", "float32", "--no-progress", "--no-export", *extra], capsys)
    assert got == code, err
    return (json.loads((out / "report.json").read_text()) if code == 0 else None), err


def test_the_prediction_is_printed_next_to_the_budget_and_warned_about(model_dir, tmp_path, capsys):
    report, err = _run(model_dir, tmp_path, capsys, "--mmlu-per-subject", "3", "--budget", "1%")
    r = report["resolution"]
    assert r["questions"] == 6 and r["unit"] == "points" and r["resolves_budget"] is False
    assert r["predicted_half_width"] >= 1.96 * 100 * math.sqrt(0.0099 / 6) - 1e-6
    assert r["full_task_questions"] == 70 and r["full_task_half_width"] < r["predicted_half_width"]
    assert "resolution: 6 questions resolve" in err and "WARNING: the budget (1 pt) is smaller" in err
    assert any("cannot be told" in w for w in report["warnings"])


def test_auto_sizes_the_questions_to_the_budget_and_keeps_half_to_confirm(model_dir, tmp_path, capsys):
    report, err = _run(model_dir, tmp_path, capsys, "--mmlu-per-subject", "auto", "--budget", "50%",
                       "--metric", "accuracy")
    r = report["resolution"]
    per_subject = report["settings"]["mmlu_per_subject"]
    assert "--mmlu-per-subject auto:" in err
    need = math.ceil(r["questions_to_resolve_budget"] / 2)
    assert per_subject == min(need, 35 // 2) and r["questions"] == 2 * per_subject == report["task"]["questions"]
    assert report["confirmation"]["questions"] == 2 * min(per_subject, 35 - per_subject)


@pytest.mark.parametrize("args,message", [
    (["--mmlu-per-subject", "most"], "give a positive integer, 'all' or 'auto'"),
    (["--mmlu-per-subject", "auto", "--metric", "kl-text", "--budget", "0.1nat"], "measured on held-out text"),
    (["--mmlu-per-subject", "auto", "--task", "arc_easy"], "takes --task-limit N"),
])
def test_auto_refuses_what_it_cannot_size(model_dir, tmp_path, capsys, args, message):
    _, err = _run(model_dir, tmp_path, capsys, *args, code=2)
    assert message in err


def test_auto_is_the_main_commands_alone(model_dir, tmp_path, capsys):
    got, _, err = run_cli(["eval", "--model", model_dir, "--out", tmp_path / "e", "--mmlu-per-subject", "auto"],
                          capsys)
    assert got == 2 and "sizes the main command's budget search" in err
