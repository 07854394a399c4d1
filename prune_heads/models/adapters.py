"""Architecture adapters: the only code that knows a family.

Every supported family follows transformers' decoder layout ``model.model.layers[i].self_attn`` with
separate or fused q/k/v projections, an ``o_proj`` whose input is the concatenation of the head outputs
``[batch, seq, num_heads * head_dim]``, and query head ``h`` reading KV head ``h // group_size``.
What differs is declared here, one small class per family: fused qkv and how to split it, per-head or cross-head
q/k norms, how a module is told its new head counts, which linear layers LoRA targets, how a config carries new
head counts, and a BOS token the evaluation must add.
"""
from __future__ import annotations

import copy
import re
from typing import ClassVar, Sequence

import torch
from torch import nn

from prune_heads.errors import UnsupportedModel
from prune_heads.models.geometry import HeadGeometry, frozen_linear, head_rows
from prune_heads.runtime import HEADS_FIELD, MODEL_TYPE_PREFIX, SkippedAttention, pruned_config_class


class ArchAdapter:
    """Where q/k/v/o live for one family. Subclasses override only what differs."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    # "per_head": q_norm/k_norm act on head_dim (Qwen3, Gemma3): slicing heads keeps them exact.
    # "across_heads": they normalise over all heads together (OLMo-2): removing a head changes the others.
    qk_norm: ClassVar[str | None] = None
    fused_qkv: ClassVar[bool] = False
    # lm-evaluation-harness prepends BOS for these families (HFLM's add_bos_token default for Gemma).
    add_bos_for_eval: ClassVar[bool] = False

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def full_attention(self, config) -> bool:
        """Whether every layer attends to every earlier token (no sliding window): a prompt's tokens then compute the
        same with padding anywhere before them, which the batched generation relies on."""
        types = getattr(config, "layer_types", None)
        if types is not None:
            return all(t == "full_attention" for t in types)
        return getattr(config, "sliding_window", None) is None

    def num_layers(self, model: nn.Module) -> int:
        return len(self.decoder_layers(model))

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.decoder_layers(model)[layer].self_attn

    def output_projection(self, attn: nn.Module) -> nn.Linear:
        return attn.o_proj

    def geometry(self, model: nn.Module, layer: int) -> HeadGeometry:
        """The layer's head counts; a layer whose attention was removed (``SkippedAttention``) has none."""
        attn = self.attention(model, layer)
        if isinstance(attn, SkippedAttention) or not hasattr(attn, "head_dim"):
            return HeadGeometry(0, 0, self.head_dim(model.config))
        head_dim = int(attn.head_dim)
        num_heads = self.output_projection(attn).in_features // head_dim
        num_kv = self._kv_out_features(attn) // head_dim
        return HeadGeometry(num_heads, num_kv, head_dim)

    def geometries(self, model: nn.Module) -> list[HeadGeometry]:
        return [self.geometry(model, i) for i in range(self.num_layers(model))]

    def is_stock(self, model: nn.Module) -> bool:
        """Every layer has its attention and the same head geometry (not an already pruned per-layer export)."""
        layers = self.decoder_layers(model)
        return all(hasattr(layer.self_attn, "o_proj") for layer in layers) and len(set(self.geometries(model))) == 1

    def _kv_out_features(self, attn: nn.Module) -> int:
        return attn.v_proj.out_features

    def value_projection(self, attn: nn.Module) -> tuple[nn.Module, slice | None]:
        """The module whose output holds the value vectors ``[batch, seq, num_kv * head_dim]``, and the slice of
        its last dimension that is V (None: all of it). V never passes through a norm in these families, so the
        projection output is exactly what attention mixes."""
        return attn.v_proj, None

    # -- physical pruning ---------------------------------------------------------------------------------

    def qkv_weights(self, attn: nn.Module):
        """(q_w, q_b, k_w, k_b, v_w, v_b), weights ``[out, hidden]`` with head ``h`` in rows ``h*D:(h+1)*D``."""
        return (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
                attn.v_proj.weight, attn.v_proj.bias)

    def build_qkv(self, attn: nn.Module, new: dict) -> dict[str, nn.Module]:
        return {f"{n}_proj": frozen_linear(*new[n]) for n in ("q", "k", "v")}

    def sliced_norms(self, attn: nn.Module, slots: Sequence[int | None], kv_slots: Sequence[int],
                     head_dim: int) -> dict[str, nn.Module]:
        """Per-head norms (Qwen3, Gemma3) act on head_dim and need nothing; cross-head norms are sliced."""
        return {}

    def set_head_counts(self, attn: nn.Module, num_heads: int, num_kv_heads: int) -> None:
        """Tell a sliced attention module its new head counts (the attributes its forward reads)."""
        attn.num_key_value_groups = (num_heads // num_kv_heads) if num_kv_heads else 0
        for attr in ("num_heads", "num_attention_heads"):
            if hasattr(attn, attr):
                setattr(attn, attr, num_heads)
        if hasattr(attn, "num_key_value_heads"):
            attn.num_key_value_heads = num_kv_heads

    def remove_attention(self, model: nn.Module, layer: int) -> None:
        """A layer that keeps no heads: its attention adds nothing to the residual stream."""
        self.decoder_layers(model)[layer].self_attn = SkippedAttention(layer)

    # -- LoRA adapters (peft) ---------------------------------------------------------------------------

    # Every linear layer a transformer block has (attention and MLP) that LoRA healing trains; lm_head is left alone.
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")
    # How each attention projection's rows are indexed: by query heads ("q"), KV heads ("kv"), fused ("qkv"), or
    # its columns by query heads ("o").
    projections: ClassVar[dict[str, str]] = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "o"}

    def attention_key(self) -> re.Pattern:
        """Matches a state-dict key of an attention projection: groups (layer, projection, rest of the key)."""
        names = "|".join(self.projections)
        return re.compile(rf"\.layers\.(\d+)\.self_attn\.({names})\.(.+)$")

    def split_qkv_rows(self, tensor: torch.Tensor, geo: HeadGeometry) -> tuple[torch.Tensor, ...]:
        """A fused projection's rows as (q, k, v) (fused families only)."""
        raise NotImplementedError(f"{self.name} has no fused qkv projection")

    def across_head_norms(self, attn: nn.Module) -> dict[str, nn.Module]:
        """``{"q": q_norm, "k": k_norm}`` where they normalise over all heads together (empty otherwise)."""
        return {}

    def export_config(self, config, shapes: list[tuple[int, int]]):
        """A config for the pruned model: shared shapes go into the stock config's global fields (explicit
        head_dim; None if its validation refuses them), differing shapes (or a layer left with no heads) into the
        ``pruned_<family>`` config of prune_heads.runtime, which every family can carry."""
        if len(set(shapes)) == 1 and shapes[0][0] > 0:
            return self.uniform_config(config, shapes[0])
        return _per_layer_config(self.name, config, shapes, self.head_dim(config))

    def uniform_config(self, config, shape: tuple[int, int]):
        return _config_with_heads(type(config), config, shape, self.head_dim(config))

    def head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def causal_lm_class_name(self, config) -> str:
        """The transformers class that loads ``config`` as a causal LM (``LlamaForCausalLM``, ...)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]

    def valid_num_heads(self, config, num_heads: int) -> bool:
        return num_heads > 0


def _config_dict(config) -> dict:
    d = config.to_dict()
    for key in ("quantization_config", "per_layer_config", HEADS_FIELD, "_name_or_path", "transformers_version",
                "auto_map", "architectures"):
        d.pop(key, None)
    return d


def _config_with_heads(config_class, config, shape: tuple[int, int], head_dim: int):
    """``config`` rebuilt as ``config_class`` with every layer's query/KV head counts ``shape``; None if the config
    class's validation refuses them."""
    from huggingface_hub.errors import StrictDataclassClassValidationError

    d = _config_dict(config)
    d.update(model_type=config_class.model_type, head_dim=head_dim, num_attention_heads=shape[0],
             num_key_value_heads=shape[1])
    try:
        return config_class(**d)
    except (ValueError, TypeError, StrictDataclassClassValidationError):
        return None


