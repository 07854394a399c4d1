"""Tiny random models of every supported family, and a small BPE tokenizer trained on a fixed text."""
from __future__ import annotations

import functools

import torch

from prune_heads.models.adapters import adapter_for
from prune_heads.models.loading import LoadedModel, ModelSource

VOCAB = 384
COMMON = dict(
    vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def _config(family: str, **overrides):
    import transformers as tf

    if overrides:
        cfg = _config(family)
        d = cfg.to_dict()
        d.update(overrides)
        return type(cfg)(**d)

    if family == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON)
    if family == "olmo2":
        return tf.Olmo2Config(**COMMON)
    if family == "gemma2":
        return tf.Gemma2Config(**COMMON, query_pre_attn_scalar=16, sliding_window=6, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0)
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**COMMON, query_pre_attn_scalar=16, sliding_window=6,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    if family == "phi3":
        cfg = dict(COMMON)
        return tf.Phi3Config(**cfg, sliding_window=None)
    raise KeyError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3_text", "phi3")


def _randomise_extra(model: torch.nn.Module, seed: int) -> None:
    """Random init leaves biases and norm weights at 0/1; perturb them so their slicing is really tested."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", **overrides) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _config(family, **overrides)
    if family == "gemma2":
        attn = "eager"  # attention-logit softcapping has no SDPA path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.initializer_range = 0.2
    _randomise_extra(model, seed)
    # Larger weights than the default init, so attention is far from uniform and heads differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(4.0)
    model.eval().requires_grad_(False)
    return LoadedModel(model, tokenizer(), adapter_for(config.model_type), ModelSource("tiny-" + family, "directory", "."),
                       torch.float32, torch.device("cpu"))


CORPUS = """The following are multiple choice questions (with answers) about anatomy.
Which of the following is a bone of the arm? A. Femur B. Humerus C. Tibia D. Fibula Answer: B
What is the capital of France? Answer: A B C D
The quick brown fox jumps over the lazy dog. Attention heads that do not matter can be removed.
""" * 4


@functools.lru_cache(maxsize=1)
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def save_tiny(directory, family: str):
    """A tiny random model of ``family`` saved as a transformers checkpoint (for the CLI), in ``directory``."""
    lm = tiny_model(family)
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


def run_cli(args, capsys):
    """Run ``prune-heads ARGS`` in-process: (exit code, stdout, stderr)."""
    import pytest

    from prune_heads_cli.main import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


class FnEvaluator:
    """The search's evaluator (search.budget_search.PointEvaluator) over a function of the head set, for tests."""

    def __init__(self, evaluate, baseline, budget, savings=None):
        self._evaluate, self.baseline, self.budget, self._savings = evaluate, baseline, budget, savings

    def evaluate(self, heads, label):
        return self._evaluate(heads, label)

    def evaluate_group(self, sets, labels):
        return [self.evaluate(h, label) for h, label in zip(sets, labels)]

    def savings(self, heads):
        return self._savings(heads) if self._savings else None


# Tiny models shaped like each family's real checkpoints, head_dim 32 (vLLM's CPU attention needs 32, 64, 80, ...):
# Gemma-2/3 and Qwen3 with hidden_size != heads x head_dim, Gemma-3 with one KV head, Phi-3 without grouped queries,
# Llama and Qwen2 (attention biases) grouped 3 to 1.
REAL_SHAPES = {
    "llama": dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32),
    "qwen2": dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=32),
    "qwen3": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    "gemma2": dict(hidden_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=32, query_pre_attn_scalar=32),
    "gemma3_text": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                        query_pre_attn_scalar=32),
    "phi3": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32),
}


def uneven_heads(num_heads: int, num_kv_heads: int):
    """Uneven per-layer removals: one head of layer 0, layer 1 untouched, a whole KV group of layer 2 (half the
    heads with one KV head), every head of layer 3 (a layer left with no attention)."""
    from prune_heads.heads import HeadSet

    group = num_heads // num_kv_heads
    layer2 = list(range(group)) if num_kv_heads > 1 else list(range(num_heads // 2))
    return HeadSet.of({0: [0], 2: layer2, 3: list(range(num_heads))})
