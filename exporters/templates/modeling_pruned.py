"""Per-layer attention head counts on a stock transformers decoder. Written by prune-heads.

The checkpoint's config.json is the stock config plus ``per_layer_config`` (per-layer ``num_attention_heads`` and
``num_key_value_heads``; ``skip: ["self_attn"]`` for a layer that kept no heads). This class builds the stock model,
then rebuilds each layer's attention from ``config.per_layer_config[i]``, which is what transformers does natively
for models whose modelling reads that field; the same weights then load with no remote code.
"""
import torch
from torch import nn

import transformers

BASE_ARCHITECTURE = "{{BASE_ARCHITECTURE}}"
_Base = getattr(transformers, BASE_ARCHITECTURE)


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


class PrunedForCausalLM(_Base):
    def __init__(self, config):
        # The stock constructor reads head counts from the global config; it is told to, then each layer's
        # attention is rebuilt from its own per-layer config.
        config.allow_global_per_layer_attribute_access = True
        try:
            super().__init__(config)
        finally:
            config.allow_global_per_layer_attribute_access = False
        for i, layer in enumerate(self.model.layers):
            layer_config = config.per_layer_config[i]
            if "self_attn" in (getattr(layer_config, "skip", None) or []):
                layer.self_attn = SkippedAttention(i)
            else:
                layer.self_attn = type(layer.self_attn)(layer_config, i)
        self.post_init()
