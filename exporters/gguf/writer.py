"""Write a pruned model as one GGUF file that llama.cpp loads (the ``gguf`` package's writer).

Uniform head counts are written under a llama.cpp architecture of the family (llama for Llama, Mistral, SmolLM2 and
Qwen2, whose own qwen2 graph wants q as wide as the hidden size; qwen3, gemma2 and gemma3 for those); per-layer
counts are written as llama.cpp's ``deci`` architecture, whose graph builds every layer from its own
``attention.head_count[_kv]`` entries (0 heads: an attention-free layer), with ``attention.key_length`` set so the
head size never comes from a layer that has no heads. The tokenizer is copied from the source GGUF when there is
one, else built from the Hugging Face tokenizer (byte-level BPE: Llama-3, SmolLM2, Qwen2, GPT-2 pre-tokenizers).
Norms stay float32, as llama.cpp's own converter keeps them; matrices take ``--gguf-type`` (a q8_0 matrix whose rows
are not a multiple of 32 is f16).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from exporters.gguf.families import gguf_family
from prune_heads.errors import UserError
from prune_heads.models.loading import LoadedModel

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
# Bytes on disk per value of each tensor type (q8_0: blocks of 32 int8 values and one f16 scale).
GGUF_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}


def _qtype(name: str):
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[name]


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Each head's rows from transformers' halves order (x_0..x_{d/2-1}, y_0..) to adjacent pairs (x_0, y_0, ...),
    the order llama.cpp's NORM rope rotates."""
    if num_heads == 0:
        return weight
    rest = weight.shape[1:]
    d = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, d // 2, *rest).transpose(1, 2).reshape(weight.shape)


def write_gguf(lm: LoadedModel, model: torch.nn.Module, shapes: list[tuple[int, int]], path: Path,
               tensor_type: str = "f16") -> dict:
    """Write ``model`` (a pruned copy of ``lm.model`` with per-layer ``shapes`` (query heads, KV heads)) to
    ``path``. Returns what was written: architecture, head counts, tensor types."""
    import gguf

    per_layer = len(set(shapes)) > 1
    arch = gguf_family(lm.arch.name).architecture(per_layer)
    # llama.cpp takes the head size from layer 0 and reads a model whose layer 0 has no heads as attention-free
    # throughout; an empty layer 0 therefore ships one head whose q/k/v/o are zero: it adds exactly 0.
    placeholder = per_layer and shapes[0][0] == 0
    written = [(1, 1)] + list(shapes[1:]) if placeholder else list(shapes)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, lm, written, per_layer)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[tensor_type])))
    tokenizer_source = _tokenizer(writer, lm)
    kept = _tensors(writer, lm, model, shapes, tensor_type)
    if placeholder:
        _zero_head(writer, lm, model, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"file": path.name, "architecture": arch, "tensor_type": tensor_type, "head_counts": [q for q, _ in written],
            "kv_head_counts": [k for _, k in written], "tokenizer": tokenizer_source, "tensors": kept,
            "zero_head_in_layer_0": placeholder}


def _zero_head(writer, lm: LoadedModel, model, tensor_type: str) -> None:
    """Layer 0's attention norm and one all-zero head (q, k, v and its output columns)."""
    hidden, head_dim = int(lm.config.hidden_size), lm.arch.head_dim(lm.config)
    norm = model.state_dict()["model.layers.0.input_layernorm.weight"]
    writer.add_tensor("blk.0.attn_norm.weight", norm.detach().float().cpu().numpy())
    zeros = {"attn_q": (head_dim, hidden), "attn_k": (head_dim, hidden), "attn_v": (head_dim, hidden),
             "attn_output": (hidden, head_dim)}
    for kind, shape in zeros.items():
        _add_matrix(writer, f"blk.0.{kind}.weight", np.zeros(shape, dtype=np.float32), tensor_type)


def _metadata(writer, lm: LoadedModel, shapes, per_layer: bool) -> None:
    import gguf

    c = lm.config
    head_dim = lm.arch.head_dim(c)
    writer.add_name(str(getattr(c, "_name_or_path", "") or lm.source.spec) + " (prune-heads)")
    writer.add_context_length(int(c.max_position_embeddings))
    writer.add_embedding_length(int(c.hidden_size))
    writer.add_block_count(len(shapes))
    writer.add_feed_forward_length(int(c.intermediate_size))
    heads, kv = [q for q, _ in shapes], [k for _, k in shapes]
    writer.add_head_count(heads if per_layer else heads[0])
    writer.add_head_count_kv(kv if per_layer else kv[0])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(int(c.vocab_size))
    family = gguf_family(lm.arch.name)
    family.metadata(writer, c, head_dim)
    rope = family.rope_parameters(c)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind not in ("default", "llama3"):
        raise UserError(f"`export_format` gguf writes default, linear and llama3 RoPE; this model uses {kind!r}; use "
                        "`export_format` safetensors")


