"""The selection: the largest dormant prefix of the ranking (ranking.py) within budget (budget_search.py), and with
``--gqa balanced`` the same number of heads removed from every KV group (re-verified)."""
from __future__ import annotations

from dataclasses import dataclass

from prune_heads.console import say
from prune_heads.eval.results import EvalResult, PairedDelta
from prune_heads.heads import HeadSet, ScoreTable, score_direction
from prune_heads.plan.planner import balanced_selection
from prune_heads.search.budget import judge
from prune_heads.search.budget_search import SearchPoint, SearchResult, search_budget
from prune_heads.search.ranking import SelectionOptions
from prune_heads.search.units import UnitRanking
from prune_heads.search.verifier import Verifier


@dataclass
class Selection:
    """The chosen heads with their evaluation, and every evaluated point of the search."""

    heads: HeadSet
    result: EvalResult
    delta: PairedDelta
    search: SearchResult
    total: int  # heads in the model
    savings: dict | None = None  # what the model that ships saves (Planner.savings)

    def points(self) -> list[dict]:
        return [dict(p.to_json(), chosen=p.heads == self.heads) for p in self.search.curve()]


def select_heads(ranking: UnitRanking, scores: ScoreTable, verifier: Verifier,
                 options: SelectionOptions) -> Selection:
    """The passing prefix of ``ranking`` (unit_ranking) that maximises the objective in the model that ships (then
    balanced with --units heads --gqa balanced by ``scores``)."""
    search = search_budget(ranking, verifier, options.search)
    best = search.best
    selection = Selection(best.heads, best.result, best.delta, search, ranking.total_heads, best.savings)
    if options.gqa == "balanced" and best.heads:
        scorer = options.scorer
        selection = balance_groups(selection, scores.mean(scorer), score_direction(scorer) == "low", verifier)
    return selection


def balance_groups(selection: Selection, scores, dormant_low: bool, verifier: Verifier) -> Selection:
    """--gqa balanced: the same number of heads removed from every KV group of a layer (stock GQA shapes with no
    KV copies), chosen by score, re-verified; while over budget, the layer removing the most gives one back."""
    geometries = verifier.planner.geometries
    per_layer = {i: len(selection.heads.heads(i)) // geo.num_kv_heads for i, geo in enumerate(geometries)}
    total = sum(geo.num_heads for geo in geometries)
    while True:
        heads = balanced_selection(selection.heads, geometries, scores, dormant_low, per_layer)
        result = verifier.evaluate(heads, f"balanced {len(heads)} heads")
        delta, kl, agree, ok = judge(verifier.budget, result, verifier.baseline)
        say(f"  balanced selection: {len(heads)} heads, delta {delta.delta:+.2f} pt "
             f"({'within' if ok else 'over'} budget)")
        saved = verifier.savings(heads)
        selection.search.points.append(SearchPoint(len(heads), len(heads) / total, heads, result.accuracy, delta, ok,
                                                   "balanced", result, kl, agree, len(heads), saved))
        if ok or not heads:
            return Selection(heads, result, delta, selection.search, selection.total, saved)
        worst = max(per_layer, key=lambda i: per_layer[i])
        per_layer[worst] -= 1


def gqa_costs(verifier: Verifier, scores, dormant_low: bool, heads: HeadSet) -> dict:
    """What each grouped-query strategy would cost for the searched selection (before any re-verification)."""
    planner = verifier.planner
    balanced = balanced_selection(heads, planner.geometries, scores, dormant_low)
    out = {}
    for name, sel in (("exact", heads), ("balanced", balanced)):
        c = planner.costs(planner.exact(sel))
        out[name] = {"heads_removed": len(sel), **{k: v for k, v in c.items() if k != "shapes"}}
    return out
