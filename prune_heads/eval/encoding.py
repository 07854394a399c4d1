"""Questions as token ids, as lm-evaluation-harness tokenises them (HFLM), grouped by subject so the passes can
share each subject's few-shot prefix.

Tokenisation: trailing spaces of the context move to the continuation, ``context_enc = enc(context)``,
``continuation_enc = enc(context + continuation)[len(context_enc):]``, no special tokens (BOS only where the family
needs it), and the model reads ``(context_enc + continuation_enc)[:-1]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prune_heads.data.tasks import Question, TaskData, task_format
from prune_heads.models.loading import LoadedModel
from prune_heads.models.tokens import encode, encode_pair


@dataclass
class EncodedQuestion:
    question: Question
    context: list[int]  # the context of every choice (WinoGrande: of the first; see contexts)
    continuations: list[list[int]]  # one per choice
    fast: bool  # context extends the subject prefix and every continuation is one token
    contexts: list[list[int]] | None = None  # one per choice where they differ (WinoGrande's partial evaluation)

    def request(self, choice: int) -> tuple[list[int], list[int]]:
        return (self.contexts[choice] if self.contexts else self.context), self.continuations[choice]


@dataclass
class EncodedSubject:
    name: str
    prefix: list[int]
    items: list[EncodedQuestion]


@dataclass
class EncodedTask:
    subjects: list[EncodedSubject]
    task: str = "mmlu"

    @property
    def items(self) -> list[EncodedQuestion]:
        return [it for s in self.subjects for it in s.items]

    @property
    def num_choices(self) -> int:
        return max((len(it.continuations) for it in self.items), default=4)

    def __len__(self) -> int:
        return sum(len(s.items) for s in self.subjects)


def split_blocks(enc: EncodedTask, blocks: int) -> list[EncodedTask]:
    """``blocks`` parts of the task for sequential evaluation: subjects dealt round-robin, so every part samples the
    whole range of subjects (a task with one subject is cut into runs of questions)."""
    if len(enc.subjects) >= blocks:
        return [EncodedTask(enc.subjects[b::blocks], enc.task) for b in range(blocks)]
    parts = []
    for b in range(blocks):
        subjects = [EncodedSubject(s.name, s.prefix, s.items[b::blocks]) for s in enc.subjects]
        parts.append(EncodedTask([s for s in subjects if s.items], enc.task))
    return [p for p in parts if len(p)]


def task_span(enc: EncodedTask, lo: int, hi: int) -> EncodedTask:
    """Questions ``lo`` to ``hi`` of the task (in ``items`` order), each subject keeping its shared prefix."""
    subjects, offset = [], 0
    for s in enc.subjects:
        a, b = max(lo - offset, 0), min(hi - offset, len(s.items))
        if a < b:
            subjects.append(EncodedSubject(s.name, s.prefix, s.items[a:b]))
        offset += len(s.items)
    return EncodedTask(subjects, enc.task)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_task(lm: LoadedModel, data: TaskData) -> EncodedTask:
    fmt = task_format(data.task)
    subjects = []
    for subject in data.subjects:
        prefix_text = fmt.prefix(subject)
        prefix = encode(lm, prefix_text) if prefix_text else []
        items = []
        for q in subject.questions:
            pairs = [encode_pair(lm, c, cont) for c, cont in fmt.requests(subject, q)]
            contexts = [p[0] for p in pairs]
            same = all(c == contexts[0] for c in contexts)
            item = EncodedQuestion(q, contexts[0], [p[1] for p in pairs], same and all(len(p[1]) == 1 for p in pairs),
                                   None if same else contexts)
            items.append(item)
        if fmt.shared_prefix and items:  # lm-eval's own prompts: whatever every context starts with (exemplars)
            prefix = items[0].context
        # The prefix's last tokens can merge differently once the question follows ("\n\n" vs "\n","\n"), so
        # share only the tokens every context really starts with.
        shared = min([len(prefix)] + [min(_common_prefix_len(prefix, it.context), len(it.context) - 1)
                                      for it in items])
        for it in items:
            it.fast = it.fast and shared > 0
        subjects.append(EncodedSubject(subject.name, prefix[: max(shared, 0)], items))
    return EncodedTask(subjects, data.task)
