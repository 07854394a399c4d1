"""vLLM plugin: serves per-layer exports (model type ``pruned_<family>``, see prune_heads.runtime).

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process it starts. It registers the
``pruned_<family>`` configs with transformers' AutoConfig and, with vLLM's ModelRegistry, ``Pruned<Family>ForCausalLM``
for each family vLLM implements natively (OLMo-2 has no native vLLM class: not served).

Each class is vLLM's own causal LM for the family. While it is built, vLLM's ``make_layers`` builds layer ``i`` with the
config's global head counts set to ``per_layer_heads[i]``, so every decoder layer gets attention, q/k/v/o shapes and a
KV cache of its own width (vLLM's KV cache manager keeps one spec per attention layer, as for DeciLM). A layer that
kept no heads is built whole, then its attention is replaced by ``NoAttention`` (no parameters, output zero) and
unregistered from the forward context, so it holds no KV cache. Nothing here runs unless vLLM loads the plugin; the
module imports vLLM only when vLLM asks for one of the classes.
"""
from __future__ import annotations

import contextlib
import importlib
import re
import sys

from prune_heads.runtime import FAMILIES, HEADS_FIELD, pruned_name
from prune_heads.runtime import register as register_configs

# family -> vLLM's module and causal LM class for it (vllm.model_executor.models.<module>). vLLM's Qwen2Attention
# derives head_dim from hidden_size / heads, which a layer with fewer heads breaks; Qwen2 is Llama with q/k/v biases,
# and vLLM's Llama reads an explicit head_dim and takes those biases from ``qkv_bias`` (VLLM_CONFIG).
VLLM_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
VLLM_CONFIG = {"qwen2": {"qkv_bias": True, "attention_bias": False}}
_BUILT: dict[str, type] = {}


def class_name(family: str) -> str:
    """The architecture name a per-layer export's config.json gives (prune_heads.runtime's model class)."""
    return pruned_name(FAMILIES[family][2])


def register() -> None:
    """vLLM's entry point: the configs with AutoConfig, the model classes with ModelRegistry (lazily, by name)."""
    from vllm import ModelRegistry

    register_configs()
    for family in VLLM_CLASSES:
        ModelRegistry.register_model(class_name(family), f"{__name__}:{class_name(family)}")


def _no_attention_class():
    from torch import nn

    class NoAttention(nn.Module):
        """A layer that kept no heads: adds nothing to the residual stream, holds no KV cache."""

        def forward(self, positions=None, hidden_states=None, **kwargs):
            return hidden_states.new_zeros(hidden_states.shape)

    return NoAttention


@contextlib.contextmanager
def _layer_counts(hf_config, num_heads: int, num_kv_heads: int):
    """The config's global head counts set to one layer's while that layer is built (past its validation)."""
    saved = {k: hf_config.__dict__[k] for k in ("num_attention_heads", "num_key_value_heads")}
    hf_config.__dict__.update(num_attention_heads=num_heads or saved["num_attention_heads"],
                              num_key_value_heads=num_kv_heads or saved["num_key_value_heads"])
    try:
        yield
    finally:
        hf_config.__dict__.update(saved)


def _per_layer_make_layers(make_layers, vllm_config):
    """vLLM's make_layers, building layer ``i`` with ``per_layer_heads[i]``; an emptied layer loses its attention."""
    hf_config = vllm_config.model_config.hf_config
    heads = getattr(hf_config, HEADS_FIELD)
    context = vllm_config.compilation_config.static_forward_context
    no_attention = _no_attention_class()

    def built(layer_fn, prefix: str):
        index = int(re.search(r"(\d+)$", prefix).group(1))
        num_heads, num_kv = heads[index]
        with _layer_counts(hf_config, num_heads, num_kv):
            layer = layer_fn(prefix=prefix)
        if num_heads == 0:
            layer.self_attn = no_attention()
            for name in [n for n in context if n.startswith(f"{prefix}.self_attn.")]:
                del context[name]
        return layer

    def per_layer(num_hidden_layers, layer_fn, prefix):
        return make_layers(num_hidden_layers, lambda prefix: built(layer_fn, prefix), prefix)

    return per_layer


@contextlib.contextmanager
def _per_layer_building(vllm_config):
    """Every loaded vLLM model module's ``make_layers`` builds per layer for the duration (a family's model may call
    it from its parent family's module, as Qwen3 from Qwen2's)."""
    from vllm.model_executor.models import utils

    original = utils.make_layers
    patched = _per_layer_make_layers(original, vllm_config)
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("vllm.model_executor.models.") and getattr(m, "make_layers", None) is original]
    for module in modules:
        module.make_layers = patched
    try:
        yield
    finally:
        for module in modules:
            module.make_layers = original


def _pruned_class(family: str) -> type:
    if family not in _BUILT:
        module, name = VLLM_CLASSES[family]
        stock = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)

        def __init__(self, *, vllm_config, prefix: str = ""):
            vllm_config.model_config.hf_config.__dict__.update(VLLM_CONFIG.get(family, {}))
            with _per_layer_building(vllm_config):
                stock.__init__(self, vllm_config=vllm_config, prefix=prefix)

        cls = type(stock)(class_name(family), (stock,), {"__init__": __init__, "__module__": __name__})
        _BUILT[family] = cls
    return _BUILT[family]


def __getattr__(name: str):
    """vLLM's registry imports this module and asks for ``Pruned<Family>ForCausalLM`` by name."""
    for family in VLLM_CLASSES:
        if name == class_name(family):
            return _pruned_class(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
