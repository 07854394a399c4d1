"""The data a run reads, loaded once and checked before the weights load: the model's source and config, the
verification questions, and the optional texts (calibration, held-out KL text, healing text).

Also the token sequences each stage consumes, built from those inputs and the loaded tokenizer: what is scored,
the held-out text of the next-token KL, and the healing text. None of them is ever a verified question.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from prune_heads.data.calibration import load_calibration
from prune_heads.data.lm_eval_index import LmEvalSpec, is_lm_eval, samples, task_files
from prune_heads.data.lm_eval_tasks import (
    NOT_CHOICES,
    load_tasks,
    multiple_choice_data,
    rolling_texts,
    task_identity,
)
from prune_heads.data.mmlu import load_mmlu
from prune_heads.data.tasks import MMLU_TASKS, TaskData, load_task, task_format
from prune_heads.errors import UserError
from prune_heads.eval.cached_steps import Work
from prune_heads.eval.encoding import EncodedTask
from prune_heads.eval.textkl import HeldOutText
from prune_heads.models.loading import LoadedModel, ModelSource, load_config, resolve_source
from prune_heads.models.tokens import encode
from prune_heads.pipeline.settings import Settings


@dataclass(frozen=True)
class Inputs:
    source: ModelSource
    config: object  # the model's transformers config
    questions: TaskData  # the verification questions
    all_questions: TaskData  # the whole task (held-out questions come from here)
    calibration: list[str] | None  # --calibration texts (the first calibration_size)
    calibration_rest: list[str] | None  # the file's lines after those (held-out text for the next-token KL)
    kl_text: list[str] | None  # --kl-text texts
    heal_text: list[str] | None  # --heal-data texts
    paths: tuple[str, ...] = ()  # every local file or directory the run reads (an --out must never touch them)
    confirmation: TaskData | None = None  # questions the search never sees, to confirm the chosen point on
    confirmation_source: str | None = None  # where they come from (or why there are none)
    guard_texts: list[str] | None = None  # --guard-texts documents (the long-context guard's probe text)
    kl_text_tasks: dict | None = None  # --kl-text lm-eval:NAME: its generative tasks (lm-eval Task objects)


def lm_eval_spec(settings: Settings) -> LmEvalSpec:
    return LmEvalSpec(settings.task, settings.lm_eval_include, settings.num_fewshot, settings.task_limit)


def load_questions(settings: Settings) -> tuple[TaskData, TaskData]:
    """(the verification questions of ``settings.task``, the whole task)."""
    if is_lm_eval(settings.task):
        tasks = load_tasks(lm_eval_spec(settings))
        if any(t.OUTPUT_TYPE != "multiple_choice" for t in tasks.values()):  # read by lm-eval itself (eval)
            other = TaskData(f"lm-eval {', '.join(tasks)}", [], task=settings.task, notes=[NOT_CHOICES])
            return other, other
        full = multiple_choice_data(tasks, None, settings.lm_eval_metric)
        return full.subset(settings.task_limit), full
    if settings.task in MMLU_TASKS:
        full = load_mmlu(settings.mmlu, task=settings.task)
        return mmlu_selection(full, settings, settings.mmlu_per_subject), full
    full = load_task(settings.task, settings.task_data)
    return full.subset(settings.task_limit), full


def mmlu_selection(full: TaskData, settings: Settings, per_subject: int | None) -> TaskData:
    """The first ``per_subject`` questions of each of ``settings.mmlu_subjects`` (None: every question)."""
    subjects = list(settings.mmlu_subjects) if isinstance(settings.mmlu_subjects, tuple) else settings.mmlu_subjects
    return full.subset(per_subject, subjects)


def with_questions_per_subject(settings: Settings, inputs: Inputs) -> Inputs:
    """``inputs`` with the MMLU selection (and its confirmation questions) at ``settings.mmlu_per_subject``."""
    questions = mmlu_selection(inputs.all_questions, settings, settings.mmlu_per_subject)
    questions, confirmation, why = confirmation_questions(settings, questions, inputs.all_questions)
    return dataclasses.replace(inputs, questions=questions, confirmation=confirmation, confirmation_source=why)


def load_inputs(settings: Settings, source: ModelSource | None = None, config=None,
                read: tuple[str, ...] = ()) -> Inputs:
    """Everything ``settings`` points to, read now: a bad path or file fails in seconds, before the weights load.
    ``read``: the other local paths the command reads (a heads file, ...), guarded like the settings' own."""
    source = source or resolve_source(settings.model)
    config = config or load_config(source, settings.trust_remote_code, settings.revision)
    questions, full = load_questions(settings)
    if not sum(len(s.questions) for s in questions.subjects) and NOT_CHOICES not in questions.notes:
        raise UserError(f"the {settings.task} selection leaves no questions to evaluate (every row is an exemplar or "
                        "was skipped); select more subjects or questions, or pass a larger file")
    calibration = rest = None
    if settings.calibration:
        texts = load_calibration(settings.calibration)
        calibration, rest = texts[:settings.calibration_size], texts[settings.calibration_size:]
    kl_text = kl_text_tasks = None
    if is_lm_eval(settings.kl_text):
        kl_text_tasks = generative_tasks(settings)
    elif settings.kl_text:
        kl_text = load_calibration(settings.kl_text, settings.kl_text_size, "held-out text file")
    heal_text = load_calibration(settings.heal_data, what="healing text file") if settings.heal_data else None
    guard_texts = (load_calibration(settings.guard_texts, what="guard text file")
                   if settings.guard_texts and settings.guard else None)
    questions, confirmation, why = confirmation_questions(settings, questions, full)
    return Inputs(source, config, questions, full, calibration, rest, kl_text, heal_text,
                  input_paths(settings, source) + tuple(read), confirmation, why, guard_texts, kl_text_tasks)


