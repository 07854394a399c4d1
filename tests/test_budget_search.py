import pytest
import torch
from tiny import FnEvaluator

from prune_heads.data.tasks import Question
from prune_heads.errors import UserError
from prune_heads.eval.results import EvalResult
from prune_heads.heads import HeadSet
from prune_heads.search.budget import Budget
from prune_heads.search.budget_search import SearchOptions, search_budget


@pytest.mark.parametrize("text,points", [("1%", 1.0), ("0.5", 0.5), ("2pt", 2.0), (" 1.5 % ", 1.5), ("3 points", 3.0), (".5", 0.5)])
def test_budget_parses(text, points):
    assert Budget.parse(text).limit == points


@pytest.mark.parametrize("text", ["abc", "-1%", "1%%", "", "150%", "1 bit"])
def test_malformed_budget_is_a_user_error(text):
    with pytest.raises(UserError, match="budget"):
        Budget.parse(text)


N = 200  # questions
QS = [Question("s", i, "q", ("a", "b", "c", "d"), 0) for i in range(N)]


def result_with_accuracy(correct: int) -> EvalResult:
    ll = torch.zeros(N, 4)
    ll[:correct, 0] = 1.0  # first `correct` questions right
    ll[correct:, 1] = 1.0
    return EvalResult(QS, ll)


def test_search_finds_largest_size_within_budget_and_keeps_every_point():
    ranking = [(i // 10, i % 10) for i in range(100)]
    calls = []

    def evaluate(heads: HeadSet, label: str) -> EvalResult:
        calls.append(len(heads))
        k = len(heads)
        return result_with_accuracy(120 if k <= 13 else 100)  # drop of 10 points past 13 heads

    baseline = result_with_accuracy(120)
    res = search_budget(ranking, FnEvaluator(evaluate, baseline, Budget(1.0)), SearchOptions(grid=(0.05, 0.10, 0.15, 0.20, 0.25), patience=2, refine_steps=4))
    assert res.best.num_heads == 13
    assert res.best.heads == HeadSet.from_pairs(ranking[:13])
    sizes = [p.num_heads for p in res.curve()]
    assert sizes == sorted(set(calls) | {0})
    assert 15 in sizes and 20 in sizes and 25 not in sizes  # coarse grid stopped after 2 failures in a row
    assert len(calls) == len(set(calls))  # no size evaluated twice


def test_non_monotone_curve_takes_largest_passing_point():
    ranking = [(0, i) for i in range(40)]

    def evaluate(heads, label):
        return result_with_accuracy({4: 119, 8: 110, 12: 120, 16: 100, 20: 100}.get(len(heads), 100))

    res = search_budget(ranking, FnEvaluator(evaluate, result_with_accuracy(120), Budget(1.0)), SearchOptions(grid=(0.1, 0.2, 0.3, 0.4, 0.5), patience=2, refine_steps=0))
    assert res.best.num_heads == 12
    assert not [p for p in res.points if p.num_heads == 8][0].within_budget


@pytest.mark.parametrize("text,metric,expected", [("0.05nat", None, ("kl", 0.05)), ("0.1 nats", "kl", ("kl", 0.1)),
                                                  ("0.2", "kl", ("kl", 0.2)), ("1%", None, ("accuracy", 1.0)), ("1%", "mmlu-cloze", ("accuracy", 1.0)),
                                                  ("0.1nat", "kl-text", ("kl-text", 0.1))])
def test_kl_budgets(text, metric, expected):
    b = Budget.parse(text, metric)
    assert (b.metric, b.limit) == expected


def test_budget_unit_must_match_metric():
    with pytest.raises(UserError, match="in nats, but `metric` is mmlu"):
        Budget.parse("0.05nat", "mmlu")
    with pytest.raises(UserError, match="in points, but `metric` is kl, which is measured in nats"):
        Budget.parse("1%", "kl")
    with pytest.raises(UserError, match="in nats, but `metric` is same-generation, which is measured in points"):
        Budget.parse("0.05nat", "same-generation")
    assert Budget.parse("5pt", "token-agreement").limit == 5.0 and not Budget.parse("5", "same-generation").in_nats


def test_answer_kl_and_agreement_by_hand():
    from prune_heads.eval.results import agreement, answer_kl

    base = EvalResult(QS[:2], torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])))
    abl = EvalResult(QS[:2], torch.log(torch.tensor([[0.4, 0.4, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])) + 3.0)
    kl = answer_kl(abl, base)  # the +3 shift cancels in the renormalisation over A-D
    import math

    assert kl[0].item() == pytest.approx(0.7 * math.log(0.7 / 0.4) + 0.1 * math.log(0.1 / 0.4))
    assert kl[1].item() == pytest.approx(0.0, abs=1e-12)
    assert answer_kl(base, base).abs().max() == 0
    assert agreement(abl, base) == 1.0  # argmax A for both rows (ties break to the first letter)


def test_kl_budget_drives_the_search():
    ranking = [(0, i) for i in range(40)]

    def evaluate(heads, label):
        k = len(heads)
        ll = torch.zeros(N, 4)
        ll[:, 0] = 2.0 - 0.1 * k  # answers stay the same, confidence drops with every head removed
        return EvalResult(QS, ll)

    base = evaluate(HeadSet(), "")
    res = search_budget(ranking, FnEvaluator(evaluate, base, Budget(0.02, "kl")), SearchOptions(grid=(0.1, 0.2, 0.3, 0.4), patience=1, refine_steps=3))
    assert all(p.accuracy == base.accuracy for p in res.points)  # accuracy cannot see this damage
    assert 0 < res.best.num_heads < 40 and res.best.kl <= 0.02
    over = [p for p in res.points if not p.within_budget]
    assert over and all(p.kl > 0.02 for p in over)


def test_decided_over_budget_uses_the_ci_of_the_questions_so_far():
    from prune_heads.search.budget import decided_over_budget

    qs = QS[:40]
    base = EvalResult(qs, torch.tensor([[1.0, 0, 0, 0]] * 40))  # all right
    # 20 of 40 wrong: delta -50 pt, CI about [-66, -34]: decided over a 1-point budget, not over a 70-point one.
    half = EvalResult(qs, torch.tensor([[1.0, 0, 0, 0]] * 20 + [[0, 1.0, 0, 0]] * 20))
    assert decided_over_budget(Budget(1.0), half, base)
    assert not decided_over_budget(Budget(70.0), half, base)
    # 1 of 40 wrong: -2.5 pt, CI reaches above -1: not decided.
    one = EvalResult(qs, torch.tensor([[1.0, 0, 0, 0]] * 39 + [[0, 1.0, 0, 0]]))
    assert not decided_over_budget(Budget(1.0), one, base)
    # KL: identical answers -> KL 0, never decided over; a large shift on every question -> decided.
    assert not decided_over_budget(Budget(0.01, "kl"), base, base)
    assert decided_over_budget(Budget(0.01, "kl"), EvalResult(qs, torch.tensor([[0, 3.0, 0, 0]] * 40)), base)
    assert not decided_over_budget(Budget(0.01, "kl-text"), half, base)  # measured elsewhere, all at once
