"""Architecture adapters: the only code that knows where a family keeps its attention weights.

Every supported family follows transformers' decoder layout ``model.model.layers[i].self_attn`` with
separate or fused q/k/v projections, an ``o_proj`` whose input is the concatenation of the head outputs
``[batch, seq, num_heads * head_dim]``, and query head ``h`` reading KV head ``h // group_size``.
What differs (fused qkv, per-head or cross-head q/k norms, a BOS token the evaluation must add) is
declared here, one small class per family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ..errors import UserError


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


class LlamaAdapter(ArchAdapter):
    name = "llama"
    model_types = ("llama",)


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


class Gemma2Adapter(ArchAdapter):
    name = "gemma2"
    model_types = ("gemma2",)
    add_bos_for_eval = True


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
