"""What llama.cpp calls each family: the architecture a GGUF is written as (and the one that builds per-layer head
counts, ``deci``), tensor names, norm offsets, RoPE pair order and the metadata its graph reads. One entry per
adapter (``prune_heads.models.adapters``); a family without an entry has no GGUF export, and says why."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from prune_heads.errors import UserError

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
SUPPORTED = "llama, mistral, smollm2, qwen2, qwen3, gemma2 and gemma3"


@dataclass(frozen=True)
class GgufFamily:
    """How one family is written for llama.cpp."""

    name: str  # the adapter's
    arch: str | None  # the llama.cpp architecture (None: no GGUF export, for the reason in ``unsupported``)
    per_layer_arch: str | None = None  # the one whose graph builds every layer from its own head counts
    no_per_layer: str = "llama.cpp has no architecture that builds this family with per-layer heads"
    # llama.cpp's rope for the architecture rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM) where transformers rotates
    # halves: each head's q/k rows are interleaved on the way out.
    rope_pairs: bool = False
    unsupported: str = "no llama.cpp mapping written for it"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w), llama.cpp's by w
    layer_names: dict[str, str] = field(default_factory=dict)  # this family's names beyond LAYER_NAMES

    def architecture(self, per_layer: bool) -> str:
        """The llama.cpp architecture to write, or a UserError naming what to do instead."""
        if self.arch is None:
            raise UserError(f"`export_format` gguf supports {SUPPORTED} checkpoints, not {self.name} "
                            f"({self.unsupported}); use `export_format` safetensors")
        if per_layer and self.per_layer_arch is None:
            raise UserError(f"this export has per-layer head counts, but {self.no_per_layer}; pass `layout` "
                            "uniform (the same heads in every layer) for a GGUF")
        return self.per_layer_arch if per_layer else self.arch

    def layout(self, layout: str) -> str:
        """The export layout for a GGUF (checked before anything loads): auto becomes uniform where llama.cpp cannot
        build the family with per-layer heads."""
        self.architecture(per_layer=layout == "per-layer")  # a UserError naming the alternative
        return "uniform" if layout == "auto" and self.per_layer_arch is None else layout

    def tensor_name(self, name: str) -> str | None:
        """The GGUF name of a transformers state-dict key (None: not written)."""
        if name in GLOBAL_NAMES:
            return GLOBAL_NAMES[name]
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        names = {**LAYER_NAMES, **self.layer_names}
        if m and m.group(2) in names:
            return f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        return None

    def metadata(self, writer, config, head_dim: int) -> None:
        """Keys this family's llama.cpp graph reads beyond the common ones (none by default)."""

    def rope_parameters(self, config) -> dict:
        """The RoPE parameters of the (global-attention) layers."""
        return dict(getattr(config, "rope_parameters", None) or {})


@dataclass(frozen=True)
class Gemma2Family(GgufFamily):
    norm_offset: float = 1.0
    layer_names: dict[str, str] = field(default_factory=lambda: {
        "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm"})
    layers_scaled_by_heads: int = 46  # Gemma-2 27B: llama.cpp scales queries by hidden / heads

    def metadata(self, writer, config, head_dim: int) -> None:
        """Which layers slide and over how many tokens, both softcaps. llama.cpp scales queries by 1/sqrt(head_dim)
        (the 27B by the unpruned hidden / heads, which pruning changes), so other scalars are refused."""
        if (config.num_hidden_layers == self.layers_scaled_by_heads
                or int(config.query_pre_attn_scalar) != head_dim):
            raise UserError(f"llama.cpp scales {self.name} queries by 1/sqrt(head_dim) (or, for the 27B, by the head "
                            f"count, which pruning changes); this model uses query_pre_attn_scalar "
                            f"{config.query_pre_attn_scalar}; use `export_format` safetensors")
        if config.sliding_window:
            writer.add_sliding_window(int(config.sliding_window))
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
        for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if getattr(config, key, None):
                add(float(getattr(config, key)))


@dataclass(frozen=True)
class Gemma3Family(Gemma2Family):
    layers_scaled_by_heads: int = 62

    def rope_parameters(self, config) -> dict:
        rope = dict(getattr(config, "rope_parameters", None) or {})
        return dict(rope.get("full_attention", rope))

    def metadata(self, writer, config, head_dim: int) -> None:
        super().metadata(writer, config, head_dim)
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention")
        if local:
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))


# llama.cpp's qwen2 graph wants q as wide as the hidden size (no pruned heads); its llama and deci graphs load optional
# q/k/v biases and compute the same thing once q/k rows (and biases) are put in rotation-pair order. It runs Mistral
# as llama.
FAMILIES = {family.name: family for family in (
    GgufFamily("llama", "llama", "deci", rope_pairs=True),
    GgufFamily("mistral", "llama", "deci", rope_pairs=True),
    GgufFamily("qwen2", "llama", "deci", rope_pairs=True),
    GgufFamily("qwen3", "qwen3", no_per_layer="llama.cpp's qwen3 graph takes one head count for every layer and its "
               "per-layer graph (deci) has no q/k norms"),
    GgufFamily("olmo2", None, unsupported="llama.cpp's olmo2 graph wants q and its norm as wide as the hidden size: "
               "no head can go"),
    Gemma2Family("gemma2", "gemma2", no_per_layer="llama.cpp's gemma2 graph takes one head count for every layer "
                 "(deci has no post-norms)"),
    Gemma3Family("gemma3_text", "gemma3", no_per_layer="llama.cpp's gemma3 graph takes one head count for every "
                 "layer (deci has no q/k norms)"),
    GgufFamily("phi3", None, unsupported="llama.cpp's phi3 graph wants q as wide as the hidden size: no head can go"),
)}


def gguf_family(adapter_name: str) -> GgufFamily:
    return FAMILIES.get(adapter_name) or GgufFamily(adapter_name, None)