def _per_layer_config(family: str, config, shapes: list[tuple[int, int]], head_dim: int):
    """The ``pruned_<family>`` config (prune_heads.runtime): the original global head counts, each layer's in
    ``per_layer_heads`` (``[0, 0]``: no attention)."""
    d = _config_dict(config)
    d.update(model_type=MODEL_TYPE_PREFIX + family, head_dim=head_dim)
    d[HEADS_FIELD] = [[int(h), int(kv) if h else 0] for h, kv in shapes]
    return pruned_config_class(family)(**d)


class LlamaAdapter(ArchAdapter):
    name = "llama"
    model_types = ("llama",)

    def uniform_config(self, config, shape):
        """LlamaConfig refuses ``hidden_size % num_attention_heads != 0`` even with an explicit head_dim. Mistral's
        decoder is the same computation (RMSNorm, SiLU MLP, RoPE, no biases) and its config accepts any head count,
        so bias-free Llama checkpoints whose new uniform head counts Llama refuses are written as Mistral (stock
        transformers loads them)."""
        cfg = super().uniform_config(config, shape)
        if cfg is not None or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return cfg
        from transformers import MistralConfig

        cfg = _config_with_heads(MistralConfig, config, shape, self.head_dim(config))
        if cfg is not None:
            cfg.sliding_window = None
        return cfg

    def valid_num_heads(self, config, num_heads):
        bias_free = not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
        return num_heads > 0 and (bias_free or config.hidden_size % num_heads == 0)