def generative_tasks(settings: Settings) -> dict:
    """``kl_text`` lm-eval:NAME[,NAME...]: its tasks, each generative (the documents' generations are the text) or a
    perplexity task (the documents are)."""
    tasks = load_tasks(LmEvalSpec(settings.kl_text, settings.lm_eval_include, settings.num_fewshot))
    for name, task in tasks.items():
        if task.OUTPUT_TYPE not in ("generate_until", "loglikelihood_rolling"):
            raise UserError(f"`kl_text` {settings.kl_text}: lm-eval task {name} is {task.OUTPUT_TYPE}, not "
                            "generate_until or loglikelihood_rolling; the next-token KL reads generations or "
                            "documents (a multiple-choice task is a `task` lm-eval:NAME)")
        if samples(task):
            raise UserError(f"`kl_text` {settings.kl_text}: lm-eval task {name} samples its generations (do_sample: "
                            "true), so whether the ablated model generates the same would be chance; the label-free "
                            "measures need greedy generation: drop do_sample from the task's generation_kwargs")
        if settings.metric == "same-generation" and task.OUTPUT_TYPE != "generate_until":
            raise UserError(f"`metric` same-generation compares generations, but lm-eval task {name} is "
                            f"{task.OUTPUT_TYPE} (it generates nothing); use `metric` kl-text or token-agreement "
                            "for it, or name a generate_until task in `kl_text`")
    return tasks


