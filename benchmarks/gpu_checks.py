"""The GPU checks, as one prepared script for a lent GPU (run it once, read the RESULT lines, give the machine back):

    python benchmarks/gpu_checks.py [--device cuda] [--quick]

1. Scoring statistics on the device equal the CPU reference, float32, for a tiny random model of every supported
   family (shaped like the real checkpoints: hidden != heads x head_dim, one KV head for Gemma/Qwen3) and for the
   embedded SmolLM2-135M: max relative difference of every score function.
2. bf16 MMLU predictions agree with float32 on the embedded model (the recipe's 114 questions, on the device).
3. The benchmarks, with their own RESULT lines: MMLU speed against lm-eval is left out (it needs lm-eval installed);
   scoring overhead, pruned speed, the pipeline (the README command) and memory run on the device.

``--device cpu --quick`` runs the same code on the CPU with fewer inputs (a smoke test of the script itself).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from _common import machine, result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILIES = {  # (overrides of tests/tiny.py's config) real-checkpoint shapes
    "llama": {},
    "qwen2": {},
    "qwen3": {"num_key_value_heads": 1, "head_dim": 32},
    "gemma2": {"num_key_value_heads": 1, "head_dim": 32},
    "gemma3_text": {"num_key_value_heads": 1, "head_dim": 32},
    "olmo2": {},
    "phi3": {},
    "mistral": {},
}


def scoring_matches_cpu(device: torch.device, quick: bool) -> float:
    from tiny import tiny_model

    from prune_heads.models.loading import LoadedModel
    from prune_heads.scoring import score_heads

    worst = 0.0
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 384, (n,), generator=g).tolist() for n in (40, 64, 23)]
    for family, overrides in FAMILIES.items():
        if quick and family not in ("llama", "qwen3"):
            continue
        lm = tiny_model(family, **overrides)
        ref = score_heads(lm, seqs, 2, False)
        moved = LoadedModel(lm.model.to(device), lm.tokenizer, lm.arch, lm.source, lm.dtype, device)
        got = score_heads(moved, seqs, 2, False)
        diff = max(float((ref.per_input[k] - got.per_input[k].cpu()).abs().max() /
                         ref.per_input[k].abs().max().clamp(min=1e-12)) for k in ref.per_input)
        print(f"scores of tiny {family} on {device} vs CPU: max relative difference {diff:.2e}")
        worst = max(worst, diff)
    return worst


def bf16_agrees_with_float32(device: torch.device, quick: bool) -> float:
    from prune_heads.data.mmlu import load_mmlu
    from prune_heads.evaluation import encode_task, evaluate
    from prune_heads.models import load_model

    subjects = 2 if quick else None
    preds = {}
    for dtype in ("float32", "bfloat16"):
        lm = load_model("smollm2-135m", dtype, str(device))
        data = load_mmlu().subset(1 if quick else 6, subjects=subjects or 19)
        preds[dtype] = evaluate(lm, encode_task(lm, data), None, 8, False).pred
    agreement = float((preds["float32"] == preds["bfloat16"]).double().mean())
    print(f"embedded model, {len(preds['float32'])} MMLU questions: bf16 predictions agree with float32 on "
          f"{100 * agreement:.1f}%")
    return agreement


def run_benchmarks(device: str) -> None:
    here = Path(__file__).resolve().parent
    for script, args in (("bench_scoring_overhead.py", ["--device", device]),
                         ("bench_pruned_speed.py", ["--device", device]),
                         ("bench_pipeline.py", ["--device", device]),
                         ("bench_memory.py", ["--skip-main"])):
        print(f"--- {script}", flush=True)
        subprocess.run([sys.executable, str(here / script), *args], check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"machine: {machine()}")
    result("scoring_max_relative_diff_vs_cpu", f"{scoring_matches_cpu(device, args.quick):.3e}")
    result("bf16_prediction_agreement_with_float32", round(bf16_agrees_with_float32(device, args.quick), 4))
    if not args.quick:
        run_benchmarks(args.device)


if __name__ == "__main__":
    main()