class MistralAdapter(ArchAdapter):
    name = "mistral"
    model_types = ("mistral",)


class Qwen2Adapter(ArchAdapter):
    name = "qwen2"
    model_types = ("qwen2",)


class Qwen3Adapter(ArchAdapter):
    name = "qwen3"
    model_types = ("qwen3",)
    qk_norm = "per_head"


class Olmo2Adapter(ArchAdapter):
    name = "olmo2"
    model_types = ("olmo2",)
    qk_norm = "across_heads"

    def across_head_norms(self, attn):
        return {"q": attn.q_norm, "k": attn.k_norm}

    def sliced_norms(self, attn, slots, kv_slots, head_dim):
        def sliced(norm, index):
            new = copy.deepcopy(norm)
            new.weight = nn.Parameter(head_rows(norm.weight, index, head_dim), requires_grad=False)
            return new

        return {"q_norm": sliced(attn.q_norm, slots), "k_norm": sliced(attn.k_norm, kv_slots)}


class Gemma2Adapter(ArchAdapter):
    name = "gemma2"
    model_types = ("gemma2",)
    add_bos_for_eval = True

    def valid_num_heads(self, config, num_heads):
        """Gemma-2/3 configs refuse global head counts that do not divide hidden_size (uniform layouts only)."""
        return num_heads > 0 and config.hidden_size % num_heads == 0


class Gemma3TextAdapter(Gemma2Adapter):
    name = "gemma3_text"
    model_types = ("gemma3_text",)
    qk_norm = "per_head"


class Phi3Adapter(ArchAdapter):
    name = "phi3"
    model_types = ("phi3",)
    fused_qkv = True
    lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    projections = {"qkv_proj": "qkv", "o_proj": "o"}

    def _kv_out_features(self, attn: nn.Module) -> int:
        q_size = attn.o_proj.in_features
        return (attn.qkv_proj.out_features - q_size) // 2

    def split_qkv_rows(self, tensor, geo):
        q_size, kv_size = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
        return tensor[:q_size], tensor[q_size:q_size + kv_size], tensor[q_size + kv_size:]

    def qkv_weights(self, attn):
        geo = HeadGeometry(attn.o_proj.in_features // attn.head_dim, self._kv_out_features(attn) // attn.head_dim,
                           int(attn.head_dim))
        (qw, kw, vw) = self.split_qkv_rows(attn.qkv_proj.weight, geo)
        bias = attn.qkv_proj.bias
        (qb, kb, vb) = (None, None, None) if bias is None else self.split_qkv_rows(bias, geo)
        return qw, qb, kw, kb, vw, vb

    def build_qkv(self, attn, new):
        weight = torch.cat([new[n][0] for n in ("q", "k", "v")])
        bias = None if new["q"][1] is None else torch.cat([new[n][1] for n in ("q", "k", "v")])
        return {"qkv_proj": frozen_linear(weight, bias)}

    def set_head_counts(self, attn, num_heads, num_kv_heads):
        """Phi-3 reads head counts from the module's config at forward time: give the layer a config of its own."""
        super().set_head_counts(attn, num_heads, num_kv_heads)
        layer_config = copy.copy(attn.config)
        layer_config.__dict__["num_attention_heads"] = num_heads
        layer_config.__dict__["num_key_value_heads"] = num_kv_heads
        attn.config = layer_config

    def value_projection(self, attn: nn.Module) -> tuple[nn.Module, slice | None]:
        # qkv_proj output is [q (H*D) | k (KV*D) | v (KV*D)].
        q_size = attn.o_proj.in_features
        kv_size = self._kv_out_features(attn)
        return attn.qkv_proj, slice(q_size + kv_size, q_size + 2 * kv_size)


ADAPTERS: tuple[type[ArchAdapter], ...] = (
    LlamaAdapter,
    MistralAdapter,
    Qwen2Adapter,
    Qwen3Adapter,
    Olmo2Adapter,
    Gemma2Adapter,
    Gemma3TextAdapter,
    Phi3Adapter,
)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def adapter_for(model_type: str) -> ArchAdapter:
    """The family's adapter (a per-layer export's ``pruned_<family>`` model type included)."""
    model_type = model_type.removeprefix(MODEL_TYPE_PREFIX)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls()
    raise UnsupportedModel(
        f"architecture {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}"
    )