def confirmation_questions(settings: Settings, questions: TaskData,
                           full: TaskData) -> tuple[TaskData, TaskData | None, str]:
    """(search questions, confirmation questions or None, where they come from or why there are none)."""
    if not settings.confirm:
        return questions, None, "not confirmed: `no_confirm`"
    if settings.on_text and is_lm_eval(settings.kl_text) and not settings.heal_in_search:
        return questions, None, (f"the budget's {settings.metric} on the next {settings.kl_text_size} documents of "
                                 f"each task of {settings.kl_text}, never searched")
    if settings.on_text or settings.heal_in_search:
        return questions, None, ("not confirmed: the budget is measured on held-out text" if settings.on_text
                                 else "not confirmed: `heal_in_search` judges healed models")
    unused = full.unused(questions)
    if unused.questions:
        return questions, unused, f"{len(unused.questions)} further questions of the same subjects, never searched"
    if settings.confirm_fraction > 0:
        search, held = questions.split(settings.confirm_fraction)
        if held.questions and search.questions:
            return search, held, (f"the last {100 * settings.confirm_fraction:g}% of each subject's questions, held "
                                  "out of the search (`confirm_fraction`)")
    return questions, None, ("not confirmed: the search uses every question; pass `confirm_fraction` F to hold "
                             "some out")


def input_paths(settings: Settings, source: ModelSource) -> tuple[str, ...]:
    """The local files and directories a run's settings read: the model (its directory, or its .gguf file), the
    recipe, the data files, the adapter, and every file its lm-eval tasks read (YAMLs, data, few-shot files,
    ``!function`` modules)."""
    model = [] if source.kind == "hub" else [str(Path(source.path) / source.gguf_file) if source.gguf_file
                                             else source.path]
    kl_text = None if is_lm_eval(settings.kl_text) else settings.kl_text
    files = [settings.recipe.path, settings.calibration, kl_text, settings.heal_data, settings.task_data,
             settings.lora_adapter, settings.guard_texts, settings.lm_eval_include]
    if settings.mmlu and Path(settings.mmlu).exists():
        files.append(settings.mmlu)
    for task in (settings.task, settings.kl_text):
        if is_lm_eval(task):
            files += task_files(LmEvalSpec(task, settings.lm_eval_include))
    return tuple(model + [f for f in files if f])


def round_robin(per_subject: list[list], n: int) -> list:
    """The first ``n`` items taking one from each subject in turn: a small sample still covers every subject."""
    out, depth = [], 0
    while len(out) < n and any(depth < len(items) for items in per_subject):
        out += [items[depth] for items in per_subject if depth < len(items)]
        depth += 1
    return out[:n]


def encoded_texts(lm: LoadedModel, texts: list[str], max_length: int, source: str) -> list[list[int]]:
    seqs = [x for x in (encode(lm, t)[:max_length] for t in texts) if len(x) >= 2]
    if not seqs:
        raise UserError(f"the text from {source} has no input of at least 2 tokens")
    return seqs


def held_out_texts(settings: Settings, inputs: Inputs, n: int, need: str, flag: str) -> tuple[list[str], str]:
    """Up to ``n`` questions of the task that are neither evaluated nor exemplars, with their answers, as text."""
    questions = inputs.all_questions.held_out(inputs.questions, n)
    if not questions:
        raise UserError(
            f"{need} needs held-out text, but every {settings.task} question is evaluated; pass {flag} FILE "
            "or evaluate fewer questions"
        )
    fmt = task_format(settings.task)
    return [
        fmt.gold_text(q) for q in questions
    ], f"{len(questions)} held-out {settings.task} questions with their answers"


def calibration_sequences(
    lm: LoadedModel, settings: Settings, inputs: Inputs, enc: EncodedTask | None
) -> tuple[list[list[int]], str]:
    """Token sequences to score on: the user's texts, or else the task prompts themselves, taken round-robin
    over subjects so a small calibration set still covers every subject."""
    if inputs.calibration is not None:
        seqs = [s for s in (encode(lm, t)[: settings.max_length] for t in inputs.calibration) if len(s) >= 2]
        if not seqs:
            raise UserError(f"calibration file {settings.calibration} has no text of at least 2 tokens")
        return seqs, f"file {settings.calibration}"
    assert enc is not None
    # Truncated like calibration texts: a few 5-shot prompts run to thousands of tokens, and attention (with the
    # statistics the scoring pass collects) costs the square of that.
    seqs = [
        x[: settings.max_length]
        for x in round_robin([[it.context for it in s.items] for s in enc.subjects], settings.calibration_size)
    ]
    return seqs, f"{settings.task} prompts of the verification questions (first {settings.max_length} tokens)"


