"""Confirmation: the chosen point measured again on questions the search never saw.

The search evaluates a dozen points on the same questions and keeps the best passing one, so the delta it reports is
measured on the questions that selected it and is biased upwards (the winner's curse). Here the chosen point is
evaluated, against the unablated model on the same questions, on confirmation questions disjoint from the search's:
further questions of the same subjects (``TaskData.unused``), or, with ``--confirm-fraction``, a stratified share
held out of the search (``TaskData.split``). If it fails the budget (under the run's decision rule), the next passing
point along the search's own curve is confirmed, and so on; every attempt is recorded. When nothing confirms, nothing
is removed.

With the long-context guard (guard.py), a point must also keep every long-context probe within its tolerance of the
unablated model. The guard reads a point first, since its probes cost less than the confirmation questions: a point it
refuses spends none of them (the unablated model's confirmation baseline is computed only once a point reaches it),
and the walk goes on.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from prune_heads.console import say
from prune_heads.data.tasks import TaskData
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.results import accuracy_summary, paired_delta
from prune_heads.eval.reuse import first_changed_layer
from prune_heads.heads import HeadSet
from prune_heads.plan.planner import objective_value
from prune_heads.search.budget import judge
from prune_heads.search.budget_search import Prefixes
from prune_heads.search.guard import Guard, per_length
from prune_heads.search.selection import Selection
from prune_heads.search.units import UnitRanking
from prune_heads.search.verifier import Verifier, mean_se


@dataclass(frozen=True)
class ConfirmationQuestions:
    """The questions the chosen point is confirmed on (None: confirmation does not apply) and where they come from
    (or why there are none)."""

    data: TaskData | None
    source: str | None


def _record(point, delta, kl, agree, ok) -> dict:
    return {"num_heads": point.num_heads, "units": point.units, **delta.to_json(), "kl_answer_nats": round(kl, 6),
            "agreement": round(agree, 6), "within_budget": ok}


def confirm(verifier: Verifier, questions: ConfirmationQuestions, selection: Selection, objective: str,
            guard: Guard | None = None, ranking: UnitRanking | None = None) -> tuple[Selection, dict, dict]:
    """(the accepted selection, the report's ``confirmation``, the report's ``guard``). The search's passing points
    are tried best first: each must confirm on unseen questions (where confirmation applies) and keep every
    long-context probe within tolerance (with a ``guard``); the first that does is the selection. With a guard and
    the search's ``ranking``, the walk goes on below the smallest passing point (``_smaller``). Unchanged when
    neither applies (no confirmation questions, a next-token-KL budget, healing in the search; no guard)."""
    guarded = {**guard.to_json(), "judged": []} if guard else {"enabled": False}
    if not selection.heads:
        return selection, {"confirmed": None, "reason": questions.source or "nothing to confirm: no heads were "
                           "chosen"}, guarded
    confirmer = (_Confirmer(verifier, questions) if questions.data is not None
                 else _TextConfirmer(verifier) if verifier.setup.confirm_text is not None else None)
    if confirmer is None and guard is None:
        return selection, {"confirmed": None, "reason": questions.source}, guarded
    smaller = _smaller(selection, ranking, verifier) if guard is not None and ranking is not None else ()
    for point in itertools.chain(_candidates(selection, objective, confirmed_first=confirmer is not None), smaller):
        # The cheapest refusal first: the guard's probes (a few prompts, cheapest probe first, stopping at the first
        # failure) before the point spends the confirmation questions.
        if guard is not None and not _guarded(guard, verifier, point.heads, guarded):
            continue
        if confirmer is not None and not confirmer.passes(point):
            continue
        report = confirmer.accept(point) if confirmer else {"confirmed": None, "reason": questions.source}
        if point is selection:
            return selection, report, guarded
        return Selection(point.heads, point.result, point.delta, selection.search, selection.total,
                         point.savings), report, guarded
    return _nothing(verifier, selection, confirmer, guard), \
        (confirmer.report if confirmer else {"confirmed": None, "reason": questions.source}), guarded


def _candidates(selection: Selection, objective: str, confirmed_first: bool) -> list:
    """The search's passing points, best first by the objective; without confirmation the selection itself leads
    (it was chosen on these questions already)."""
    passing = [p for p in selection.search.points if p.within_budget and p.heads]
    passing.sort(key=lambda p: (objective_value(objective, p), p.num_heads), reverse=True)
    if confirmed_first:
        return passing
    return [selection] + [p for p in passing if p.heads != selection.heads]


def _smaller(selection: Selection, ranking: UnitRanking, verifier: Verifier):
    """Below the smallest passing point of the search: shorter prefixes of the same ranking (one unit fewer, then
    halving), each evaluated on the search's questions like a search point (report stage ``step-back``) and offered
    when within budget. A guard that refuses the search's points (a retrieval head among the least dormant units)
    may accept the part of the prefix without it."""
    passing = [p.units for p in selection.search.points if p.within_budget and p.heads]
    if not passing:
        return
    prefixes, k = Prefixes(ranking, verifier), min(passing) - 1
    while k >= 1:
        point = prefixes.point(k, "step-back")
        selection.search.points.append(point)
        if point.within_budget:
            yield point
        k //= 2


def _guarded(guard: Guard, verifier: Verifier, heads: HeadSet, guarded: dict) -> bool:
    verdict = guard.check(verifier.target(heads), f"{len(heads)} heads")
    guarded["judged"].append({"num_heads": len(heads), **verdict.to_json()})
    if verdict.ok:
        guarded["chosen"] = {"num_heads": len(heads), "per_length": per_length(verdict)}
    return verdict.ok


class _Confirmer:
    """The unablated model on the confirmation questions, and each point judged against it on them."""

    def __init__(self, verifier: Verifier, questions: ConfirmationQuestions):
        self.verifier, self.work = verifier, verifier.work
        self.enc = encode_task(self.work.lm, questions.data)
        self.unseen = f"{len(self.enc)} unseen questions"
        self.report = {"questions": len(self.enc), "subjects": len(self.enc.subjects), "source": questions.source,
                       "rule": verifier.budget.rule, "tried": [],
                       "question_ids": [[q.subject, q.index] for q in questions.data.questions]}
        self._baseline, self._last = None, None

    @property
    def baseline(self):
        """The unablated model on the confirmation questions, evaluated when the first point reaches them."""
        if self._baseline is None:
            self._baseline = self.work.task_result(self.enc, None, "unablated (confirmation)")
            self.report["baseline"] = accuracy_summary(self._baseline)
        return self._baseline

    def passes(self, point) -> bool:
        target = self.verifier.target(point.heads)
        self.work.keep_layer = first_changed_layer(target)  # the baseline's read keeps where this point starts
        baseline = self.baseline
        result = self.work.task_result(self.enc, target, f"confirm {point.num_heads} heads")
        delta, kl, agree, ok = judge(self.verifier.budget, result, baseline)
        self.report["tried"].append(_record(point, delta, kl, agree, ok))
        say(f"  confirmation of {point.num_heads} heads on {len(self.enc)} unseen questions: delta {delta.delta:+.2f} "
            f"pt [{delta.ci_low:+.2f}, {delta.ci_high:+.2f}]  KL {kl:.4f} nat  "
            + ("confirmed" if ok else "over budget"), fg="green" if ok else "yellow")
        self._last = (delta, kl)
        return ok

    def accept(self, point) -> dict:
        delta, kl = self._last
        self.report.update(confirmed=True, num_heads=point.num_heads, **delta.to_json(), kl_answer_nats=round(kl, 6))
        return self.report


class _TextConfirmer:
    """A text budget (kl-text, token-agreement, same-generation) confirmed on further texts the search never read
    (``VerifierSetup.confirm_text``: the next documents of a generative lm-eval task with the unablated model's own
    generations), under the run's rule. The report gives the next-token KL beside what the budget limits."""

    def __init__(self, verifier: Verifier):
        self.verifier, self.texts = verifier, verifier.setup.confirm_text
        self.unseen = f"{len(self.texts)} unseen texts"
        self.report = {"texts": len(self.texts), "source": self.texts.source, "rule": verifier.budget.rule,
                       "tried": []}
        self._last = {}

    def _measured(self, point) -> tuple[dict, bool]:
        texts, budget = self.texts, self.verifier.budget
        damage = self.verifier.work.text_damage(texts, self.verifier.target(point.heads))
        kl, kl_se = mean_se(damage.kl.double())
        value, se = mean_se(budget.text_values(damage))
        ok = budget.allows(None, text=value, text_se=se)  # a text budget reads no accuracy
        out = {**damage.means(), "kl_text_ci95": [round(kl - 1.96 * kl_se, 6), round(kl + 1.96 * kl_se, 6)]}
        if budget.metric != "kl-text":
            out.update(budget_value=round(value, 4), budget_ci95=[round(value - 1.96 * se, 4),
                                                                  round(value + 1.96 * se, 4)])
        return out, ok

    def passes(self, point) -> bool:
        measured, ok = self._measured(point)
        self.report["tried"].append({"num_heads": point.num_heads, "units": point.units, **measured,
                                      "within_budget": ok})
        budget = self.verifier.budget
        shown = (f"next-token KL {measured['kl_text_nats']:.4f} nat [{measured['kl_text_ci95'][0]:.4f}, "
                 f"{measured['kl_text_ci95'][1]:.4f}]" if budget.metric == "kl-text" else
                 f"{budget.axis_label} {measured['budget_value']:.2f} [{measured['budget_ci95'][0]:.2f}, "
                 f"{measured['budget_ci95'][1]:.2f}]")
        say(f"  confirmation of {point.num_heads} heads on {self.unseen}: {shown}  "
            + ("confirmed" if ok else "over budget"), fg="green" if ok else "yellow")
        self._last = measured
        return ok

    def accept(self, point) -> dict:
        self.report.update(confirmed=True, num_heads=point.num_heads, **self._last)
        return self.report


def _nothing(verifier: Verifier, selection: Selection, confirmer: "_Confirmer | _TextConfirmer | None",
             guard: Guard | None) -> Selection:
    """No point passes: nothing is removed."""
    confirms = f"confirms within {verifier.budget} on {confirmer.unseen}" if confirmer else ""
    keeps = "keeps the long-context probes within tolerance" if guard is not None else ""
    say(f"nothing {' and '.join(x for x in (confirms, keeps) if x)}: no heads are removed", fg="red", bold=True)
    if confirmer is not None:
        confirmer.report.update(confirmed=False, num_heads=0)
    base = verifier.baseline
    return Selection(HeadSet(), base, paired_delta(base, base), selection.search, selection.total,
                     verifier.savings(HeadSet()))
