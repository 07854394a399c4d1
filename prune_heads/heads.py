"""HeadSet (which query heads, per layer) and ScoreTable (named [layer, head] scores): the types everything passes."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from prune_heads.errors import HeadIndexError, UserError


@dataclass(frozen=True)
class HeadSet:
    """``{layer: sorted query-head indices}``, immutable and hashable so it can key caches.

    Only layers with at least one head are stored, so equal selections compare (and hash) equal.
    """

    _items: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @staticmethod
    def of(mapping: Mapping[int, Iterable[int]] | None = None) -> "HeadSet":
        mapping = mapping or {}
        items = []
        for layer in sorted(int(k) for k in mapping):
            heads = mapping[layer] if layer in mapping else mapping[str(layer)]  # type: ignore[index]
            hs = tuple(sorted({int(h) for h in heads}))
            if hs:
                items.append((layer, hs))
        return HeadSet(tuple(items))

    @staticmethod
    def from_pairs(pairs: Iterable[tuple[int, int]]) -> "HeadSet":
        mapping: dict[int, set[int]] = {}
        for layer, head in pairs:
            mapping.setdefault(int(layer), set()).add(int(head))
        return HeadSet.of(mapping)

    def as_dict(self) -> dict[int, tuple[int, ...]]:
        return dict(self._items)

    def heads(self, layer: int) -> tuple[int, ...]:
        return self.as_dict().get(layer, ())

    def pairs(self) -> Iterator[tuple[int, int]]:
        for layer, hs in self._items:
            for h in hs:
                yield layer, h

    def __len__(self) -> int:
        return sum(len(hs) for _, hs in self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def layers(self) -> list[int]:
        return [layer for layer, _ in self._items]

    def to_json(self) -> dict[str, list[int]]:
        return {str(layer): list(hs) for layer, hs in self._items}

    def mask(self, num_layers: int, num_heads: int) -> torch.Tensor:
        """A [layer, head] float mask, 0 where the head is removed and 1 elsewhere."""
        m = torch.ones(num_layers, num_heads)
        for layer, h in self.pairs():
            m[layer, h] = 0.0
        return m

    def validate(self, num_layers: int, heads_per_layer: list[int]) -> "HeadSet":
        for layer, h in self.pairs():
            if not 0 <= layer < num_layers:
                raise HeadIndexError(f"head set names layer {layer}, but the model has layers 0..{num_layers - 1}")
            if not 0 <= h < heads_per_layer[layer]:
                raise HeadIndexError(
                    f"head set names head {h} of layer {layer}, but that layer has heads "
                    f"0..{heads_per_layer[layer] - 1}"
                )
        return self

    @staticmethod
    def load(path: str | Path) -> "HeadSet":
        from prune_heads.io.readers import read_heads

        return HeadSet.of(read_heads(path))


# Direction of each base score: "low" means a low value marks a dormant head.
SCORE_DIRECTIONS: dict[str, str] = {
    "awft": "high",
    "aeqd": "low",
    "ftvvn": "low",
    "avvn": "low",
    "lthon": "low",
    "ahon": "low",
    "ahon_wo": "low",
}
BASE_KEYS = tuple(SCORE_DIRECTIONS)
SCORE_KEYS = BASE_KEYS + tuple(f"{k}_ln" for k in BASE_KEYS) + ("lthon_hn",)


def score_direction(key: str) -> str:
    if key not in SCORE_KEYS:
        raise UserError(f"unknown scorer {key!r}; choose one of: {', '.join(SCORE_KEYS)}")
    return SCORE_DIRECTIONS[key.split("_ln")[0].split("_hn")[0]]


@dataclass
class ScoreTable:
    """Per-head scores. ``per_input[key]`` is [input, layer, head]; ``mean(key)`` is the calibration-set score."""

    per_input: dict[str, torch.Tensor]
    token_counts: list[int] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return list(self.per_input)

    def mean(self, key: str) -> torch.Tensor:
        return self.per_input[key].mean(dim=0)

    @property
    def shape(self) -> tuple[int, int]:
        t = next(iter(self.per_input.values()))
        return int(t.shape[1]), int(t.shape[2])

    def ranking(self, key: str) -> list[tuple[int, int]]:
        """All (layer, head) pairs, most dormant first (stable: ties keep layer-major order)."""
        scores = self.mean(key).flatten()
        if score_direction(key) == "high":
            scores = -scores
        order = torch.sort(scores, stable=True).indices.tolist()
        num_heads = self.shape[1]
        return [(i // num_heads, i % num_heads) for i in order]

    def to_json(self) -> dict[str, list[list[float]]]:
        return {k: [[round(float(x), 6) for x in row] for row in self.mean(k)] for k in self.per_input}
