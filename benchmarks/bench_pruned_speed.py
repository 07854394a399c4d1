"""Benchmark 3: pruned vs unpruned model: parameters, prefill and decode throughput, KV cache per token, peak memory.

    python benchmarks/bench_pruned_speed.py [--remove-per-group 1] [--dtype bfloat16]

The pruned model removes ``--remove-per-group`` query heads from every KV group of every layer (a uniform layout
that stock transformers loads) and is exported and reloaded exactly as users get it. "Attention compute removed"
is the share of the model's forward FLOPs at this sequence length that the removed heads accounted for (their
q/o projection rows and columns and their QK^T / AV products); the expected speed-up if time followed FLOPs is
1 / (1 - removed) - 1. Target: measured speed-up >= 90% of that.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from _common import machine, result, timed
from exporters.export import export_pruned
from prune_heads.heads import HeadSet
from prune_heads.models import load_model


def forward_flops(cfg, shapes, seq: int) -> tuple[float, float]:
    """(total, attention-heads-only) FLOPs per token at context length ``seq``."""
    h, d, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    total = attn = 0.0
    for nq, nkv in shapes:
        heads = 2 * h * d * (2 * nq + 2 * nkv) + 2 * 2 * nq * d * seq / 2  # projections + QK^T and AV (causal mean)
        total += heads + 2 * 3 * h * inter
        attn += heads
    return total + 2 * h * vocab, attn


@torch.no_grad()
def throughput(model, batch: int, seq: int, new_tokens: int, device) -> tuple[float, float]:
    ids = torch.randint(100, 1000, (batch, seq), device=device)
    model(input_ids=ids[:, :16])  # warm-up
    t_prefill, out = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeats=3)

    def decode():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).cache
        tok = ids[:, -1:]
        for _ in range(new_tokens):
            o = model(input_ids=tok, cache=cache, use_cache=True)
            cache, tok = o.cache, o.logits[:, -1:].argmax(-1)

    t_total, _ = timed(decode, repeats=2)
    t_decode = max(t_total - t_prefill, 1e-9)
    return batch * seq / t_prefill, batch * new_tokens / t_decode


def peak_memory_mb(model_dir: Path, dtype: str, batch: int, seq: int) -> float:
    """Peak memory of one prefill forward above the loaded model, measured in a fresh process (CUDA allocator
    peak on a GPU, max RSS on CPU), so neither model's allocations hide the other's."""
    import subprocess
    import sys

    code = f"""
import resource, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, dtype=getattr(torch, {dtype!r}))
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
m = m.to(dev).eval()
ids = torch.randint(100, 1000, ({batch}, {seq}), device=dev)
with open('/proc/self/statm') as f:
    base = int(f.read().split()[1]) * 4096
if dev == 'cuda':
    torch.cuda.synchronize(); start = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
with torch.no_grad():
    m(input_ids=ids, logits_to_keep=1)
if dev == 'cuda':
    print((torch.cuda.max_memory_allocated() - start) / 2**20)
else:
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--remove-per-group", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    lm = load_model(args.model, args.dtype, args.device)
    layouts = lm.adapter.layouts(lm.model)
    heads = HeadSet.of({i: [k * lay.group_size + j for k in range(lay.num_kv_heads) for j in range(args.remove_per_group)]
                        for i, lay in enumerate(layouts)})
    tmp = Path(tempfile.mkdtemp())
    (tmp / "pruned").mkdir()
    (tmp / "unpruned").mkdir()
    res = export_pruned(lm, heads, tmp / "pruned", layout="uniform", log=lambda *a: None, progress=False)
    # The baseline goes through the same export and reload (nothing removed), so both models have the same
    # weight storage and code path; only the head counts differ.
    export_pruned(lm, HeadSet(), tmp / "unpruned", layout="uniform", log=lambda *a: None, progress=False)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=lm.dtype).to(lm.device).eval()  # noqa: E731
    pruned, base = load(tmp / "pruned"), load(tmp / "unpruned")
    config = lm.config
    del lm.model  # free the GGUF-loaded copy
    before = [(lay.num_heads, lay.num_kv_heads) for lay in layouts]
    after = res.choice.plan.shapes
    total, attn_before = forward_flops(config, before, args.seq)
    _, attn_after = forward_flops(config, after, args.seq)
    removed = (attn_before - attn_after) / total
    expected = 1 / (1 - removed) - 1

    rows = {}
    for name, model in (("unpruned", base), ("pruned", pruned)):
        gc.collect()
        pre, dec = throughput(model, args.batch, args.seq, args.new_tokens, lm.device)
        mem = peak_memory_mb(tmp / name, str(lm.dtype).replace("torch.", ""), args.batch, args.seq)
        rows[name] = dict(params=sum(p.numel() for p in model.parameters()), prefill=pre, decode=dec, mem=mem)
    kv = res.stats
    print(f"machine: {machine()}; {lm.dtype}; batch {args.batch} x {args.seq} tokens, {args.new_tokens} decode steps")
    print(f"{'':10s} {'params':>12s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'KV B/token':>11s} {'fwd peak MB':>11s}")
    for name, kvs in (("unpruned", kv["before"]), ("pruned", kv["after"])):
        r = rows[name]
        print(f"{name:10s} {r['params']:12,d} {r['prefill']:14.0f} {r['decode']:13.1f} {kvs['kv_cache_bytes_per_token']:11,d} {r['mem']:11.0f}")
    speedup = rows["pruned"]["prefill"] / rows["unpruned"]["prefill"] - 1
    print(f"heads per layer {before[0]} -> {after[0]}; attention compute removed {100 * removed:.1f}% of forward FLOPs; "
          f"expected prefill speed-up {100 * expected:.1f}%, measured {100 * speedup:.1f}%; "
          f"decode speed-up {100 * (rows['pruned']['decode'] / rows['unpruned']['decode'] - 1):.1f}%")
    result("pruned_speedup_fraction", round(speedup / expected, 3) if expected > 0 else "nan")


if __name__ == "__main__":
    main()
