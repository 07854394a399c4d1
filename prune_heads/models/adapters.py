"""Architecture adapters: the only code that knows where a family keeps its attention weights.

Every supported family follows transformers' decoder layout ``model.model.layers[i].self_attn`` with
separate or fused q/k/v projections, an ``o_proj`` whose input is the concatenation of the head outputs
``[batch, seq, num_heads * head_dim]``, and query head ``h`` reading KV head ``h // group_size``.
What differs (fused qkv, per-head or cross-head q/k norms, a BOS token the evaluation must add) is
declared here, one small class per family.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..errors import UserError

if TYPE_CHECKING:
    from ..pruning import LayerPlan


@dataclass(frozen=True)
class AttentionLayout:
    """Head geometry of one attention module."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_head_of(self, head: int) -> int:
        return head // self.group_size


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

    def num_layers(self, model: nn.Module) -> int:
        return len(self.decoder_layers(model))

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.decoder_layers(model)[layer].self_attn

    def output_projection(self, attn: nn.Module) -> nn.Linear:
        return attn.o_proj

    def layout(self, model: nn.Module, layer: int) -> AttentionLayout:
        attn = self.attention(model, layer)
        head_dim = int(attn.head_dim)
        num_heads = self.output_projection(attn).in_features // head_dim
        num_kv = self._kv_out_features(attn) // head_dim
        return AttentionLayout(num_heads, num_kv, head_dim)

    def layouts(self, model: nn.Module) -> list[AttentionLayout]:
        return [self.layout(model, i) for i in range(self.num_layers(model))]

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
        from ..pruning import _linear

        return {f"{n}_proj": _linear(*new[n]) for n in ("q", "k", "v")}

    def sliced_norms(self, attn: nn.Module, plan: "LayerPlan") -> dict[str, nn.Module]:
        """Per-head norms (Qwen3, Gemma3) act on head_dim and need nothing; cross-head norms are sliced."""
        return {}

    def across_head_norms(self, attn: nn.Module) -> dict[str, nn.Module]:
        """``{"q": q_norm, "k": k_norm}`` where they normalise over all heads together (empty otherwise)."""
        return {}

    def export_config(self, config, shapes: list[tuple[int, int]]):
        """A config for the pruned model: uniform shapes go into the global fields (explicit head_dim), differing
        shapes into ``per_layer_config``. Returns None if this family's config class refuses the shapes."""
        return _config_with_heads(type(config), config, shapes, self.layout_head_dim(config))

    def layout_head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def valid_num_heads(self, config, num_heads: int) -> bool:
        return num_heads > 0


def _config_with_heads(config_class, config, shapes: list[tuple[int, int]], head_dim: int):
    """Rebuild ``config`` (as ``config_class``) with per-layer query/KV head counts; None if validation refuses."""
    d = config.to_dict()
    for key in ("quantization_config", "per_layer_config", "_name_or_path", "transformers_version", "auto_map"):
        d.pop(key, None)
    d["head_dim"] = head_dim
    if config_class.model_type != config.model_type:
        d["model_type"] = config_class.model_type
        d["architectures"] = [(d.get("architectures") or [type(config).__name__.replace("Config", "ForCausalLM")])[0].replace(type(config).__name__.replace("Config", ""),
                                                                      config_class.__name__.replace("Config", ""))]
    counts = {shape for shape in shapes if shape[0] > 0}
    if len(counts) <= 1 and all(h > 0 for h, _ in shapes):
        (h, kv), = counts
        d["num_attention_heads"], d["num_key_value_heads"] = h, kv
    else:
        per_layer = {}
        for i, (h, kv) in enumerate(shapes):
            per_layer[i] = {"skip": ["self_attn"]} if h == 0 else {"num_attention_heads": h, "num_key_value_heads": kv}
        d["per_layer_config"] = per_layer
    from huggingface_hub.errors import StrictDataclassClassValidationError

    try:
        return config_class(**d)
    # RuntimeError: validators that read per-layer fields globally (AmbiguousGlobalPerLayerAttributeError)
    except (ValueError, TypeError, RuntimeError, StrictDataclassClassValidationError):
        return None


class LlamaAdapter(ArchAdapter):
    name = "llama"
    model_types = ("llama",)

    def export_config(self, config, shapes):
        """LlamaConfig refuses ``hidden_size % num_attention_heads != 0`` even with an explicit head_dim. Mistral's
        decoder is the same computation (RMSNorm, SiLU MLP, RoPE, no biases) and its config accepts any head count,
        so bias-free Llama checkpoints whose new head counts Llama refuses are written as Mistral."""
        cfg = super().export_config(config, shapes)
        if cfg is not None or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return cfg
        from transformers import MistralConfig

        cfg = _config_with_heads(MistralConfig, config, shapes, self.layout_head_dim(config))
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

    def sliced_norms(self, attn, plan):
        from ..pruning import _rows

        def sliced(norm, index):
            new = copy.deepcopy(norm)
            new.weight = nn.Parameter(_rows(norm.weight, index, plan.layout.head_dim), requires_grad=False)
            return new

        return {"q_norm": sliced(attn.q_norm, plan.slots), "k_norm": sliced(attn.k_norm, plan.kv_slots)}


class Gemma2Adapter(ArchAdapter):
    name = "gemma2"
    model_types = ("gemma2",)
    add_bos_for_eval = True

    def valid_num_heads(self, config, num_heads):
        return num_heads > 0 and config.hidden_size % num_heads == 0  # Gemma configs refuse other counts


class Gemma3TextAdapter(Gemma2Adapter):
    name = "gemma3_text"
    model_types = ("gemma3_text",)
    qk_norm = "per_head"


class Phi3Adapter(ArchAdapter):
    name = "phi3"
    model_types = ("phi3",)
    fused_qkv = True

    def _kv_out_features(self, attn: nn.Module) -> int:
        q_size = attn.o_proj.in_features
        return (attn.qkv_proj.out_features - q_size) // 2

    def qkv_weights(self, attn):
        q_size = attn.o_proj.in_features
        kv_size = self._kv_out_features(attn)
        w = attn.qkv_proj.weight
        b = attn.qkv_proj.bias
        split = lambda t: (None, None, None) if t is None else (t[:q_size], t[q_size:q_size + kv_size], t[q_size + kv_size:])
        (qw, kw, vw), (qb, kb, vb) = split(w), split(b)
        return qw, qb, kw, kb, vw, vb

    def build_qkv(self, attn, new):
        from ..pruning import _linear

        weight = torch.cat([new[n][0] for n in ("q", "k", "v")])
        bias = None if new["q"][1] is None else torch.cat([new[n][1] for n in ("q", "k", "v")])
        return {"qkv_proj": _linear(weight, bias)}

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
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls()
    raise UserError(
        f"architecture {model_type!r} is not supported; supported model types: {', '.join(supported_model_types())}"
    )
