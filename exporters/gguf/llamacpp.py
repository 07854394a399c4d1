"""The written GGUF run in llama.cpp itself (through ``llama-cpp-python``, the optional ``gguf`` extra): its
next-token logits against the verified model's, with a tolerance the unpruned model's own GGUF round trip
calibrates, its tokenizer against the Hugging Face one, and its prompt and generation speed against the unpruned
GGUF's."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from exporters.logits import worst_difference

GGML_TYPE_F32 = 0
INSTALL_HINT = "pip install 'prune-heads[gguf]' (builds llama.cpp from source: a C++ compiler and cmake)"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def load(path: Path, n_ctx: int, flash_attn: bool = False, f32_cache: bool = False):
    """A llama.cpp context on ``path`` returning logits at every position, on as many threads as torch computes on in
    this process (its cores, or what OMP_NUM_THREADS allows: llama.cpp's threads wait spinning, so more threads than
    the process's share of the cores slow every one of them down many times). Flash attention keeps a KV cache whose
    layers differ in width unpadded (the speed runs use it); ``f32_cache`` keeps K and V in float32 instead of
    llama.cpp's default f16 (the logit checks use it: they test the file, not the cache type)."""
    import torch
    from llama_cpp import Llama

    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
    threads = max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0))))
    return Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, seed=0, flash_attn=flash_attn,
                 **cache, verbose=bool(os.environ.get("PRUNE_HEADS_LLAMA_VERBOSE")), n_threads=threads,
                 n_threads_batch=threads)


def logits(llm, prompts: list[list[int]]) -> np.ndarray:
    """``[prompts, tokens, vocab]`` float32 logits of each prompt, evaluated from an empty cache."""
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    return np.stack(out)


def compare(reference: np.ndarray, got: np.ndarray) -> dict:
    """max |logit diff| and argmax agreement (share of positions) between two ``[prompts, tokens, vocab]`` arrays."""
    return {"max_abs_logit_diff": worst_difference(np.abs(reference - got)),
            "argmax_agreement": float((reference.argmax(-1) == got.argmax(-1)).mean())}


def tokenizer_agreement(llm, tokenizer, texts: list[str]) -> float:
    """Share of ``texts`` that llama.cpp's tokenizer splits into the same ids as the Hugging Face one."""
    same = 0
    for text in texts:
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        same += list(ours) == list(theirs)
    return same / max(len(texts), 1)


def speed(pruned: Path, original: Path, prompt_tokens: int = 256, generate: int = 32, rounds: int = 5,
          vocab: int = 32000) -> dict:
    """Prompt and generation tokens/s of both GGUFs, in alternating rounds (median of each)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prompt_tokens).tolist()
    n_ctx = prompt_tokens + generate + 8
    models = {"pruned": load(pruned, n_ctx, flash_attn=True), "original": load(original, n_ctx, flash_attn=True)}
    times: dict[str, dict[str, list[float]]] = {k: {"prompt": [], "generate": []} for k in models}
    for _ in range(rounds):
        for name, llm in models.items():
            p, g = _timed(llm, prompt, generate)
            times[name]["prompt"].append(prompt_tokens / p)
            times[name]["generate"].append(generate / g)
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    return {"prompt_tokens": prompt_tokens, "generated_tokens": generate, "rounds": rounds, "threads": os.cpu_count(),
            "flash_attention": True,
            "pruned_prompt_tokens_per_s": round(med["pruned"]["prompt"], 1),
            "original_prompt_tokens_per_s": round(med["original"]["prompt"], 1),
            "pruned_generation_tokens_per_s": round(med["pruned"]["generate"], 1),
            "original_generation_tokens_per_s": round(med["original"]["generate"], 1),
            "prompt_speedup": round(med["pruned"]["prompt"] / med["original"]["prompt"], 3),
            "generation_speedup": round(med["pruned"]["generate"] / med["original"]["generate"], 3)}


def _timed(llm, prompt: list[int], generate: int) -> tuple[float, float]:
    """(seconds for the prompt, seconds for ``generate`` greedy tokens one at a time)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(generate):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return prompt_s, time.perf_counter() - start
