"""Decision rules on synthetic per-question results, where the true effect is known: the paper's point rule accepts a
point whose true accuracy drop is exactly the budget about half the time; the confident rule (non-inferiority) no
more often than its nominal 2.5%; both accept a harmless point."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny import FnEvaluator

from prune_heads.data.tasks import Question
from prune_heads.eval.results import EvalResult
from prune_heads.search.budget import Budget, judge

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


# -- the winner's curse, and confirmation ---------------------------------------------------------------------------


def _simulated_search(seed: int, n: int = 300, budget: float = 2.0):
    """A search over 12 points whose true accuracy drop grows by 0.5 pt per point, each evaluated on the same ``n``
    search questions; then the chosen point measured once more on ``n`` fresh questions. (true, on search, fresh)."""
    g = torch.Generator().manual_seed(seed)
    questions = [Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(n)]

    def outcomes(drop, base):
        q0, q1 = 0.05, (0.4 * 0.05 + drop / 100) / 0.6
        flip = torch.rand(len(base), generator=g)
        return torch.where(base, flip >= q1, flip < q0)

    def result(correct):
        loglik = torch.full((len(correct), 4), -4.0, dtype=torch.float64)
        loglik[:, 0] = torch.where(correct, -0.1, -3.0)
        loglik[:, 1] = torch.where(correct, -3.0, -0.1)
        return EvalResult(questions[: len(correct)], loglik)

    base = torch.rand(n, generator=g) < 0.6
    baseline, true = result(base), {}

    def evaluate(heads, label):
        k = len(heads)
        true[k] = 0.5 * k
        return result(outcomes(true[k], base))

    from prune_heads.search.budget_search import SearchOptions, search_budget

    ranking = [(0, h) for h in range(12)]
    res = search_budget(ranking, FnEvaluator(evaluate, baseline, Budget(budget)), SearchOptions(grid=tuple(k / 12 for k in range(1, 13)), patience=12, refine_steps=0))
    best = res.best
    fresh_base = torch.rand(n, generator=g) < 0.6
    fresh = judge(Budget(budget), result(outcomes(true.get(best.num_heads, 0.0), fresh_base)), result(fresh_base))[0]
    return -true.get(best.num_heads, 0.0), best.delta.delta, fresh.delta


def test_the_point_chosen_on_search_questions_is_biased_upwards_and_its_confirmation_is_not():
    runs = [_simulated_search(seed) for seed in range(300)]
    search_error = torch.tensor([s - t for t, s, _ in runs])
    fresh_error = torch.tensor([f - t for t, _, f in runs])
    se = lambda x: float(x.std()) / len(x) ** 0.5  # noqa: E731
    assert float(search_error.mean()) > 3 * se(search_error)  # the winner's curse: measured on the selecting set
    assert abs(float(fresh_error.mean())) < 2.5 * se(fresh_error)  # confirmation: unbiased within its error
