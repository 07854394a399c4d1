"""The search's order: the removal units (single heads, or GQA slices and whole KV groups) ranked by the scorer, most
dormant first, and what the search removes and maximises (``SelectionOptions``)."""
from __future__ import annotations

from dataclasses import dataclass

from prune_heads.heads import ScoreTable, score_direction
from prune_heads.search.budget_search import SearchOptions
from prune_heads.search.units import UnitRanking, gqa_units, head_units
from prune_heads.search.verifier import Verifier


@dataclass(frozen=True)
class SelectionOptions:
    """What the search removes and maximises: the scorer that ranks heads, the removal units (``gqa``: slices and
    whole KV groups; ``heads``: single heads), the grouped-query rule for single heads (``exact`` | ``balanced``) and
    how the search walks (its grid, patience, objective)."""

    scorer: str = "ahon_ln"
    units: str = "gqa"
    gqa: str = "exact"
    search: SearchOptions = SearchOptions()


def unit_ranking(scores: ScoreTable, verifier: Verifier, options: SelectionOptions) -> UnitRanking:
    """The removal units of ``--units``, most dormant first: per-head (the paper's), or GQA slices and groups
    (uniform across layers for ``--layout uniform``; whole groups only for ``--objective kv-cache``)."""
    geometries = verifier.planner.geometries
    total = sum(g.num_heads for g in geometries)
    scorer = options.scorer
    if options.units == "heads":
        return UnitRanking(head_units(scores.ranking(scorer)), total)
    units = gqa_units(scores.mean(scorer), score_direction(scorer) == "low", geometries,
                      uniform=verifier.layout == "uniform", slices=options.search.objective != "kv-cache")
    return UnitRanking(units, total)
