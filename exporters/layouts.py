"""Which export layout a selection gets, and what each option costs.

- ``uniform``: every layer has the same query/KV head counts: a stock config, no remote code.
- ``per-layer``: head counts differ per layer (``per_layer_config`` plus a small modelling file).
- ``masked``: original shapes with the removed heads' o_proj columns zeroed: exact, loads anywhere, no speed-up.
``auto`` takes uniform when the exact per-layer shapes already agree (nothing is left on the table), else per-layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from prune_heads.errors import UserError
from prune_heads.heads import HeadSet
from prune_heads.models.adapters import ArchAdapter, AttentionLayout
from prune_heads.pruning import PrunePlan, plan_exact, plan_masked, plan_uniform

LAYOUTS = ("auto", "uniform", "per-layer", "masked")


@dataclass
class LayoutChoice:
    layout: str  # "uniform" | "per-layer" | "masked"
    plan: PrunePlan
    reason: str
    options: dict  # layout -> cost summary


def exact_plan(heads: HeadSet, layouts: list[AttentionLayout], adapter: ArchAdapter, config) -> PrunePlan:
    """The cheapest exact per-layer plan whose head counts this family's config accepts."""
    return plan_exact(heads, layouts, lambda h: adapter.valid_num_heads(config, h))


def costs(plan: PrunePlan, hidden_size: int, bytes_per_value: int) -> dict:
    return {
        "query_heads": sum(n for n, _ in plan.shapes) if plan.kind != "masked" else sum(len(lp.kept_heads) for lp in plan.layers),
        "kv_heads": sum(k for _, k in plan.shapes),
        "attention_params": plan.attention_params(hidden_size),
        "kv_cache_bytes_per_token": plan.kv_cache_bytes_per_token(bytes_per_value),
        "shapes": sorted(set(plan.shapes)),
    }


def choose_layout(layout: str, heads: HeadSet, layouts: list[AttentionLayout], adapter: ArchAdapter, config,
                  bytes_per_value: int) -> LayoutChoice:
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    hidden = config.hidden_size
    exact = exact_plan(heads, layouts, adapter, config)
    options = {"per-layer": costs(exact, hidden, bytes_per_value),
               "masked": costs(plan_masked(heads, layouts), hidden, bytes_per_value)}
    options["masked"]["attention_params"] = plan_masked(HeadSet(), layouts).attention_params(hidden)
    try:
        uniform = plan_uniform(heads, layouts, lambda h: adapter.valid_num_heads(config, h))
        options["uniform"] = costs(uniform, hidden, bytes_per_value)
    except UserError:
        uniform = None
    if layout == "masked":
        return LayoutChoice("masked", plan_masked(heads, layouts), "masked layout requested: original shapes, no speed-up", options)
    if layout == "uniform":
        if uniform is None:
            raise UserError("--layout uniform needs every layer to share one head geometry; use --layout per-layer")
        return LayoutChoice("uniform", uniform, "uniform layout requested", options)
    per_layer_ok = exact.is_uniform or adapter.export_config(config, exact.shapes) is not None
    if layout == "per-layer":
        if not per_layer_ok:
            raise UserError(f"the {config.model_type} config class cannot carry per_layer_config (its validator reads head "
                            "counts globally); use --layout uniform (exact, padded) or --layout masked")
        return LayoutChoice("per-layer", exact, "per-layer layout requested", options)
    if exact.is_uniform and all(lp.slots for lp in exact.layers):
        exact = PrunePlan(exact.layers, heads, "uniform")
        return LayoutChoice("uniform", exact, f"every layer keeps {exact.shapes[0][0]} query and {exact.shapes[0][1]} KV heads: "
                            "a stock config loads it, no remote code", options)
    if uniform is not None and options["uniform"]["attention_params"] <= options["per-layer"]["attention_params"]:
        return LayoutChoice("uniform", uniform, f"a uniform {uniform.shapes[0]} layout costs no more attention parameters "
                            "than per-layer shapes here, and a stock config loads it, no remote code", options)
    if not per_layer_ok and uniform is not None:
        return LayoutChoice("uniform", uniform, f"layers keep different head counts, but the {config.model_type} config cannot "
                            f"carry per_layer_config; every layer is padded to {uniform.shapes[0]} with zero heads (exact)", options)
    saved = options["uniform"]["attention_params"] - options["per-layer"]["attention_params"] if uniform else None
    why = "layers keep different head counts"
    if saved:
        why += f"; uniform would pad every layer to {options['uniform']['shapes'][0]} and keep {saved:,} more attention parameters"
    return LayoutChoice("per-layer", exact, why + " (loads with trust_remote_code=True)", options)
