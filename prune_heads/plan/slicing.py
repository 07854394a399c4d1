"""PrunePlan -> smaller weights: each layer's q/k/v/o (and cross-head norms) sliced as the plan says.

The plan (planner.py) decides which original head sits in each new slot; this module only moves rows and columns.
How a family stores its projections and how its modules learn their new head counts is its architecture
adapter's business.
"""
from __future__ import annotations

import copy

from torch import nn

from prune_heads.models.adapters import ArchAdapter
from prune_heads.models.geometry import frozen_linear, head_rows
from prune_heads.plan.planner import LayerPlan, PrunePlan


def sliced_projections(attn: nn.Module, arch: ArchAdapter, lp: LayerPlan) -> dict[str, nn.Module]:
    """New q/k/v/o (or fused qkv) and norm modules for one layer, as the plan says."""
    d = lp.geometry.head_dim
    q_w, q_b, k_w, k_b, v_w, v_b = arch.qkv_weights(attn)
    o = arch.output_projection(attn)
    q_slots = lp.slots  # masked heads keep their q rows (only their o_proj columns are zeroed)
    new = {
        "q": (head_rows(q_w, q_slots, d), None if q_b is None else head_rows(q_b, q_slots, d)),
        "k": (head_rows(k_w, lp.kv_slots, d), None if k_b is None else head_rows(k_b, lp.kv_slots, d)),
        "v": (head_rows(v_w, lp.kv_slots, d), None if v_b is None else head_rows(v_b, lp.kv_slots, d)),
    }
    o_index = [None if (h is None or h in lp.zero_output) else h for h in lp.slots]
    o_w = head_rows(o.weight.T, o_index, d).T.contiguous()
    modules = arch.build_qkv(attn, new)
    modules["o_proj"] = frozen_linear(o_w, o.bias)
    modules.update(arch.sliced_norms(attn, lp.slots, lp.kv_slots, d))
    return modules


def apply_plan(model: nn.Module, arch: ArchAdapter, plan: PrunePlan) -> None:
    """Replace every layer's attention weights in place (the caller owns ``model``; pass a copy to keep the
    original)."""
    for i, lp in enumerate(plan.layers):
        apply_layer_plan(model, arch, i, lp)


def apply_layer_plan(model: nn.Module, arch: ArchAdapter, layer: int, lp: LayerPlan) -> None:
    """One layer of ``apply_plan``: its attention sliced in place (removed when it keeps no heads)."""
    if lp.is_identity:
        return
    if not lp.slots:
        arch.remove_attention(model, layer)
        return
    attn = arch.attention(model, layer)
    for name, module in sliced_projections(attn, arch, lp).items():
        setattr(attn, name, module)
    arch.set_head_counts(attn, lp.num_heads, lp.num_kv_heads)


def pruned_copy(model: nn.Module, arch: ArchAdapter, plan: PrunePlan, share: bool = False) -> nn.Module:
    """A copy of ``model`` with the plan applied (the original is left untouched). With ``share`` every parameter the
    plan does not slice (embeddings, MLPs, norms) is the original's own tensor, so the copy costs only its new
    attention weights; only for a copy nobody trains or edits in place (healing merges LoRA into its weights: it needs
    ``share=False``). The copy is a plain model: a GGUF source was dequantised on load, so its quantizer flags (which
    forbid casting and training) are dropped."""
    memo = {id(p): p for p in model.parameters()} if share else {}
    new = copy.deepcopy(model, memo)
    apply_plan(new, arch, plan)
    new.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        new.__dict__.pop(attr, None)
    return new
