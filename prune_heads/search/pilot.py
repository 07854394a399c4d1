"""The resolution pilot: before the search, its first grid point evaluated on every question predicts what a point
at the budget's edge can tell apart (resolution.py), and the long-context guard is sized on it."""
from __future__ import annotations

from prune_heads.heads import HeadSet
from prune_heads.search.resolution import Resolution, predict
from prune_heads.search.units import UnitRanking
from prune_heads.search.verifier import Verifier


def pilot_heads(ranking: UnitRanking, grid: tuple[float, ...]) -> HeadSet:
    """The search's first grid point: the pilot ablation the budget's resolution is predicted from."""
    return ranking.heads(ranking.prefix_for_fraction(min(grid)))


def predict_resolution(ranking: UnitRanking, verifier: Verifier, grid: tuple[float, ...]) -> Resolution | None:
    """Before the search: its first grid point, evaluated on every question as a pilot (cached, so the search reuses
    it), gives the half-width a point at the budget's edge will have (resolution.py). None with --heal-in-search."""
    if verifier.heal_in_search or not len(ranking):
        return None
    heads = pilot_heads(ranking, grid)
    pilot = verifier.evaluate_complete(heads, f"pilot: {len(heads)}/{ranking.total_heads} heads off")
    in_texts = verifier.budget.on_text
    n = len(verifier.kl_text.sequences) if in_texts else len(verifier.baseline.questions)
    return predict(verifier.budget, pilot, verifier.baseline, n,
                   f"a pilot ablation of {len(heads)} heads, the search's first point")
