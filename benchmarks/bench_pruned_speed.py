"""Benchmark 3: pruned vs unpruned model: parameters, prefill and decode throughput, KV cache per token, peak memory.

    python benchmarks/bench_pruned_speed.py [--remove kv-group|query-heads] [--seq 1024] [--dtype bfloat16]

What is removed, in every layer (a uniform layout that stock transformers loads):
- ``kv-group`` (default): the first KV group whole, i.e. its query heads and its key/value head (9x3 -> 6x2 on
  SmolLM2), so the KV cache shrinks too;
- ``query-heads``: the first query head of every KV group (9x3 -> 6x3), KV heads kept.
Both models are written by the exporter and reloaded with stock ``from_pretrained`` (the baseline with nothing
removed), so weight storage and code path are the same and only head counts differ.

"Attention compute removed" is the share of the forward FLOPs the removed heads accounted for (their q/k/v/o rows
and columns, their QK^T and AV products at this context length); prefill computes logits at the last position
only, as generation does, so the LM head is left out there and counted per token for decode. If time followed FLOPs
the speed-up would be 1 / (1 - removed) - 1. Timings alternate between the two models round by round on the same
inputs and the speed-up is the median of the per-round ratios, so a noisy machine slows both alike.
Target: measured prefill speed-up >= 90% of the expected one (``pruned_speedup_fraction`` >= 0.9).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, result

from exporters.export import ExportOptions, export_pruned
from prune_heads.heads import HeadSet
from prune_heads.models import load_model


def layer_flops(cfg, nq: int, nkv: int, context: float) -> tuple[float, float]:
    """(all, attention) FLOPs per token of one layer with ``nq`` query and ``nkv`` KV heads attending over
    ``context`` keys on average."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attention = 2 * h * d * (2 * nq + 2 * nkv) + 2 * 2 * nq * d * context  # q/k/v/o projections + QK^T and AV
    return attention + 2 * 3 * h * inter, attention


def removed_share(cfg, before, after, context: float, lm_head: bool) -> float:
    """Share of forward FLOPs per token removed by going from ``before`` to ``after`` head shapes."""
    total = sum(layer_flops(cfg, nq, nkv, context)[0] for nq, nkv in before)
    total += 2 * cfg.hidden_size * cfg.vocab_size if lm_head else 0
    removed = sum(layer_flops(cfg, *b, context)[1] - layer_flops(cfg, *a, context)[1] for b, a in zip(before, after))
    return removed / total


def heads_to_remove(layouts, how: str) -> HeadSet:
    if how == "kv-group":
        return HeadSet.of({i: range(lay.group_size) for i, lay in enumerate(layouts)})
    return HeadSet.of({i: [k * lay.group_size for k in range(lay.num_kv_heads)] for i, lay in enumerate(layouts)})


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def prefill_seconds(model, ids) -> float:
    _sync()
    t = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    _sync()
    return time.perf_counter() - t


@torch.no_grad()
def decode_seconds(model, ids, steps: int) -> float:
    """Time of ``steps`` greedy decode steps after an (untimed) prefill of ``ids``."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, cache=cache, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    _sync()
    return time.perf_counter() - t


def peak_memory_mb(model_dir: Path, dtype: str, batch: int, seq: int) -> float:
    """Peak memory of one prefill forward above the loaded model, measured in a fresh process so neither model's
    allocations hide the other's: the CUDA allocator's peak on a GPU; on CPU the resident-set high-water mark,
    reset after loading (Linux: writing 5 to /proc/self/clear_refs), minus the resident set before the forward."""
    code = f"""
import gc, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, dtype=getattr(torch, {dtype!r}))
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
m = m.to(dev).eval()
ids = torch.randint(100, 1000, ({batch}, {seq}), device=dev)
def status(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
gc.collect()
if dev == 'cuda':
    torch.cuda.synchronize(); start = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
else:
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    start = status('VmRSS:')
with torch.no_grad():
    m(input_ids=ids, use_cache=False, logits_to_keep=1)
if dev == 'cuda':
    print((torch.cuda.max_memory_allocated() - start) / 2**20)
else:
    print((status('VmHWM:') - start) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--remove", choices=("kv-group", "query-heads"), default="kv-group")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    lm = load_model(args.model, args.dtype, args.device)
    layouts = lm.arch.geometries(lm.model)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "pruned").mkdir()
    (tmp / "unpruned").mkdir()
    quiet = ExportOptions(layout="uniform", progress=False)
    res = export_pruned(lm, heads_to_remove(layouts, args.remove), tmp / "pruned", quiet)
    base_res = export_pruned(lm, HeadSet(), tmp / "unpruned", quiet)
    models = {name: AutoModelForCausalLM.from_pretrained(tmp / name, dtype=lm.dtype).to(lm.device).eval()
              for name in ("unpruned", "pruned")}
    config, device, dtype = lm.config, lm.device, lm.dtype
    del lm  # free the GGUF-loaded original
    gc.collect()
    before = [(lay.num_heads, lay.num_kv_heads) for lay in layouts]
    after = res.choice.plan.shapes
    prefill_removed = removed_share(config, before, after, (args.seq + 1) / 2, lm_head=False)
    decode_removed = removed_share(config, before, after, args.seq + args.new_tokens / 2, lm_head=True)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (args.batch, args.seq), generator=g).to(device)
    for m in models.values():  # warm-up
        prefill_seconds(m, ids[:, :64])
        decode_seconds(m, ids[:, :64], 2)
    times = {name: {"prefill": [], "decode": []} for name in models}
    for _ in range(args.rounds):
        for name, m in models.items():
            times[name]["prefill"].append(prefill_seconds(m, ids))
            times[name]["decode"].append(decode_seconds(m, ids, args.new_tokens))

    def speedup(kind: str) -> float:
        return statistics.median(u / p for u, p in zip(times["unpruned"][kind], times["pruned"][kind])) - 1

    print(f"machine: {machine()}; {dtype}; batch {args.batch} x {args.seq} tokens, {args.new_tokens} decode steps, "
          f"{args.rounds} alternating rounds; removed: {args.remove}, heads per layer {before[0]} -> {after[0]}")
    print(f"{'':10s} {'params':>12s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'KV B/token':>11s} "
          f"{'fwd peak MB':>11s}")
    for name, stats in (("unpruned", base_res.stats["after"]), ("pruned", res.stats["after"])):
        t = times[name]
        mem = peak_memory_mb(tmp / name, str(dtype).replace("torch.", ""), args.batch, args.seq)
        params = sum(p.numel() for p in models[name].parameters())
        print(
            f"{name:10s} {params:12,d} {args.batch * args.seq / statistics.median(t['prefill']):14.0f} "
            f"{args.batch * args.new_tokens / statistics.median(t['decode']):13.1f} "
            f"{stats['kv_cache_bytes_per_token']:11,d} {mem:11.0f}"
        )
    for kind, share in (("prefill", prefill_removed), ("decode", decode_removed)):
        expected = 1 / (1 - share) - 1
        measured = speedup(kind)
        print(
            f"{kind:8s}: attention compute removed {100 * share:.1f}% of FLOPs -> expected speed-up "
            f"{100 * expected:.1f}%, measured {100 * measured:.1f}% (median of per-round ratios; rounds: "
            + ", ".join(f"{u / p - 1:+.1%}" for u, p in zip(times["unpruned"][kind], times["pruned"][kind]))
            + ")"
        )
        name = "pruned_speedup_fraction" if kind == "prefill" else "pruned_decode_speedup_fraction"
        result(name, round(measured / expected, 3))


if __name__ == "__main__":
    main()
