"""Removal units: what the search adds one at a time, so that what it zeroes is what the export removes.

Stock attention needs every KV group of a layer to hold the same number of query heads. A head removed from one
group but not the others is padded back with a zero head or paid for with a copied KV head, so zeroing it saves
nothing in the shipped model. Units whose zeroing equals their physical removal:

- ``slice``: one query head from every KV group of a layer, each group's r-th most dormant (r = 0, 1, ...). Removing
  slices 0..s-1 leaves every group g - s heads: the stock GQA shape, no copies, no padding.
- ``group``: a whole KV group, its query heads and its KV head: this is what shrinks the KV cache.
- ``head``: one query head (the paper's per-head ranking; what ``--units heads`` and ``study`` use).

A unit's score is the mean of its members' scores (in the scorer's direction: lower = more dormant). With the
layer-normalised scorers (``*_ln``, the default) member scores are comparable across heads and layers, so the mean
is the unit's average dormancy; it ranks a unit of many near-dormant heads before one whose members are mixed, and
within a layer slice r always comes before slice r + 1 (each group's r-th head is at most as active as its
(r + 1)-th), so every prefix of the ranking is a valid removal. With ``uniform``, each unit spans every layer (slice r
or the j-th most dormant group of each layer), so every prefix keeps one shape in all layers: a stock config.
A layer always keeps at least one group and one head per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from prune_heads.heads import HeadSet
from prune_heads.models.geometry import HeadGeometry

UNIT_KINDS = ("gqa", "heads")  # --units


@dataclass(frozen=True)
class Unit:
    kind: str  # "slice" | "group" | "head"
    members: tuple[tuple[int, int], ...]  # (layer, query head)
    score: float  # mean member score, lower = more dormant


def _group_order(signed: torch.Tensor, geo: HeadGeometry) -> list[list[int]]:
    """Per KV group, its query heads most dormant first (ties by index)."""
    g = geo.group_size
    return [sorted(range(k * g, (k + 1) * g), key=lambda h: (float(signed[h]), h)) for k in range(geo.num_kv_heads)]


def _layer_units(layer: int, signed: torch.Tensor, geo: HeadGeometry, groups: bool) -> list[Unit]:
    order = _group_order(signed, geo)
    units = []
    for r in range(geo.group_size - 1):  # every group keeps at least one head
        members = tuple((layer, heads[r]) for heads in order)
        units.append(Unit("slice", members, float(sum(signed[h] for _, h in members)) / len(members)))
    if groups:
        by_dormancy = sorted(range(geo.num_kv_heads), key=lambda k: (float(signed[order[k]].mean()), k))
        for k in by_dormancy[:-1]:  # the layer keeps at least one group
            members = tuple((layer, h) for h in sorted(order[k]))
            units.append(Unit("group", members, float(signed[order[k]].mean())))
    return units


def _uniform(per_layer: list[list[Unit]]) -> list[Unit]:
    """Units spanning every layer: the i-th slice (or group) unit of each layer together."""
    out = []
    for kind in ("slice", "group"):
        columns = [[u for u in units if u.kind == kind] for units in per_layer]
        for i in range(min(len(c) for c in columns)):
            parts = [c[i] for c in columns]
            members = tuple(m for p in parts for m in p.members)
            out.append(Unit(kind, members, sum(p.score for p in parts) / len(parts)))
    return out


def gqa_units(scores: torch.Tensor, dormant_low: bool, geometries: Sequence[HeadGeometry], uniform: bool = False,
              groups: bool = True, slices: bool = True) -> list[Unit]:
    """Slice and whole-group units of every layer, most dormant first; ``uniform``: each unit spans every layer."""
    signed = scores.float() if dormant_low else -scores.float()
    per_layer = [_layer_units(i, signed[i], geo, groups) for i, geo in enumerate(geometries)]
    if not slices:
        per_layer = [[u for u in units if u.kind != "slice"] for units in per_layer]
    units = _uniform(per_layer) if uniform else [u for units in per_layer for u in units]
    return sorted(units, key=lambda u: u.score)  # stable: a layer's slices stay in order on ties


def head_units(ranking: Sequence[tuple[int, int]]) -> list[Unit]:
    """The per-head ranking as one-head units (their scores are their ranks)."""
    return [Unit("head", (pair,), float(i)) for i, pair in enumerate(ranking)]


class UnitRanking:
    """Prefixes of a unit ranking as head sets: ``heads(k)`` is what the first ``k`` units remove."""

    def __init__(self, units: Sequence[Unit], total_heads: int):
        self.units, self.total_heads = list(units), total_heads
        self._sizes: list[int] = []
        seen: set[tuple[int, int]] = set()
        for u in self.units:
            seen.update(u.members)
            self._sizes.append(len(seen))

    def __len__(self) -> int:
        return len(self.units)

    def heads(self, k: int) -> HeadSet:
        return HeadSet.from_pairs(m for u in self.units[:k] for m in u.members)

    def num_heads(self, k: int) -> int:
        return self._sizes[k - 1] if k > 0 else 0

    def prefix_for_fraction(self, fraction: float) -> int:
        """The shortest prefix zeroing at least ``fraction`` of all heads (at least one unit)."""
        target = max(1, round(fraction * self.total_heads))
        for k, n in enumerate(self._sizes, 1):
            if n >= target:
                return k
        return len(self._sizes)