KL_TEXT_MAX_TOKENS = 256  # per held-out text: the next-token KL needs full-vocabulary logits at every position


def kl_texts(work: Work, settings: Settings, inputs: Inputs) -> tuple[HeldOutText | None, HeldOutText | None]:
    """(the text the next-token KL is measured on, the further text a point is confirmed on or None), never seen by
    scoring or verification: ``kl_text`` lm-eval:NAME (``generation_texts``), a ``kl_text`` file, else the calibration
    file's lines after the ones scored, else held-out questions of the task with their correct answers. Measured only
    when the budget is in next-token KL or ``kl_text`` is given (it costs two forward passes per evaluated point)."""
    if not settings.on_text and not settings.kl_text:
        return None, None
    if inputs.kl_text_tasks is not None:
        return lm_eval_texts(work, settings, inputs.kl_text_tasks)
    n = settings.kl_text_size
    if inputs.kl_text is not None:
        texts, source = inputs.kl_text, f"file {settings.kl_text}"
    elif inputs.calibration is not None:
        texts = inputs.calibration_rest[:n]
        source = f"lines after the first {settings.calibration_size} of {settings.calibration}"
        if not texts:
            raise UserError(
                f"`metric` kl-text needs held-out text, but {settings.calibration} has no lines after the "
                f"{settings.calibration_size} used for scoring; pass `kl_text` FILE"
            )
    else:
        texts, source = held_out_texts(settings, inputs, n, "`metric` kl-text", "`kl_text`")
        source += " (not evaluated, not scored)"
    return HeldOutText(encoded_texts(work.lm, texts, KL_TEXT_MAX_TOKENS, source), source), None


def lm_eval_texts(work: Work, settings: Settings, tasks: dict) -> tuple[HeldOutText, HeldOutText | None]:
    """``kl_text`` lm-eval:NAME: of a generative task, each document's prompt followed by the unablated model's own
    greedy generation (eval.lm_eval_bridge.reference_generations), the KL read on the generated tokens only; of a
    perplexity task, each document's text as lm-eval scores it, every token read. Each task's first
    ``kl_text_size`` documents are the search's text, its next ``kl_text_size`` (unless ``no_confirm``) the
    confirmation's. Generated once per model and task definition (cached: a resumed run never generates again)."""
    n = settings.kl_text_size
    rows = lm_eval_rows(work, settings, tasks, 2 * n if settings.confirm else n)
    generative = {k for k, t in tasks.items() if t.OUTPUT_TYPE == "generate_until"}
    search, confirm = [], []
    for name in tasks:
        mine = [r for r in rows if r["task"] == name and r["generated"] > 0]
        search += mine[:n]
        confirm += mine[n:]
    if not search:
        raise UserError(f"`kl_text` {settings.kl_text}: no document has a token to read (the unablated model "
                        "generated nothing, or the texts are empty); check the task's stop sequences (until), "
                        "prompts and data")

    def held_out(part: list[dict], which: str) -> HeldOutText:
        pieces = []
        for name in tasks:
            mine = [r for r in part if r["task"] == name]
            if mine and name in generative:
                pieces.append(f"{which} {len(mine)} documents of lm-eval {name} with the unablated model's own greedy "
                              f"generations ({sum(r['generated'] for r in mine)} generated tokens, the only ones read)")
            elif mine:
                pieces.append(f"{which} {len(mine)} documents of lm-eval {name} (their text as lm-eval scores it, "
                              f"every token of the first {KL_TEXT_MAX_TOKENS} read)")
        return HeldOutText([r["ids"] for r in part], "; ".join(pieces), [r["generated"] for r in part])

    return held_out(search, "the first"), (held_out(confirm, "the next") if confirm else None)


