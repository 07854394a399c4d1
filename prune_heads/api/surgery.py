"""``ablate`` and ``prune``: heads zeroed while a block runs, or cut out of the model object for good.

Both read the heads through the plan the export ships (``plan.planner``): ``ablate`` zeroes exactly what ``prune``
removes (for OLMo-2, whose q/k norms span heads, the norms over the heads that stay), so a model pruned after an
ablated evaluation computes what was evaluated.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from prune_heads.api.held import Heads, heads_of, in_place, is_peft
from prune_heads.errors import NotSliceable, UserError
from prune_heads.models.adapters import ArchAdapter
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import HeadAblation
from prune_heads.plan.planner import PrunePlan, planner_for
from prune_heads.plan.slicing import apply_plan, sliced_lora_state
from prune_heads.runtime import MODEL_TYPE_PREFIX, pruned_classes

# What a pruned model's config records (saved in config.json by save_pretrained): the removed heads and the plan.
CONFIG_RECORD = "prune_heads"


@contextmanager
def ablate(model: nn.Module, heads: Heads) -> Iterator[nn.Module]:
    """``with prune_heads.ablate(model, {3: [0, 5]}):`` the model computes with those heads' outputs zeroed (the
    mechanism verification uses: a pre-hook on each layer's output projection); on exit, exception or not, it
    computes as before (no weight is changed). ``heads``: ``{layer: [head, ...]}`` or a HeadSelection."""
    lm = in_place(model)
    chosen = heads_of(heads, lm)
    target = planner_for(lm).choose(chosen, "auto").plan if lm.arch.qk_norm == "across_heads" and chosen else chosen
    ablation = HeadAblation(lm)
    with ablation:
        ablation.set_mask(target)
        yield model


def prune(model: nn.Module, heads: Heads, *, layout: str = "auto") -> nn.Module:
    """Remove ``heads`` from ``model`` for good, in place, and return it: each layer's q/k/v/o rows and columns sliced
    by the plan the command line's export ships (grouped-query attention respected: a KV head goes when its whole
    group goes; ``layout`` auto, uniform, per-layer or masked as ``--layout``), its config updated.
    ``model.save_pretrained(DIR)`` then writes a checkpoint that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads
    (stock transformers for the uniform and masked layouts; after ``import prune_heads`` for per-layer head counts).
    A peft PeftModel is pruned with its LoRA adapter sliced to fit (what ``prune-heads adapt`` does to a saved one)."""
    lm = in_place(model)
    chosen = heads_of(heads, lm)
    choice = planner_for(lm).choose(chosen, layout)
    config = _pruned_config(lm, choice.plan, choice.layout)
    _check_sliceable(lm.model, lm.arch)
    if is_peft(model):
        return _pruned_peft(model, lm, choice.plan, config)
    _apply(lm, choice.plan, config)
    return model


def _pruned_config(lm: LoadedModel, plan: PrunePlan, layout: str):
    """The pruned model's config (the plan's head counts; the original ones for masked), with the plan recorded."""
    shapes = ([(g.num_heads, g.num_kv_heads) for g in lm.arch.geometries(lm.model)] if layout == "masked"
              else plan.shapes)
    config = lm.arch.export_config(lm.config, shapes)
    if config is None:
        raise UserError(f"the {lm.config.model_type} config cannot describe the head counts {sorted(set(shapes))}; "
                        "use `layout` masked")
    family = config.model_type.removeprefix(MODEL_TYPE_PREFIX)
    if config.model_type.startswith(MODEL_TYPE_PREFIX):
        config.architectures = [pruned_classes(family)[1].__name__]
    else:
        config.architectures = [lm.arch.causal_lm_class_name(config)]
    setattr(config, CONFIG_RECORD, {"layout": layout, "removed": plan.removed.to_json(), "plan": plan.to_json()})
    return config


def _apply(lm: LoadedModel, plan: PrunePlan, config) -> None:
    """The plan applied to the model's weights and its config replaced; quantizer flags of a dequantised GGUF source
    dropped (the weights are plain tensors now)."""
    apply_plan(lm.model, lm.arch, plan)
    config.dtype = lm.dtype
    lm.model.config = config
    lm.model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        lm.model.__dict__.pop(attr, None)


def _check_sliceable(model: nn.Module, arch: ArchAdapter) -> None:
    """Every attention projection a plain floating-point linear layer (a LoRA layer's base included)."""
    pattern = arch.attention_key()
    for name, module in model.named_modules():
        found = pattern.search("." + name + ".weight") if "self_attn" in name else None
        weight = getattr(getattr(module, "base_layer", module), "weight", None)
        if found and isinstance(weight, torch.Tensor) and found.group(3) == "weight" and (
                not weight.dtype.is_floating_point or type(module).__module__.split(".")[0] in QUANTISED):
            raise NotSliceable(f"{name} is a quantised linear layer ({type(module).__name__}, {weight.dtype}), "
                               "whose rows cannot be sliced; load the model unquantised (its dtype float32, "
                               "bfloat16 or float16), prune it, then quantise the pruned model")


QUANTISED = ("bitsandbytes", "auto_gptq", "gptqmodel", "awq", "optimum", "hqq", "torchao")


def _pruned_peft(model, lm: LoadedModel, plan: PrunePlan, config):
    """A PeftModel pruned with its adapter: the adapter's tensors sliced by the plan, the LoRA layers taken off, the
    base pruned, and the adapter put back on the pruned base with the sliced tensors."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    name = model.active_adapter
    peft_config = model.peft_config[name]
    if peft_config.peft_type.value != "LORA":
        raise UserError(f"the model's adapter is {peft_config.peft_type.value}; only LoRA (and DoRA) adapters can be "
                        "sliced: merge it first (model.merge_and_unload())")
    state = sliced_lora_state(get_peft_model_state_dict(model, adapter_name=name), plan, lm.arch)
    base = model.unload()
    pruned = LoadedModel(base, None, lm.arch, lm.source, lm.dtype, lm.device)
    _apply(pruned, plan, config)
    result = get_peft_model(base, peft_config, adapter_name=name)
    set_peft_model_state_dict(result, state, adapter_name=name)
    return result.eval()
