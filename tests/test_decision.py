"""Decision rules on synthetic per-question results, where the true effect is known: the paper's point rule accepts a
point whose true accuracy drop is exactly the budget about half the time; the confident rule (non-inferiority) no
more often than its nominal 2.5%; both accept a harmless point."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from prune_heads.data.tasks import Question
from prune_heads.evaluation import EvalResult
from prune_heads.search import Budget, judge

N, TRIALS = 400, 2000
QUESTIONS = [Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(N)]


def _result(correct: torch.Tensor) -> EvalResult:
    """Answers right where ``correct`` (choice 0 is gold), else choice 1; confident enough that the KL is small."""
    loglik = torch.full((len(correct), 4), -4.0, dtype=torch.float64)
    loglik[:, 0] = torch.where(correct, -0.1, -3.0)
    loglik[:, 1] = torch.where(correct, -3.0, -0.1)
    return EvalResult(QUESTIONS, loglik)


def _acceptance(rule: str, true_drop: float, budget_points: float = 1.0, seed: int = 0) -> float:
    """Share of trials in which a point whose true paired accuracy drop is ``true_drop`` points is accepted."""
    g = torch.Generator().manual_seed(seed)
    budget = dataclasses.replace(Budget(budget_points), rule=rule)
    p_base, q0 = 0.6, 0.05  # baseline accuracy; P(ablated right | baseline wrong)
    q1 = (0.4 * q0 + true_drop / 100) / 0.6  # P(ablated wrong | baseline right) giving E[a - b] = -true_drop
    accepted = 0
    for _ in range(TRIALS):
        base = torch.rand(N, generator=g) < p_base
        flip = torch.rand(N, generator=g)
        ablated = torch.where(base, flip >= q1, flip < q0)
        accepted += judge(budget, _result(ablated), _result(base))[3]
    return accepted / TRIALS


def test_confident_rule_accepts_a_point_at_the_budget_no_more_than_its_nominal_level():
    rate = _acceptance("confident", true_drop=1.0)
    assert rate <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / TRIALS), rate


def test_point_rule_accepts_a_point_at_the_budget_about_half_the_time():
    rate = _acceptance("point", true_drop=1.0)
    assert 0.4 <= rate <= 0.6, rate


@pytest.mark.parametrize("rule", ["point", "confident"])
def test_both_rules_accept_a_harmless_point_with_enough_questions(rule):
    assert _acceptance(rule, true_drop=-2.0, budget_points=2.0) > 0.9


def test_confident_kl_rule_uses_the_upper_bound():
    base = _result(torch.ones(N, dtype=torch.bool))
    g = torch.Generator().manual_seed(1)
    ablated = _result(torch.rand(N, generator=g) > 0.05)  # 5% of answers move: a mean answer KL well above 0
    kl = judge(Budget(10.0, "kl"), ablated, base)[1]
    point, sure = Budget(kl * 1.01, "kl"), dataclasses.replace(Budget(kl * 1.01, "kl"), rule="confident")
    assert judge(point, ablated, base)[3] and not judge(sure, ablated, base)[3]
