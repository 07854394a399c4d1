"""Confirmation: the chosen point measured again on questions the search never saw.

The search evaluates a dozen points on the same questions and keeps the best passing one, so the delta it reports is
measured on the questions that selected it and is biased upwards (the winner's curse). Here the chosen point is
evaluated, against the unablated model on the same questions, on confirmation questions disjoint from the search's:
further questions of the same subjects (``TaskData.unused``), or, with ``--confirm-fraction``, a stratified share
held out of the search (``TaskData.split``). If it fails the budget (under the run's decision rule), the next passing
point along the search's own curve is confirmed, and so on; every attempt is recorded. When nothing confirms, nothing
is removed.
"""
from __future__ import annotations

from dataclasses import dataclass

from prune_heads.console import say
from prune_heads.data.tasks import TaskData
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.results import accuracy_summary, paired_delta
from prune_heads.heads import HeadSet
from prune_heads.plan.planner import objective_value
from prune_heads.search.budget import judge
from prune_heads.search.selection import Selection
from prune_heads.search.verifier import Verifier


@dataclass(frozen=True)
class ConfirmationQuestions:
    """The questions the chosen point is confirmed on (None: confirmation does not apply) and where they come from
    (or why there are none)."""

    data: TaskData | None
    source: str | None


def _record(point, delta, kl, agree, ok) -> dict:
    return {"num_heads": point.num_heads, "units": point.units, **delta.to_json(), "kl_answer_nats": round(kl, 6),
            "agreement": round(agree, 6), "within_budget": ok}


def confirm(verifier: Verifier, questions: ConfirmationQuestions, selection: Selection,
            objective: str) -> tuple[Selection, dict]:
    """(the confirmed selection, the report's ``confirmation``); the selection is unchanged when confirmation does
    not apply (no confirmation questions, a next-token-KL budget, healing in the search)."""
    data, source, work = questions.data, questions.source, verifier.work
    if data is None or not selection.heads:
        return selection, {"confirmed": None, "reason": source or "nothing to confirm: no heads were chosen"}
    enc = encode_task(work.lm, data)
    baseline = work.evaluate(enc, None, "unablated (confirmation)")
    passing = [p for p in selection.search.points if p.within_budget and p.heads]
    passing.sort(key=lambda p: (objective_value(objective, p), p.num_heads), reverse=True)
    report = {"questions": len(enc), "subjects": len(enc.subjects), "source": source, "rule": verifier.budget.rule,
              "baseline": accuracy_summary(baseline), "points": [], "question_ids": [
                  [q.subject, q.index] for q in data.questions]}
    for point in passing:
        result = work.evaluate(enc, verifier.target(point.heads), f"confirm {point.num_heads} heads")
        delta, kl, agree, ok = judge(verifier.budget, result, baseline)
        report["points"].append(_record(point, delta, kl, agree, ok))
        say(f"  confirmation of {point.num_heads} heads on {len(enc)} unseen questions: delta {delta.delta:+.2f} pt "
             f"[{delta.ci_low:+.2f}, {delta.ci_high:+.2f}]  KL {kl:.4f} nat  "
             + ("confirmed" if ok else "over budget"), fg="green" if ok else "yellow")
        if ok:
            report.update(confirmed=True, num_heads=point.num_heads, **delta.to_json(), kl_answer_nats=round(kl, 6))
            return Selection(point.heads, point.result, point.delta, selection.search, selection.total,
                             point.savings), report
    say(f"nothing confirms within {verifier.budget} on {len(enc)} unseen questions: no heads are removed",
         fg="red", bold=True)
    base = verifier.baseline
    report.update(confirmed=False, num_heads=0)
    return Selection(HeadSet(), base, paired_delta(base, base), selection.search, selection.total,
                     verifier.savings(HeadSet())), report
