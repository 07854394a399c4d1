"""Per-layer attention head counts on stock transformers decoders: what a per-layer export needs to load.

A per-layer export's ``config.json`` is its family's stock config with ``model_type`` ``pruned_<family>`` and one
extra field, ``per_layer_heads``: ``[[query_heads, kv_heads], ...]`` per decoder layer (``[0, 0]``: the layer kept
no heads and has no attention). The global head counts stay the original model's, so the stock config's validation
and everything else that reads them (rotary sizes, Gemma's query scaling, Phi-3's head_dim) behave as in the original.

``Pruned<Family>ForCausalLM`` is the stock class with each layer's attention rebuilt from a copy of the config holding
that layer's two counts, so every family keeps its own computation (q/k norms, soft-caps, sliding windows, fused qkv).
``import prune_heads`` registers the configs with ``AutoConfig`` (each model class joins ``AutoModelForCausalLM`` when
its first config is built, so the import stays cheap): ``AutoModelForCausalLM.from_pretrained(export)`` then loads it
with no remote code. This module imports torch and transformers only: the export ships its own text as
``modeling_pruned.py`` (with ``auto_map``) for readers without prune-heads (``trust_remote_code=True``).
"""
from __future__ import annotations

import copy
import importlib

import torch
from torch import nn

MODEL_TYPE_PREFIX = "pruned_"
CLASS_PREFIX = "Pruned"  # PrunedLlamaConfig, PrunedLlamaForCausalLM, ...
HEADS_FIELD = "per_layer_heads"
# family (the stock model_type) -> (its transformers module, config class, causal LM class)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM"),
}
_CLASSES: dict[str, tuple[type, type | None]] = {}


class SkippedAttention(nn.Module):
    """A layer whose heads were all removed: attention adds nothing to the residual stream (no parameters).

    With a KV cache it still records how many tokens it has seen, in one zero of width 1 per token (transformers
    reads the cache's length from layer 0, which may be this one), so positions stay right during generation."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # "past_key_values" before transformers 5.25
        if cache is not None:
            batch, length = hidden_states.shape[:2]
            seen = hidden_states.new_zeros(batch, 1, length, 1)  # [B, 1, S, 1]
            cache.update(seen, seen, self.layer_idx)
        return torch.zeros_like(hidden_states), None


def layer_config(config, num_heads: int, num_kv_heads: int):
    """A shallow copy of ``config`` whose head counts are one layer's (set past the config's validation: the copy
    only feeds that layer's attention)."""
    layer = copy.copy(config)
    layer.__dict__.update(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)
    return layer


def rebuild_attention(model: nn.Module, heads: list) -> None:
    """Give every decoder layer of a stock causal LM the attention its ``[query_heads, kv_heads]`` describe."""
    for i, (layer, (num_heads, num_kv)) in enumerate(zip(model.model.layers, heads)):
        if num_heads == 0:
            layer.self_attn = SkippedAttention(i)
        else:
            layer.self_attn = type(layer.self_attn)(layer_config(model.config, num_heads, num_kv), i)


def pruned_name(stock_name: str) -> str:
    """The name of the per-layer class made from the stock class ``stock_name``."""
    return CLASS_PREFIX + stock_name


def _stock(family: str, index: int) -> type:
    module, *names = FAMILIES[family]
    return getattr(importlib.import_module(f"transformers.models.{module}"), names[index])


def _named(cls: type, name: str) -> type:
    """A class made here, findable by name in this module (pickling, ``auto_map``)."""
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    globals()[name] = cls
    return cls


def pruned_config_class(family: str) -> type:
    """``Pruned<Config>``: the family's stock config under model type ``pruned_<family>``, carrying per_layer_heads."""
    if family not in _CLASSES:
        stock = _stock(family, 0)

        def __post_init__(self, **kwargs):
            stock.__post_init__(self, **kwargs)
            pruned_model_class(family)  # joins AutoModelForCausalLM before from_pretrained looks the config up

        attrs = {"model_type": MODEL_TYPE_PREFIX + family, "__post_init__": __post_init__}
        name = pruned_name(stock.__name__)
        _CLASSES[family] = (_named(type(stock)(name, (stock,), attrs), name), None)
    return _CLASSES[family][0]


def pruned_model_class(family: str) -> type:
    """``Pruned<Family>ForCausalLM``: the stock class, each layer's attention built with its own head counts."""
    config_class, model_class = _CLASSES.get(family) or (pruned_config_class(family), None)
    if model_class is None:
        stock = _stock(family, 1)

        def __init__(self, config):
            stock.__init__(self, config)
            rebuild_attention(self, getattr(config, HEADS_FIELD))
            self.post_init()

        name = pruned_name(stock.__name__)
        model_class = _named(type(stock)(name, (stock,), {"config_class": config_class, "__init__": __init__}), name)
        _CLASSES[family] = (config_class, model_class)
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
    return model_class


def pruned_classes(family: str) -> tuple[type, type]:
    """(config class, causal LM class) of ``family``'s per-layer exports."""
    return pruned_config_class(family), pruned_model_class(family)


def register() -> None:
    """Every family's per-layer config joins AutoConfig (what ``import prune_heads`` does)."""
    from transformers import AutoConfig

    for family in FAMILIES:
        AutoConfig.register(MODEL_TYPE_PREFIX + family, pruned_config_class(family), exist_ok=True)


def __getattr__(name: str):
    """``PrunedLlamaForCausalLM`` and the rest by name, before their first use (unpickling, ``auto_map``)."""
    for family in FAMILIES:
        config_name, model_name = (pruned_name(n) for n in FAMILIES[family][1:])
        if name in (config_name, model_name):
            pruned_classes(family)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