def _tensors(writer, lm: LoadedModel, model, shapes, tensor_type: str) -> dict:
    """Every weight under its GGUF name; q/k rows interleaved where llama.cpp rotates pairs. Returns type counts."""
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    family = gguf_family(lm.arch.name)
    counts: dict[str, int] = {}
    for name, tensor in model.state_dict().items():
        out = family.tensor_name(name)
        if out is None or (tied and out == "output.weight"):
            continue
        parts = out.split(".")  # blk.{layer}.{kind}.{weight|bias}, or {name}.weight
        layer, kind = (int(parts[1]), parts[2]) if parts[0] == "blk" else (None, parts[0])
        if layer is not None and shapes[layer][0] == 0 and not kind.startswith("ffn"):
            continue  # an attention-free layer (deci): no attention norm, no q/k/v/o
        data = tensor.detach().float().cpu()
        if data.ndim == 1 and "norm" in kind:
            data = data + family.norm_offset
        if family.rope_pairs and kind in ("attn_q", "attn_k"):
            data = interleave_rope_rows(data, shapes[layer][0 if kind == "attn_q" else 1])
        written = _add_matrix(writer, out, data.numpy(), tensor_type)
        counts[written] = counts.get(written, 0) + 1
    rope_freqs = _llama3_rope_factors(lm)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
        counts["F32"] = counts.get("F32", 0) + 1
    return counts


def _add_matrix(writer, name: str, array: np.ndarray, tensor_type: str) -> str:
    """Matrices in ``tensor_type`` (q8_0 needs rows that are a multiple of 32: else f16), vectors in float32.
    Returns the type written."""
    import gguf
    from gguf import quants

    kind = _qtype(tensor_type) if array.ndim == 2 else gguf.GGMLQuantizationType.F32
    if kind == gguf.GGMLQuantizationType.Q8_0 and array.shape[-1] % 32:
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
    else:
        writer.add_tensor(name, quants.quantize(array.astype(np.float32), kind), raw_dtype=kind)
    return kind.name


def _llama3_rope_factors(lm: LoadedModel) -> np.ndarray | None:
    """Llama-3.1's frequency-dependent RoPE scaling as llama.cpp reads it: one divisor per rotated pair."""
    rope = gguf_family(lm.arch.name).rope_parameters(lm.config)
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = lm.arch.head_dim(lm.config)
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    divisor = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor,
                                                                 1.0 / ((1 - smooth) / factor + smooth)))
    return divisor.astype(np.float32)


# -- tokenizer ----------------------------------------------------------------------------------------------------


def _tokenizer(writer, lm: LoadedModel) -> str:
    """Copy the source GGUF's tokenizer (and its descriptive ``general.*`` fields), else build it from the Hugging
    Face tokenizer. Returns where it came from."""
    if lm.source.gguf_file:
        source = Path(lm.source.path) / lm.source.gguf_file
        _copy_fields(writer, source)
        return f"copied from {lm.source.gguf_file}"
    _hf_tokenizer(writer, lm.tokenizer)
    return "built from the Hugging Face tokenizer"


COPIED_GENERAL = ("general.organization", "general.finetune", "general.basename", "general.size_label",
                  "general.license", "general.languages")


def _copy_fields(writer, source: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(source))
    for field in reader.fields.values():
        if not (field.name.startswith("tokenizer.") or field.name in COPIED_GENERAL):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for a byte-level BPE pre-tokenizer (``tokenizer.ggml.pre``), read off tokenizer.json."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in parts]
    regex = "".join(str((p.get("pattern") or {}).get("Regex", "")) for p in parts if p.get("type") == "Split")
    if "Digits" in types and "ByteLevel" in types and not regex:
        return "smollm"
    if r"\p{N}{1,3}" in regex:
        return "llama-bpe"
    if "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in regex and r"\p{N}|" in regex:
        return "qwen2"
    if types == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    raise UserError("`export_format` gguf cannot name this tokenizer's pre-tokenizer for llama.cpp (byte-level BPE of "
                    "Llama-3, SmolLM2, Qwen2 or GPT-2 only); use `export_format` safetensors and llama.cpp's "
                    "convert_hf_to_gguf.py")


def _hf_tokenizer(writer, tok) -> None:
    """A byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``): tokens by id, their types, merges, special ids."""
    import gguf

    data = json.loads(tok.backend_tokenizer.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("merges") is None:
        raise UserError("`export_format` gguf builds byte-level BPE tokenizers only; this one is "
                        f"{model.get('type')!r}; use `export_format` safetensors and llama.cpp's convert_hf_to_gguf.py")
    vocab = tok.get_vocab()
    size = max(len(vocab), max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            special = added.get(i, {}).get("special")
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED if i in added
                         else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(data))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if getattr(tok, attr, None) is not None:
            add(int(getattr(tok, attr)))
    writer.add_add_bos_token(bool(getattr(tok, "add_bos_token", False)))
    if getattr(tok, "chat_template", None):
        writer.add_chat_template(tok.chat_template)
