"""Multiple-choice tasks as lm-evaluation-harness defines them: the questions (``Question`` grouped into
``Subject``s inside ``TaskData``) and, per task, how a question becomes one (context, continuation) request per
choice.

Every task is scored the lm-eval way: the log-likelihood of each choice's continuation given its context; ``acc``
takes the highest, ``acc_norm`` the highest per character of the choice text (``Question.norm_lengths``).

| task | prompt (lm-eval task) | continuation | metric |
|---|---|---|---|
| ``mmlu`` | 5-shot, ``{q}\\nA. ..\\nD. ..\\nAnswer:`` (mmlu/default) | `` A`` .. `` D`` | acc |
| ``mmlu-cloze`` | 0-shot, ``Question: {q}\\nAnswer:`` (mmlu/continuation) | `` {choice}`` | acc_norm |
| ``arc_easy``, ``arc_challenge`` | ``Question: {q}\\nAnswer:`` | `` {choice}`` | acc_norm |
| ``hellaswag`` | ``{activity}: {ctx_a} {Ctx_b}`` (preprocessed) | `` {ending}`` | acc_norm |
| ``piqa`` | ``Question: {goal}\\nAnswer:`` | `` {solution}`` | acc_norm |
| ``winogrande`` | the sentence up to the blank, with each option filled in | `` {rest of sentence}`` | acc |

The non-MMLU tasks read local files in their Hub schemas (``allenai/ai2_arc``, ``Rowan/hellaswag``,
``ybisk/piqa``, ``allenai/winogrande``), JSONL or Parquet; rows without a usable label are skipped and counted.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from prune_heads.errors import UserError
from prune_heads.io.readers import parse_json, read_text

LETTERS = ("A", "B", "C", "D", "E", "F", "G", "H")


@dataclass(frozen=True)
class Question:
    subject: str  # the group it belongs to: an MMLU subject with spaces ("high school biology"), or the task name
    index: int  # row index in the source file, for audit
    question: str  # the question text (HellaSwag: the context; WinoGrande: the sentence with its "_" blank)
    choices: tuple[str, ...]
    gold: int  # index into choices
    # acc_norm: the prediction is argmax(loglik / length) with these lengths (characters of each choice, as lm-eval);
    # None for acc (argmax of the raw log-likelihoods).
    norm_lengths: tuple[float, ...] | None = None


@dataclass
class Subject:
    name: str
    exemplars: list[Question]
    questions: list[Question]


@dataclass
class TaskData:
    """The questions of one task, grouped by subject (MMLU's 57; one group for the other tasks)."""

    source: str
    subjects: list[Subject]
    skipped_rows: int = 0  # rows dropped by validation (no usable label, a missing field)
    exemplar_source: str = "first 5 questions of each subject (never scored)"
    notes: list[str] = field(default_factory=list)
    task: str = "mmlu"

    @property
    def questions(self) -> list[Question]:
        return [q for s in self.subjects for q in s.questions]

    def subset(self, per_subject: int | None, subjects: int | list[str] | None = None) -> "TaskData":
        """The first ``per_subject`` remaining questions of each subject, in file order (deterministic);
        ``subjects`` keeps the first N subjects in file order, or the named ones."""
        chosen = self.subjects
        if isinstance(subjects, int):
            chosen = chosen[:subjects]
        elif subjects:
            names = {s.replace("_", " ").strip().lower() for s in subjects}
            unknown = names - {s.name for s in chosen}
            if unknown:
                raise UserError(
                    f"unknown MMLU subject(s): {', '.join(sorted(unknown))}; see the {len(chosen)} names in "
                    f"{self.source}"
                )
            chosen = [s for s in chosen if s.name in names]
        out = [Subject(s.name, s.exemplars, s.questions[:per_subject] if per_subject else s.questions) for s in chosen]
        return replace(self, subjects=[s for s in out if s.questions])

    def unused(self, evaluated: "TaskData") -> "TaskData":
        """Questions of ``evaluated``'s subjects that it does not evaluate (never exemplars), up to as many per subject
        as it evaluates, in file order: confirmation questions that no search has seen."""
        used = {(q.subject, q.index) for q in evaluated.questions}
        mine = {s.name: s for s in self.subjects}
        out = []
        for s in evaluated.subjects:
            rest = [q for q in mine[s.name].questions if (q.subject, q.index) not in used] if s.name in mine else []
            out.append(Subject(s.name, s.exemplars, rest[: len(s.questions)]))
        return replace(self, subjects=[s for s in out if s.questions])

    def split(self, fraction: float) -> tuple["TaskData", "TaskData"]:
        """(search, confirmation): the last ``ceil(fraction x n)`` questions of each subject confirm (at least one
        stays for the search), deterministic and stratified by subject."""
        search, confirm = [], []
        for s in self.subjects:
            k = min(len(s.questions) - 1, math.ceil(fraction * len(s.questions)))
            search.append(Subject(s.name, s.exemplars, s.questions[: len(s.questions) - k]))
            confirm.append(Subject(s.name, s.exemplars, s.questions[len(s.questions) - k:]))
        return (replace(self, subjects=[s for s in search if s.questions]),
                replace(self, subjects=[s for s in confirm if s.questions]))

    def held_out(self, evaluated: "TaskData", n: int) -> list[Question]:
        """Up to ``n`` questions that are neither evaluated nor exemplars, round-robin over subjects: text for the
        next-token KL that no verification question has seen."""
        used = {(q.subject, q.index) for q in evaluated.questions}
        per_subject = [[q for q in s.questions if (q.subject, q.index) not in used] for s in self.subjects]
        out, depth = [], 0
        while len(out) < n and any(depth < len(qs) for qs in per_subject):
            out += [qs[depth] for qs in per_subject if depth < len(qs)]
            depth += 1
        return out[:n]


# ---------------------------------------------------------------------------------------------------------------
# Prompt formats


class TaskFormat:
    """How a question of one task becomes lm-eval requests. Subclasses set the prompt; ``requests`` returns one
    (context, continuation) pair per choice, the continuation starting with lm-eval's target delimiter " "."""

    name: str
    metric = "acc_norm"  # the lm-eval metric the task is reported with
    num_fewshot = 0
    shared_prefix = False  # no prefix text: the subject's contexts share the tokens they all start with

    def description(self, subject: str) -> str:
        return ""

    def text(self, q: Question) -> str:
        raise NotImplementedError

    def prefix(self, subject: Subject) -> str:
        """What every context of the subject starts with (description and few-shot exemplars)."""
        return self.description(subject.name)

    def requests(self, subject: Subject, q: Question) -> list[tuple[str, str]]:
        context = self.prefix(subject) + self.text(q)
        return [(context, " " + c) for c in q.choices]

    def gold_text(self, q: Question) -> str:
        """The question with its correct answer, 0-shot, as plain text (held-out text for the next-token KL)."""
        return f"{self.text(q)} {q.choices[q.gold]}"

    def norm_lengths(self, choices: tuple[str, ...]) -> tuple[float, ...] | None:
        return tuple(float(len(c)) for c in choices) if self.metric == "acc_norm" else None


class MMLULetters(TaskFormat):
    """lm-eval ``mmlu`` (tasks/mmlu/default): 5-shot, answer letters (the paper's metric)."""

    name = "mmlu"
    metric = "acc"
    num_fewshot = 5

    def description(self, subject):
        return f"The following are multiple choice questions (with answers) about {subject}.\n\n"

    def text(self, q):
        lines = [q.question.strip()] + [f"{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices)]
        return "\n".join(lines) + "\nAnswer:"

    def prefix(self, subject):
        return self.description(subject.name) + "".join(
            f"{self.text(e)} {LETTERS[e.gold]}\n\n" for e in subject.exemplars
        )

    def gold_text(self, q):  # the 0-shot cloze form: an exemplar-free question with its answer text
        return TASKS["mmlu-cloze"].gold_text(q)

    def requests(self, subject, q):
        context = self.prefix(subject) + self.text(q)
        return [(context, " " + letter) for letter in LETTERS[: len(q.choices)]]


class MMLUCloze(TaskFormat):
    """lm-eval ``mmlu_continuation``: 0-shot, each answer's text as the continuation, acc_norm."""

    name = "mmlu-cloze"

    def description(self, subject):
        return f"The following are questions (with answers) about {subject}.\n\n"

    def text(self, q):
        return f"Question: {q.question.strip()}\nAnswer:"


class QuestionAnswer(TaskFormat):
    """``Question: {q}\\nAnswer:`` then `` {choice}``: lm-eval's arc_easy, arc_challenge and piqa."""

    def __init__(self, name: str):
        self.name = name

    def text(self, q):
        return f"Question: {q.question}\nAnswer:"


class HellaSwag(TaskFormat):
    name = "hellaswag"

    def text(self, q):
        return q.question  # already preprocessed on load (_hellaswag_row)


class WinoGrande(TaskFormat):
    """Partial evaluation (Trinh & Le 2018), as lm-eval: the contexts differ (the sentence up to the blank with each
    option filled in) and the continuation, the rest of the sentence, is the same."""

    name = "winogrande"
    metric = "acc"

    def requests(self, subject, q):
        blank = q.question.index("_")
        rest = q.question[blank + 1 :].strip()
        return [(q.question[:blank] + option, " " + rest) for option in q.choices]

    def gold_text(self, q):
        return q.question.replace("_", q.choices[q.gold], 1)


class LmEvalFormat(TaskFormat):
    """A multiple-choice task of lm-evaluation-harness (data/lm_eval_tasks.py): each question holds the context lm-eval
    rendered (few-shot exemplars included) and the continuations lm-eval wrote (target delimiter included); the
    shared prefix of a task's contexts is found from the tokens (``shared_prefix``)."""

    name = "lm-eval"
    metric = "acc"
    shared_prefix = True

    def text(self, q):
        return q.question

    def requests(self, subject, q):
        return [(q.question, c) for c in q.choices]

    def gold_text(self, q):
        return q.question + q.choices[q.gold]


LM_EVAL = LmEvalFormat()

TASKS: dict[str, TaskFormat] = {
    t.name: t
    for t in (
        MMLULetters(),
        MMLUCloze(),
        QuestionAnswer("arc_easy"),
        QuestionAnswer("arc_challenge"),
        HellaSwag(),
        QuestionAnswer("piqa"),
        WinoGrande(),
    )
}
MMLU_TASKS = ("mmlu", "mmlu-cloze")  # read from the MMLU source (--mmlu); the others from --task-data


def results_file(task: str) -> str:
    """The per-question results file of ``task``: ``mmlu.jsonl``; ``lm-eval_NAME+NAME.jsonl`` for lm-eval tasks."""
    return task.replace(":", "_").replace(",", "+").replace("/", "_") + ".jsonl"


def task_format(name: str) -> TaskFormat:
    if name.startswith(LM_EVAL.name + ":"):
        return LM_EVAL
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]


# ---------------------------------------------------------------------------------------------------------------
# Loading the non-MMLU tasks from local files in their Hub schemas


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag ``preprocess``: strip, " [title]" -> ". ", drop [bracketed] markers, squeeze double
    spaces."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _arc_row(row: dict) -> tuple[str, tuple[str, ...], int]:
    labels, texts = list(row["choices"]["label"]), list(row["choices"]["text"])
    return row["question"], tuple(texts), labels.index(row["answerKey"])


def _hellaswag_row(row: dict) -> tuple[str, tuple[str, ...], int]:
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_preprocess(row["activity_label"] + ": " + context)
    return query, tuple(_hellaswag_preprocess(e) for e in row["endings"]), int(row["label"])


def _piqa_row(row: dict) -> tuple[str, tuple[str, ...], int]:
    label = int(row["label"])
    if label not in (0, 1):
        raise ValueError("unlabelled")
    return row["goal"], (row["sol1"], row["sol2"]), label


def _winogrande_row(row: dict) -> tuple[str, tuple[str, ...], int]:
    if "_" not in row["sentence"]:
        raise ValueError("no blank")
    return row["sentence"], (row["option1"], row["option2"]), {"1": 0, "2": 1}[str(row["answer"])]


ROW_PARSERS = {
    "arc_easy": _arc_row,
    "arc_challenge": _arc_row,
    "hellaswag": _hellaswag_row,
    "piqa": _piqa_row,
    "winogrande": _winogrande_row,
}
SCHEMAS = {
    "arc_easy": "allenai/ai2_arc (question, choices {text, label}, answerKey)",
    "arc_challenge": "allenai/ai2_arc (question, choices {text, label}, answerKey)",
    "hellaswag": "Rowan/hellaswag (activity_label, ctx_a, ctx_b, endings, label)",
    "piqa": "ybisk/piqa (goal, sol1, sol2, label)",
    "winogrande": "allenai/winogrande (sentence, option1, option2, answer)",
}


def read_rows(path: Path) -> list[dict]:
    """Rows of a .jsonl (one JSON object per line) or .parquet file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"reading {path} needs pyarrow; install it with: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    rows = []
    for n, line in enumerate(read_text(path, "task file", "rows").splitlines(), 1):
        if line.strip():
            rows.append(parse_json(line, path, "task file", line=n))
    return rows


def load_task(task: str, path: str | None) -> TaskData:
    """A non-MMLU task from a local file in its Hub schema (0-shot, as lm-eval runs these tasks)."""
    fmt = task_format(task)
    if task in MMLU_TASKS:
        raise ValueError("MMLU tasks are read by data.mmlu.load_mmlu")
    if not path:
        raise UserError(
            f"`task` {task} needs its questions: pass `task_data` FILE, a .jsonl or .parquet file in the "
            f"{SCHEMAS[task]} schema (downloaded from the Hub once)"
        )
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"`task_data` {path} does not exist; pass a .jsonl or .parquet file in the {SCHEMAS[task]} schema"
        )
    questions, skipped = [], 0
    for i, row in enumerate(read_rows(p)):
        try:
            text, choices, gold = ROW_PARSERS[task](row)
            if (
                not isinstance(text, str)
                or not all(isinstance(c, str) for c in choices)
                or not 0 <= gold < len(choices)
            ):
                raise ValueError("bad types")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            skipped += 1
            continue
        questions.append(Question(task, i, text, choices, gold, fmt.norm_lengths(choices)))
    if not questions:
        raise UserError(f"`task_data` {path} has no usable {task} rows; expected the {SCHEMAS[task]} schema")
    return TaskData(str(p), [Subject(task, [], questions)], skipped, "none (0-shot)", task=task)
