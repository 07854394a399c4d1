"""Benchmark 2: the scoring pass (all 15 score functions) vs a plain forward pass over the same tokens.

    python benchmarks/bench_scoring_overhead.py [--model smollm2-135m] [--inputs 16] [--dtype bfloat16]

Both run the same MMLU 5-shot prompts in the same batches; the plain pass uses the model's default attention
(SDPA) and computes logits only at the last position, as the scoring pass does. Target: at most 1.5x.
"""
from __future__ import annotations

import argparse

import torch
from _common import machine, result, timed

from prune_heads.data.mmlu import load_mmlu
from prune_heads.eval.encoding import encode_task
from prune_heads.models import load_model
from prune_heads.scoring.hooks import score_heads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    lm = load_model(args.model, args.dtype, args.device)
    enc = encode_task(lm, load_mmlu().subset(1, subjects=args.inputs))
    seqs = [it.context for it in enc.items][: args.inputs]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))

    @torch.no_grad()
    def plain():
        for start in range(0, len(order), args.batch_size):
            idx = order[start:start + args.batch_size]
            n = max(len(seqs[i]) for i in idx)
            ids = torch.zeros(len(idx), n, dtype=torch.long)
            mask = torch.zeros(len(idx), n, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
                mask[r, : len(seqs[i])] = 1
            lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), use_cache=False, logits_to_keep=1)

    plain()  # warm-up
    t_plain, _ = timed(plain, repeats=2)
    t_score, _ = timed(lambda: score_heads(lm, seqs, args.batch_size, progress=False), repeats=2)
    tokens = sum(len(s) for s in seqs)
    print(f"machine: {machine()}")
    print(f"{len(seqs)} prompts, {tokens} tokens, batch {args.batch_size}, {lm.dtype}")
    print(f"plain forward : {t_plain:8.2f} s  ({tokens / t_plain:8.0f} tok/s)")
    print(f"scoring pass  : {t_score:8.2f} s  ({tokens / t_score:8.0f} tok/s)")
    result("scoring_overhead", round(t_score / t_plain, 3))


if __name__ == "__main__":
    main()
