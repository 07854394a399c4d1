"""HeadSet -> PrunePlan -> smaller weights.

Stock attention code needs every KV group of a layer to hold the same number of query heads: new query head
``i`` reads new KV head ``i // (H' / K')``. A plan says, per layer, which original query head sits in each new
query slot (``None``: a dummy head with zero weights, used to pad a layer up to a uniform shape) and which
original KV head each new KV slot copies (a KV head may be copied, so unequal groups become equal exactly).

Both the verification ablation (``ablation.ablate_plan``) and the physical slicing (``apply_plan``) are derived
from the same plan, so what is verified is what is shipped.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .errors import UserError
from .heads import HeadSet
from .models.adapters import ArchAdapter, AttentionLayout


@dataclass(frozen=True)
class LayerPlan:
    layout: AttentionLayout  # the original geometry
    slots: tuple[int | None, ...]  # new query head -> original query head (None: zero dummy)
    kv_slots: tuple[int, ...]  # new KV head -> original KV head it copies
    zero_output: frozenset[int] = frozenset()  # original heads kept in place but with o_proj columns zeroed (masked)

    def __post_init__(self):
        if self.slots:
            assert len(self.kv_slots) and len(self.slots) % len(self.kv_slots) == 0, "groups must be equal"
            g = len(self.slots) // len(self.kv_slots)
            for i, h in enumerate(self.slots):
                if h is not None:
                    assert self.kv_slots[i // g] == self.layout.kv_head_of(h), "a query head must read its own KV head"

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
    def is_identity(self) -> bool:
        lay = self.layout
        return self.slots == tuple(range(lay.num_heads)) and self.kv_slots == tuple(range(lay.num_kv_heads)) and not self.zero_output


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
        return sum(2 * lp.num_kv_heads * lp.layout.head_dim * bytes_per_value for lp in self.layers)

    def attention_params(self, hidden_size: int) -> int:
        """q/k/v/o weight parameters (biases and norms aside)."""
        return sum(hidden_size * lp.layout.head_dim * (2 * lp.num_heads + 2 * lp.num_kv_heads) for lp in self.layers)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "layers": [
                {"query_slots": list(lp.slots), "kv_slots": list(lp.kv_slots), "zero_output": sorted(lp.zero_output),
                 "original": {"num_heads": lp.layout.num_heads, "num_kv_heads": lp.layout.num_kv_heads,
                              "head_dim": lp.layout.head_dim}}
                for lp in self.layers
            ],
        }


def _kept_by_group(layout: AttentionLayout, removed: Sequence[int]) -> list[list[int]]:
    gone = set(removed)
    return [[h for h in range(k * layout.group_size, (k + 1) * layout.group_size) if h not in gone]
            for k in range(layout.num_kv_heads)]


def _layer_plan(lay: AttentionLayout, groups: list[list[int]], g: int, k_total: int | None = None) -> LayerPlan:
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
    return LayerPlan(lay, tuple(slots), tuple(kv_slots))


def _cost(num_heads: int, num_kv: int) -> tuple[int, int]:
    """Attention weights per head_dim x hidden (q and o per query head, k and v per KV head); then KV cache."""
    return (2 * num_heads + 2 * num_kv, num_kv)


def plan_exact(heads: HeadSet, layouts: Sequence[AttentionLayout], valid_num_heads=lambda h: True) -> PrunePlan:
    """Per layer, the cheapest exact shape for the kept heads: for each group size g', every KV head with n kept
    query heads gets ceil(n / g') slots (copies of it), short slots are filled with zero dummy heads. g' = gcd
    of the kept counts needs no dummies but may copy many KV heads; g' = the original group size copies none
    but may keep dummies. The cheapest in attention parameters wins (then the smaller KV cache). A layer losing
    every head keeps none (per-layer layout only)."""
    layers = []
    for i, lay in enumerate(layouts):
        groups = _kept_by_group(lay, heads.heads(i))
        if not any(groups):
            layers.append(LayerPlan(lay, (), ()))
            continue
        best = None
        for g in range(1, lay.group_size + 1):
            k_new = _uniform_fits(groups, g)
            if not valid_num_heads(k_new * g):
                continue
            key = (_cost(k_new * g, k_new), g)
            if best is None or key < best[0]:
                best = (key, g)
        if best is None:  # no valid shape: keep the layer's shape, removed heads masked
            gone = frozenset(heads.heads(i))
            layers.append(LayerPlan(lay, tuple(range(lay.num_heads)), tuple(range(lay.num_kv_heads)), gone))
            continue
        layers.append(_layer_plan(lay, groups, best[1]))
    return PrunePlan(tuple(layers), heads, "exact")


def _uniform_fits(groups: list[list[int]], g: int) -> int:
    return sum(math.ceil(len(m) / g) for m in groups if m)


def plan_uniform(heads: HeadSet, layouts: Sequence[AttentionLayout], valid_num_heads=lambda h: True,
                 hidden_size: int | None = None) -> PrunePlan:
    """Every layer gets the same (H', K'): the cheapest shape that fits every layer's kept heads, padding with
    zero dummy heads where a layer keeps fewer. ``valid_num_heads`` rejects head counts the config refuses."""
    if len({(lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in layouts}) != 1:
        raise UserError("a uniform layout needs a model whose layers all have the same head geometry")
    base = layouts[0]
    all_groups = [_kept_by_group(lay, heads.heads(i)) for i, lay in enumerate(layouts)]
    best = None
    for g in range(1, base.group_size + 1):
        k_new = max(1, max(_uniform_fits(groups, g) for groups in all_groups))
        while not valid_num_heads(k_new * g):
            k_new += 1
        cost = _cost(k_new * g, k_new)
        if best is None or cost < best[0]:
            best = (cost, g, k_new)
    _, g, k_new = best
    layers = [_layer_plan(lay, groups, g, k_new) for lay, groups in zip(layouts, all_groups)]
    return PrunePlan(tuple(layers), heads, "uniform")


def plan_masked(heads: HeadSet, layouts: Sequence[AttentionLayout]) -> PrunePlan:
    """Original shapes; removed heads' o_proj columns are zeroed."""
    return PrunePlan(tuple(LayerPlan(lay, tuple(range(lay.num_heads)), tuple(range(lay.num_kv_heads)),
                                     frozenset(heads.heads(i))) for i, lay in enumerate(layouts)), heads, "masked")


def balanced_selection(heads: HeadSet, layouts: Sequence[AttentionLayout], scores: torch.Tensor, dormant_low: bool,
                       per_layer_removed: dict[int, int] | None = None) -> HeadSet:
    """The same number of heads removed from every KV group of a layer (about as many as ``heads`` removes
    there, rounded down), each group's most dormant heads by ``scores`` [layer, head]."""
    chosen = []
    for i, lay in enumerate(layouts):
        r = per_layer_removed[i] if per_layer_removed is not None else len(heads.heads(i)) // lay.num_kv_heads
        if r <= 0:
            continue
        for k in range(lay.num_kv_heads):
            members = list(range(k * lay.group_size, (k + 1) * lay.group_size))
            members.sort(key=lambda h: float(scores[i, h]) * (1 if dormant_low else -1))
            chosen += [(i, h) for h in members[:r]]
    return HeadSet.from_pairs(chosen)


# ---------------------------------------------------------------------------------------------------------------
# Slicing


def _rows(weight: torch.Tensor, index: Sequence[int | None], block: int) -> torch.Tensor:
    """Stack blocks of ``block`` rows (dim 0), zeros for None."""
    parts = [weight[h * block:(h + 1) * block] if h is not None else torch.zeros_like(weight[:block]) for h in index]
    return torch.cat(parts, dim=0) if parts else weight[:0]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.requires_grad_(False)
    return lin


def sliced_projections(attn: nn.Module, adapter: ArchAdapter, lp: LayerPlan) -> dict[str, nn.Module]:
    """New q/k/v/o (or fused qkv) and norm modules for one layer, as the plan says."""
    d = lp.layout.head_dim
    q_w, q_b, k_w, k_b, v_w, v_b = adapter.qkv_weights(attn)
    o = adapter.output_projection(attn)
    q_slots = lp.slots  # masked heads keep their q rows (only their o_proj columns are zeroed)
    new = {
        "q": (_rows(q_w, q_slots, d), None if q_b is None else _rows(q_b, q_slots, d)),
        "k": (_rows(k_w, lp.kv_slots, d), None if k_b is None else _rows(k_b, lp.kv_slots, d)),
        "v": (_rows(v_w, lp.kv_slots, d), None if v_b is None else _rows(v_b, lp.kv_slots, d)),
    }
    o_index = [None if (h is None or h in lp.zero_output) else h for h in lp.slots]
    o_w = _rows(o.weight.T, o_index, d).T.contiguous()
    modules = adapter.build_qkv(attn, new)
    modules["o_proj"] = _linear(o_w, o.bias)
    modules.update(adapter.sliced_norms(attn, lp))
    return modules


class SkippedAttention(nn.Module):
    """A layer whose heads were all removed: attention adds nothing to the residual stream (no parameters)."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


def apply_plan(model: nn.Module, adapter: ArchAdapter, plan: PrunePlan) -> None:
    """Replace every layer's attention weights in place (the caller owns ``model``; pass a copy to keep the original)."""
    for i, lp in enumerate(plan.layers):
        attn = adapter.attention(model, i)
        if lp.is_identity:
            continue
        if not lp.slots:
            adapter.decoder_layers(model)[i].self_attn = SkippedAttention()
            continue
        for name, module in sliced_projections(attn, adapter, lp).items():
            setattr(attn, name, module)
        attn.num_key_value_groups = (lp.num_heads // lp.num_kv_heads) if lp.num_kv_heads else 0
        for attr in ("num_heads", "num_attention_heads"):
            if hasattr(attn, attr):
                setattr(attn, attr, lp.num_heads)
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = lp.num_kv_heads
        # Some families (Phi-3) read head counts from the module's config at forward time: give the layer its own.
        layer_config = copy.copy(attn.config)
        layer_config.__dict__["num_attention_heads"] = lp.num_heads
        layer_config.__dict__["num_key_value_heads"] = lp.num_kv_heads
        attn.config = layer_config


def pruned_copy(model: nn.Module, adapter: ArchAdapter, plan: PrunePlan) -> nn.Module:
    """A deep copy of ``model`` with the plan applied (the original is left untouched). The copy is a plain model:
    a GGUF source was dequantised on load, so its quantizer flags (which forbid casting and training) are dropped."""
    new = copy.deepcopy(model)
    apply_plan(new, adapter, plan)
    new.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        new.__dict__.pop(attr, None)
    return new
