"""PrunePlan -> smaller weights: each layer's q/k/v/o (and cross-head norms) sliced as the plan says, and a LoRA
adapter's tensors with them.

LoRA: q_proj's lora_B rows follow the query slots, k_proj/v_proj's follow the KV slots (copied KV heads copy their
rows, zero heads get zero rows), and o_proj's lora_A columns follow the query slots (removed or zero heads get zero
columns). LoRA biases and DoRA magnitudes of q/k/v are sliced like their rows. A layer that kept no heads keeps no
attention adapter. DoRA on o_proj is refused: its column norms change when columns go; so is DoRA on q_proj when the
export has zero padding heads, whose row norms are zero.

The plan (planner.py) decides which original head sits in each new slot; this module only moves rows and columns.
How a family stores its projections and how its modules learn their new head counts is its architecture
adapter's business.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from prune_heads.errors import UserError
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


def sliced_lora_state(state: dict[str, torch.Tensor], plan: PrunePlan, arch: ArchAdapter) -> dict[str, torch.Tensor]:
    """A LoRA adapter's state dict (peft's names) for the pruned model: attention tensors sliced as the plan says, a
    removed layer's dropped, every other tensor (MLP, embeddings) as it was."""
    pattern = arch.attention_key()
    sliced = {}
    for name, tensor in state.items():
        m = pattern.search(name)
        if not m:
            sliced[name] = tensor  # not attention (MLP, embeddings): unchanged
            continue
        lp = plan.layers[int(m.group(1))]
        if not lp.slots:
            continue  # the layer's attention was removed entirely
        sliced[name] = sliced_lora_tensor(name, arch.projections[m.group(2)], tensor, lp, arch)
    return sliced


def sliced_lora_tensor(name: str, kind: str, tensor: torch.Tensor, lp: LayerPlan, arch: ArchAdapter) -> torch.Tensor:
    """One LoRA tensor of a projection whose rows (or, for "o", columns) are indexed by heads of ``kind``."""
    d = lp.geometry.head_dim
    is_a = ".lora_A." in name or name.endswith("lora_A.weight")
    if kind == "o":
        if "magnitude" in name:
            raise UserError("DoRA on o_proj cannot be sliced exactly (its column norms change); re-train without "
                            "o_proj in target_modules, or use `layout` masked for the base")
        if not is_a:  # lora_B and lora biases of o_proj act on the hidden size, which does not change
            return tensor
        cols = [None if h is None or h in lp.zero_output else h for h in lp.slots]
        return head_rows(tensor.T, cols, d).T.contiguous()
    if is_a:  # lora_A of q/k/v acts on the (unchanged) hidden size
        return tensor
    if "magnitude" in name and kind in ("q", "qkv") and any(h is None for h in lp.slots):
        # DoRA divides by the norm of each row of W + BA; a zero padding head's rows are all zero, so that is 0 / 0.
        raise UserError("this adapter uses DoRA on the query projection, and the export pads some layers with zero "
                        "query heads, whose DoRA norm would be 0 / 0 (NaN); export with `layout` masked, or use a LoRA "
                        "adapter without DoRA on q_proj")
    if kind == "qkv":  # fused [q | k | v] rows (Phi-3)
        q, k, v = arch.split_qkv_rows(tensor, lp.geometry)
        return torch.cat([head_rows(q, lp.slots, d), head_rows(k, lp.kv_slots, d),
                          head_rows(v, lp.kv_slots, d)]).contiguous()
    return head_rows(tensor, lp.slots if kind == "q" else lp.kv_slots, d).contiguous()