def lm_eval_rows(work: Work, settings: Settings, tasks: dict, limit: int) -> list[dict]:
    """The first ``limit`` documents of each task as token rows ``{"task", "doc_id", "ids", "generated"}``: of a
    generative task, the prompt and the unablated model's own greedy generation (``generated``: its tokens, the ones
    read); of a perplexity task, the text lm-eval scores (its first KL_TEXT_MAX_TOKENS tokens, every one read)."""
    generative = {k: t for k, t in tasks.items() if t.OUTPUT_TYPE == "generate_until"}
    rows = _reference_rows(work, settings, generative, limit) if generative else []
    for name, task in tasks.items():
        if name not in generative:
            ids = [(d, encode(work.lm, text)[:KL_TEXT_MAX_TOKENS]) for d, text in rolling_texts(task, limit)]
            rows += [{"task": name, "doc_id": d, "ids": x, "generated": len(x) - 1} for d, x in ids if len(x) >= 2]
    return rows


def _reference_rows(work: Work, settings: Settings, tasks: dict, limit: int) -> list[dict]:
    """The unablated model's generations of ``tasks``' first ``limit`` documents, as token rows (cached)."""
    key = {"tasks": task_identity(tasks), "limit": limit, "num_fewshot": settings.num_fewshot,
           "ids": "as generated"}  # the generated tokens themselves, not the text encoded again
    rows = _generated_rows(work.recall("generations", key))
    if rows is None:
        from prune_heads.eval.lm_eval_bridge import reference_generations

        rows = reference_generations(work.lm, tasks, limit, work.batch_size, work.progress, work.ranks)
        rows = _generated_rows(work.remember("generations", key, _generated_tensors(rows)))
    return rows


def _generated_tensors(rows: list[dict]) -> dict:
    return {"ids": torch.tensor([t for r in rows for t in r["ids"]], dtype=torch.int64),
            "lengths": torch.tensor([len(r["ids"]) for r in rows], dtype=torch.int64),
            "generated": torch.tensor([r["generated"] for r in rows], dtype=torch.int64),
            "doc_ids": torch.tensor([r["doc_id"] for r in rows], dtype=torch.int64),
            "task_names": torch.tensor(list(json.dumps([r["task"] for r in rows]).encode()), dtype=torch.uint8)}


def _generated_rows(tensors: dict | None) -> list[dict] | None:
    if tensors is None:
        return None
    names = json.loads(bytes(tensors["task_names"].tolist()).decode())
    ids = tensors["ids"].split(tensors["lengths"].tolist())
    return [{"task": t, "doc_id": int(d), "ids": i.tolist(), "generated": int(g)}
            for t, d, i, g in zip(names, tensors["doc_ids"], ids, tensors["generated"])]


def heal_sequences(
    lm: LoadedModel, settings: Settings, inputs: Inputs, steps: int, batch_size: int, max_length: int
) -> tuple[list[list[int]], str]:
    """Healing text, never the questions being verified: --heal-data, else the --calibration file, else held-out
    questions of the task with their answers (as many as the steps consume, at most 1024)."""
    if inputs.heal_text is not None:
        texts, source = inputs.heal_text, f"file {settings.heal_data}"
    elif inputs.calibration is not None:
        texts, source = inputs.calibration + inputs.calibration_rest, f"calibration file {settings.calibration}"
    else:
        texts, source = held_out_texts(settings, inputs, min(1024, steps * batch_size), "healing", "`heal_data`")
        source += " (never the verified ones)"
    return encoded_texts(lm, texts, max_length, source), source


def compare_texts(settings: Settings, inputs: Inputs) -> list[str]:
    """``compare``'s texts: the calibration file, else the task prompts as text (each model tokenises them its own
    way), round-robin over subjects."""
    if inputs.calibration is not None:
        return inputs.calibration
    fmt = task_format(settings.task)
    return round_robin(
        [[fmt.requests(s, q)[0][0] for q in s.questions] for s in inputs.questions.subjects], settings.calibration_size
    )
