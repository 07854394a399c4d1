"""The speed-up of the model that ships, measured in the run: prefill and decode tokens/s of the reloaded export
against the original, in alternating rounds (so drift in the machine's speed hits both alike): the ratio of the two
medians shown beside it, a 95% interval from the rounds' paired ratios, and the speed-up the FLOPs predict."""
from __future__ import annotations

import math
import statistics
import time
import warnings

import torch

from prune_heads.models.counting import weight_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_bytes(cache) -> int:
    """Bytes of a transformers KV cache (its key and value tensors, whatever the cache class)."""
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []) or []:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def _timed(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, int]:
    """(prefill seconds for ``ids``, decode seconds for ``new_tokens`` greedy steps on the KV cache, cache bytes)."""
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    _sync(device)
    prefill = time.perf_counter() - start
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    with warnings.catch_warnings():  # 5.2x renames past_key_values to cache; older versions know only the former
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(new_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(device)
    return prefill, time.perf_counter() - start, _cache_bytes(cache)


def flops_per_token(model, arch, context: int) -> int:
    """2 x (weights a token passes through, embeddings aside) + the attention scores and mixing over ``context``
    (4 x query width x context per layer; a layer without attention adds none)."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    if getattr(model.config, "tie_word_embeddings", False):
        params += model.get_output_embeddings().weight.numel()  # the LM head still multiplies
    attention = 0
    for i in range(arch.num_layers(model)):
        attn = arch.attention(model, i)
        if hasattr(attn, "o_proj") or hasattr(attn, "qkv_proj"):
            attention += 4 * arch.output_projection(attn).in_features * context
    return 2 * params + attention


def measure_speed(original, shipped, arch, batch: int = 1, prompt: int = 256, new_tokens: int = 32,
                  rounds: int = 5) -> dict:
    """Prefill and decode throughput of ``shipped`` against ``original`` (tokens/s, median over alternating rounds)
    and the ratios, with the FLOP-predicted prefill speed-up at this prompt length, on ``original``'s device."""
    device = next(original.parameters()).device
    vocab_size = original.config.vocab_size
    ids = torch.randint(0, vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    models = {"original": original, "shipped": shipped}
    for model in models.values():
        _timed(model, ids[:, :8], 2)  # warm-up: kernels, allocator
    times = {name: [] for name in models}
    peaks = {}
    for r in range(rounds):
        for name in (("original", "shipped") if r % 2 == 0 else ("shipped", "original")):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[name].append(_timed(models[name], ids, new_tokens))
            if device.type == "cuda":
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated(device))
    prefill = {n: [batch * prompt / t[0] for t in ts] for n, ts in times.items()}
    decode = {n: [batch * new_tokens / t[1] for t in ts] for n, ts in times.items()}
    predicted = flops_per_token(original, arch, prompt) / flops_per_token(shipped, arch, prompt)
    return {"device": device.type, "dtype": str(next(original.parameters()).dtype).replace("torch.", ""),
            "batch": batch, "prompt_tokens": prompt, "decode_tokens": new_tokens, "rounds": rounds,
            "prefill_tokens_per_s": {n: round(statistics.median(v), 2) for n, v in prefill.items()},
            "decode_tokens_per_s": {n: round(statistics.median(v), 2) for n, v in decode.items()},
            **paired_speedup("prefill", prefill["shipped"], prefill["original"]),
            **paired_speedup("decode", decode["shipped"], decode["original"]),
            "flops_predicted_prefill_speedup": round(predicted, 4),
            "weight_bytes": {n: weight_bytes(m) for n, m in models.items()},
            # The KV cache both hold after prompt + decode (measured); with the weights, what serving keeps resident.
            "kv_cache_bytes": {n: ts[-1][2] for n, ts in times.items()},
            **({"cuda_peak_bytes": peaks} if peaks else {})}


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_speedup(name: str, shipped: list[float], original: list[float]) -> dict:
    """``{name}_speedup``: the geometric mean of the rounds' paired ratios (``shipped`` over ``original``, round by
    round: both timed alternately under the same load); ``{name}_speedup_ci95``: its 95% interval (Student's t on the
    ratios' logarithms), which always holds it; ``{name}_measurable``: whether that interval leaves out 1. (The ratio
    of the two medians printed beside it can fall outside the interval on a noisy machine: the point and its
    interval must be one statistic.)"""
    logs = [math.log(s / o) for s, o in zip(shipped, original)]
    centre = statistics.mean(logs)
    ratio = math.exp(centre)
    if len(logs) > 1:
        half = T975.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
        low, high = math.exp(centre - half), math.exp(centre + half)
    else:
        low, high = 0.0, math.inf
    return {f"{name}_speedup": round(ratio, 4), f"{name}_speedup_ci95": [round(low, 4), round(high, 4)],
            f"{name}_measurable": not low <= 1.0 <= high}


def speedup_text(speed: dict, name: str) -> str:
    """``x1.25 [1.10, 1.42]``, or ``no measurable difference (x0.98 [0.90, 1.07])`` where the interval holds 1."""
    ratio, ci = speed[f"{name}_speedup"], speed.get(f"{name}_speedup_ci95")
    if ci is None:  # a record of an older version
        return f"x{ratio:.2f}"
    text = f"x{ratio:.2f} [95% CI {ci[0]:.2f}, {ci[1]:.2f}]"
    return text if speed.get(f"{name}_measurable") else f"no measurable difference ({text})"
