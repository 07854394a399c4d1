"""HeadSet -> PrunePlan: what the model that ships looks like, decided once per head set.

Stock attention code needs every KV group of a layer to hold the same number of query heads: new query head
``i`` reads new KV head ``i // (H' / K')``. A plan says, per layer, which original query head sits in each new
query slot (``None``: a dummy head with zero weights, used to pad a layer up to a uniform shape) and which
original KV head each new KV slot copies (a KV head may be copied, so unequal groups become equal exactly).

Both the verification ablation (``ablation``) and the physical slicing (``slicing``) read the same plan, so what is
verified is what is shipped. Export layouts:

- ``uniform``: every layer has the same query/KV head counts: a stock config, no remote code.
- ``per-layer``: head counts differ per layer (the ``pruned_<family>`` config of prune_heads.runtime: loads where
  prune-heads is installed, or with its shipped modelling file and ``trust_remote_code``).
- ``masked``: original shapes with the removed heads' o_proj columns zeroed: exact, loads anywhere, no speed-up.
``auto`` takes uniform when the exact per-layer shapes already agree (nothing is left on the table), else per-layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from prune_heads.errors import UserError
from prune_heads.heads import HeadSet
from prune_heads.models.geometry import HeadGeometry

if TYPE_CHECKING:
    from prune_heads.models.adapters import ArchAdapter

LAYOUTS = ("auto", "uniform", "per-layer", "masked")
OBJECTIVES = ("params", "kv-cache", "flops", "heads")  # --objective: what the chosen point maximises
FLOPS_CONTEXT = 2048  # attention FLOPs per token are stated for a token attending to this many positions


@dataclass(frozen=True)
class LayerPlan:
    geometry: HeadGeometry  # the original layer's
    slots: tuple[int | None, ...]  # new query head -> original query head (None: zero dummy)
    kv_slots: tuple[int, ...]  # new KV head -> original KV head it copies
    zero_output: frozenset[int] = frozenset()  # original heads kept in place but with o_proj columns zeroed (masked)

    def __post_init__(self):
        if self.slots:
            assert len(self.kv_slots) and len(self.slots) % len(self.kv_slots) == 0, "groups must be equal"
            g = len(self.slots) // len(self.kv_slots)
            for i, h in enumerate(self.slots):
                if h is not None:
                    own = self.geometry.kv_head_of(h)
                    assert self.kv_slots[i // g] == own, "a query head must read its own KV head"

    @property
    def num_heads(self) -> int:
        return len(self.slots)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_slots)

    @property
    def kept_heads(self) -> tuple[int, ...]:
        return tuple(sorted(h for h in self.slots if h is not None and h not in self.zero_output))

    @property
    def silent_slots(self) -> list[int]:
        """New query slots whose output must stay zero: dummy heads, and removed heads of a masked layer."""
        return [j for j, h in enumerate(self.slots) if h is None or h in self.zero_output]

    @property
    def is_identity(self) -> bool:
        geo = self.geometry
        return (self.slots == tuple(range(geo.num_heads)) and self.kv_slots == tuple(range(geo.num_kv_heads))
                and not self.zero_output)


@dataclass(frozen=True)
class PrunePlan:
    layers: tuple[LayerPlan, ...]
    removed: HeadSet
    kind: str  # "exact" | "uniform" | "masked"

    @property
    def is_uniform(self) -> bool:
        return len({(lp.num_heads, lp.num_kv_heads) for lp in self.layers}) == 1

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(lp.num_heads, lp.num_kv_heads) for lp in self.layers]

    def kv_cache_bytes_per_token(self, bytes_per_value: int) -> int:
        return sum(2 * lp.num_kv_heads * lp.geometry.head_dim * bytes_per_value for lp in self.layers)

    def attention_params(self, hidden_size: int) -> int:
        """q/k/v/o weight parameters (biases and norms aside)."""
        return sum(hidden_size * lp.geometry.head_dim * (2 * lp.num_heads + 2 * lp.num_kv_heads) for lp in self.layers)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "layers": [
                {"query_slots": list(lp.slots), "kv_slots": list(lp.kv_slots), "zero_output": sorted(lp.zero_output),
                 "original": {"num_heads": lp.geometry.num_heads, "num_kv_heads": lp.geometry.num_kv_heads,
                              "head_dim": lp.geometry.head_dim}}
                for lp in self.layers
            ],
        }

    @staticmethod
    def from_json(data: dict, removed: HeadSet | None = None) -> "PrunePlan":
        """The plan ``to_json`` wrote (``prune_heads.json``'s ``plan``); a UserError if it is not one."""
        try:
            layers = tuple(
                LayerPlan(HeadGeometry(int(lp["original"]["num_heads"]), int(lp["original"]["num_kv_heads"]),
                                       int(lp["original"]["head_dim"])),
                          tuple(None if h is None else int(h) for h in lp["query_slots"]),
                          tuple(int(k) for k in lp["kv_slots"]), frozenset(int(h) for h in lp["zero_output"]))
                for lp in data["layers"])
        except (KeyError, TypeError, ValueError, AssertionError) as e:
            why = f"{type(e).__name__}: {e}"
            raise UserError(f"the export's plan is malformed ({why}); export the model again") from None
        return PrunePlan(layers, removed or HeadSet(), str(data.get("kind", "exact")))


def _kept_by_group(geo: HeadGeometry, removed: Sequence[int]) -> list[list[int]]:
    gone = set(removed)
    return [[h for h in range(k * geo.group_size, (k + 1) * geo.group_size) if h not in gone]
            for k in range(geo.num_kv_heads)]


def _layer_plan(geo: HeadGeometry, groups: list[list[int]], g: int, k_total: int | None = None) -> LayerPlan:
    """Kept heads placed ``g`` per KV slot (copies of their KV head as needed, zero dummies to fill a slot), padded
    with dummy groups up to ``k_total`` KV slots."""
    slots: list[int | None] = []
    kv_slots: list[int] = []
    for k, members in enumerate(groups):
        for start in range(0, len(members), g):
            chunk = members[start:start + g]
            kv_slots.append(k)
            slots += chunk + [None] * (g - len(chunk))
    while k_total is not None and len(kv_slots) < k_total:
        kv_slots.append(0)
        slots += [None] * g
    return LayerPlan(geo, tuple(slots), tuple(kv_slots))


def _cost(num_heads: int, num_kv: int) -> tuple[int, int]:
    """Attention weights per head_dim x hidden (q and o per query head, k and v per KV head); then KV cache."""
    return (2 * num_heads + 2 * num_kv, num_kv)


def _slots_needed(groups: list[list[int]], g: int) -> int:
    return sum(math.ceil(len(m) / g) for m in groups if m)


def plan_exact(heads: HeadSet, geometries: Sequence[HeadGeometry], valid_num_heads=lambda h: True) -> PrunePlan:
    """Per layer, the cheapest exact shape for the kept heads: for each group size g', every KV head with n kept
    query heads gets ceil(n / g') slots (copies of it), short slots are filled with zero dummy heads. g' = gcd
    of the kept counts needs no dummies but may copy many KV heads; g' = the original group size copies none
    but may keep dummies. The cheapest in attention parameters wins (then the smaller KV cache). A layer losing
    every head keeps none (per-layer layout only)."""
    layers = []
    for i, geo in enumerate(geometries):
        groups = _kept_by_group(geo, heads.heads(i))
        if not any(groups):
            layers.append(LayerPlan(geo, (), ()))
            continue
        needed = {g: _slots_needed(groups, g) for g in range(1, geo.group_size + 1)}
        shapes = [(_cost(k * g, k), g) for g, k in needed.items() if valid_num_heads(k * g)]
        if not shapes:  # no valid shape: keep the layer's shape, removed heads masked
            gone = frozenset(heads.heads(i))
            layers.append(LayerPlan(geo, tuple(range(geo.num_heads)), tuple(range(geo.num_kv_heads)), gone))
            continue
        layers.append(_layer_plan(geo, groups, min(shapes)[1]))
    return PrunePlan(tuple(layers), heads, "exact")


def plan_uniform(heads: HeadSet, geometries: Sequence[HeadGeometry], valid_num_heads=lambda h: True) -> PrunePlan:
    """Every layer gets the same (H', K'): the cheapest shape that fits every layer's kept heads, padding with
    zero dummy heads where a layer keeps fewer. ``valid_num_heads`` rejects head counts the config refuses."""
    if len(set(geometries)) != 1:
        raise UserError("a uniform layout needs a model whose layers all have the same head geometry")
    base = geometries[0]
    all_groups = [_kept_by_group(geo, heads.heads(i)) for i, geo in enumerate(geometries)]
    best = None
    for g in range(1, base.group_size + 1):
        k_new = max(1, max(_slots_needed(groups, g) for groups in all_groups))
        while not valid_num_heads(k_new * g) and k_new * g < base.num_heads:
            k_new += 1
        if not valid_num_heads(k_new * g):  # no count the config accepts with groups of g (the original's does)
            continue
        cost = _cost(k_new * g, k_new)
        if best is None or cost < best[0]:
            best = (cost, g, k_new)
    _, g, k_new = best
    layers = [_layer_plan(geo, groups, g, k_new) for geo, groups in zip(geometries, all_groups)]
    return PrunePlan(tuple(layers), heads, "uniform")


def plan_masked(heads: HeadSet, geometries: Sequence[HeadGeometry]) -> PrunePlan:
    """Original shapes; removed heads' o_proj columns are zeroed."""
    return PrunePlan(tuple(LayerPlan(geo, tuple(range(geo.num_heads)), tuple(range(geo.num_kv_heads)),
                                     frozenset(heads.heads(i))) for i, geo in enumerate(geometries)), heads, "masked")


def balanced_selection(heads: HeadSet, geometries: Sequence[HeadGeometry], scores: torch.Tensor, dormant_low: bool,
                       per_layer_removed: dict[int, int] | None = None) -> HeadSet:
    """The same number of heads removed from every KV group of a layer (about as many as ``heads`` removes
    there, rounded down), each group's most dormant heads by ``scores`` [layer, head]."""
    chosen = []
    for i, geo in enumerate(geometries):
        r = per_layer_removed[i] if per_layer_removed is not None else len(heads.heads(i)) // geo.num_kv_heads
        if r <= 0:
            continue
        for k in range(geo.num_kv_heads):
            members = list(range(k * geo.group_size, (k + 1) * geo.group_size))
            members.sort(key=lambda h: float(scores[i, h]) * (1 if dormant_low else -1))
            chosen += [(i, h) for h in members[:r]]
    return HeadSet.from_pairs(chosen)


# ---------------------------------------------------------------------------------------------------------------
# Export layouts: which plan a head set ships as, and what each option costs.


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # "uniform" | "per-layer" | "masked"
    plan: PrunePlan
    reason: str
    options: dict  # layout -> cost summary


def costs(plan: PrunePlan, hidden_size: int, bytes_per_value: int) -> dict:
    """What a plan keeps: query heads (the heads left computing, for a masked plan), KV heads, attention parameters,
    KV cache per token, the per-layer shapes."""
    masked = plan.kind == "masked"
    return {
        "query_heads": sum(len(lp.kept_heads) for lp in plan.layers) if masked else sum(n for n, _ in plan.shapes),
        "kv_heads": sum(k for _, k in plan.shapes),
        "attention_params": plan.attention_params(hidden_size),
        "kv_cache_bytes_per_token": plan.kv_cache_bytes_per_token(bytes_per_value),
        "shapes": sorted(set(plan.shapes)),
    }


def shapes_summary(shapes: Sequence[tuple[int, int]], head_dim: int, bytes_per_value: int) -> dict:
    """Query slots, KV heads and KV cache per token of a model with these per-layer (query, KV) head counts."""
    return {"query_heads": sum(h for h, _ in shapes), "kv_heads": sum(k for _, k in shapes),
            "kv_cache_bytes_per_token": sum(2 * k for _, k in shapes) * head_dim * bytes_per_value}


class Planner:
    """Turns head sets into the plans they ship as under one model's geometry and config. Each (head set, layout)
    is planned once and remembered: the search, the verification and the export ask the same planner."""

    def __init__(self, geometries: Sequence[HeadGeometry], arch: "ArchAdapter", config, bytes_per_value: int):
        self.geometries, self.arch, self.config = list(geometries), arch, config
        self.bytes_per_value = bytes_per_value
        self._choices: dict[tuple[HeadSet, str], LayoutChoice] = {}

    def _valid(self, num_heads: int) -> bool:
        return self.arch.valid_num_heads(self.config, num_heads)

    def exact(self, heads: HeadSet) -> PrunePlan:
        """The cheapest exact per-layer plan (a per-layer config carries any head counts)."""
        return plan_exact(heads, self.geometries)

    def costs(self, plan: PrunePlan) -> dict:
        return costs(plan, self.config.hidden_size, self.bytes_per_value)

    def savings(self, heads: HeadSet, layout: str) -> dict:
        """What the model that ships for ``heads`` under ``layout`` saves against the original, and the deployment
        efficiency: attention parameters removed from the export / q, k, v, o parameters of the heads zeroed."""
        hidden = self.config.hidden_size
        choice = self.choose(heads, layout)
        original = plan_masked(HeadSet(), self.geometries)
        before, after = self.costs(original), self.costs(choice.plan)
        flops_before = attention_flops_per_token(original, hidden)
        flops_after = flops_before if choice.layout == "masked" else attention_flops_per_token(choice.plan, hidden)
        zeroed = zeroed_params(heads, self.geometries, hidden)
        removed = before["attention_params"] - after["attention_params"]
        return {"layout": choice.layout, "query_slots": after["query_heads"] if choice.layout != "masked"
                else before["query_heads"], "kv_heads": after["kv_heads"],
                "attention_params": after["attention_params"], "attention_params_removed": removed,
                "kv_cache_bytes_per_token": after["kv_cache_bytes_per_token"],
                "kv_cache_removed": before["kv_cache_bytes_per_token"] - after["kv_cache_bytes_per_token"],
                "attention_flops_per_token": flops_after, "attention_flops_removed": flops_before - flops_after,
                "flops_context": FLOPS_CONTEXT, "zeroed_params": zeroed,
                "deployment_efficiency": round(removed / zeroed, 6) if zeroed else 1.0}

    def choose(self, heads: HeadSet, layout: str) -> LayoutChoice:
        if layout not in LAYOUTS:
            raise UserError(f"`layout` {layout!r} is not one of {', '.join(LAYOUTS)}")
        key = (heads, layout)
        if key not in self._choices:
            self._choices[key] = self._choose(heads, layout)
        return self._choices[key]

    def _options(self, heads: HeadSet) -> tuple[PrunePlan, PrunePlan | None, dict]:
        exact = self.exact(heads)
        options = {"per-layer": self.costs(exact), "masked": self.costs(plan_masked(heads, self.geometries))}
        options["masked"]["attention_params"] = plan_masked(HeadSet(), self.geometries).attention_params(
            self.config.hidden_size)
        try:
            uniform = plan_uniform(heads, self.geometries, self._valid)
            options["uniform"] = self.costs(uniform)
        except UserError:
            uniform = None
        return exact, uniform, options

    def _choose(self, heads: HeadSet, layout: str) -> LayoutChoice:
        exact, uniform, options = self._options(heads)
        if layout == "masked":
            return LayoutChoice("masked", plan_masked(heads, self.geometries),
                                "masked layout requested: original shapes, no speed-up", options)
        if layout == "uniform":
            if uniform is None:
                raise UserError("`layout` uniform needs every layer to share one head geometry; use `layout` per-layer")
            return LayoutChoice("uniform", uniform, "uniform layout requested", options)
        if layout == "per-layer":
            return LayoutChoice("per-layer", exact, "per-layer layout requested", options)
        return self._auto(heads, exact, uniform, options)

    def _auto(self, heads, exact, uniform, options) -> LayoutChoice:
        shape = exact.shapes[0]
        if exact.is_uniform and all(lp.slots for lp in exact.layers) and self._valid(shape[0]):
            exact = PrunePlan(exact.layers, heads, "uniform")
            return LayoutChoice("uniform", exact, f"every layer keeps {shape[0]} query and {shape[1]} KV heads: a "
                                "stock config loads it anywhere, no remote code", options)
        if uniform is not None and options["uniform"]["attention_params"] <= options["per-layer"]["attention_params"]:
            return LayoutChoice("uniform", uniform, f"a uniform {uniform.shapes[0]} layout costs no more attention "
                                "parameters than per-layer shapes here, and a stock config loads it anywhere, no "
                                "remote code", options)
        saved = options["uniform"]["attention_params"] - options["per-layer"]["attention_params"] if uniform else None
        why = "layers keep different head counts"
        if saved:
            why += (f"; uniform would pad every layer to {options['uniform']['shapes'][0]} and keep {saved:,} more "
                    "attention parameters")
        return LayoutChoice("per-layer", exact, why + " (loads where prune-heads is installed, in vLLM through its "
                            "plugin, or with trust_remote_code=True)", options)


def attention_flops_per_token(plan: PrunePlan, hidden_size: int, context: int = FLOPS_CONTEXT) -> int:
    """Multiply-adds x 2 of one token through every layer's attention: the q/k/v/o projections, and the scores and
    the weighted sum of values over ``context`` positions (per query slot)."""
    return sum(2 * hidden_size * lp.geometry.head_dim * (2 * lp.num_heads + 2 * lp.num_kv_heads)
               + 4 * lp.num_heads * lp.geometry.head_dim * context for lp in plan.layers)


def zeroed_params(heads: HeadSet, geometries, hidden_size: int) -> int:
    """q, k, v, o weight parameters of the zeroed heads: q and o of each head, k and v of each KV group zeroed whole."""
    total = 0
    for layer, geo in enumerate(geometries):
        removed = set(heads.heads(layer))
        whole = sum(all(h in removed for h in range(k * geo.group_size, (k + 1) * geo.group_size))
                    for k in range(geo.num_kv_heads))
        total += hidden_size * geo.head_dim * 2 * (len(removed) + whole)
    return total


def objective_value(objective: str, point) -> float:
    """The quantity the search's objective maximises, for a search point carrying its savings."""
    if objective == "heads" or point.savings is None:
        return point.num_heads
    key = {"params": "attention_params_removed", "kv-cache": "kv_cache_removed",
           "flops": "attention_flops_removed"}[objective]
    return point.savings[key]


def planner_for(lm) -> Planner:
    return Planner(lm.arch.geometries(lm.model), lm.arch, lm.config, torch.finfo(lm.dtype).bits // 8)


