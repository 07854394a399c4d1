"""MMLU 5-shot log-likelihood evaluation, as lm-evaluation-harness computes it, with and without ablation.

Tokenisation follows lm-eval's HFLM: ``context_enc = enc(context)``, ``continuation_enc =
enc(context + " A")[len(context_enc):]``, no special tokens (BOS only where the family needs it), and the
model reads ``(context_enc + continuation_enc)[:-1]``.

Two paths compute the same numbers:
- ``evaluate_reference``: one full sequence per question and choice, nothing shared (the definition);
- ``evaluate``: within a subject every prompt starts with the same description and five exemplars, so their
  KV cache is computed once per subject and ablation mask, and only the question tokens run on top of it, in
  batches; only the answer position's logits are computed. Questions whose tokens do not extend the prefix
  tokens, or whose answers are not single tokens, go through the reference path.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .ablation import HeadAblation, mask_for
from .data.mmlu import LETTERS, MMLUData, MMLUQuestion, build_prompt, fewshot_prefix
from .heads import HeadSet
from .models.loading import LoadedModel
from .pruning import PrunePlan


def encode(lm: LoadedModel, text: str) -> list[int]:
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    if lm.adapter.add_bos_for_eval and lm.tokenizer.bos_token_id is not None:
        ids = [lm.tokenizer.bos_token_id] + ids
    return ids


@dataclass
class EncodedQuestion:
    question: MMLUQuestion
    context: list[int]
    continuations: list[list[int]]  # one per letter
    fast: bool  # context extends the subject prefix and every continuation is one token


@dataclass
class EncodedSubject:
    name: str
    prefix: list[int]
    items: list[EncodedQuestion]


@dataclass
class EncodedMMLU:
    subjects: list[EncodedSubject]

    @property
    def items(self) -> list[EncodedQuestion]:
        return [it for s in self.subjects for it in s.items]

    def __len__(self) -> int:
        return sum(len(s.items) for s in self.subjects)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_mmlu(lm: LoadedModel, data: MMLUData) -> EncodedMMLU:
    subjects = []
    for subject in data.subjects:
        prefix_text = encode(lm, fewshot_prefix(subject))
        items, shared = [], len(prefix_text)
        for q in subject.questions:
            context_text = build_prompt(subject, q)
            context = encode(lm, context_text)
            conts = [encode(lm, context_text + " " + letter)[len(context) :] for letter in LETTERS]
            items.append(EncodedQuestion(q, context, conts, all(len(c) == 1 for c in conts)))
            # The prefix's last tokens can merge differently once the question follows ("\n\n" vs "\n","\n"), so
            # share only the tokens every context really starts with.
            shared = min(shared, _common_prefix_len(prefix_text, context), len(context) - 1)
        for it in items:
            it.fast = it.fast and shared > 0
        subjects.append(EncodedSubject(subject.name, prefix_text[: max(shared, 0)], items))
    return EncodedMMLU(subjects)


@dataclass
class EvalResult:
    """Per-question log-likelihoods of the four answers, in question order."""

    questions: list[MMLUQuestion]
    loglik: torch.Tensor  # [N, 4] float64
    label: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def gold(self) -> torch.Tensor:
        return torch.tensor([q.gold for q in self.questions])

    @property
    def pred(self) -> torch.Tensor:
        return self.loglik.argmax(dim=-1)

    @property
    def correct(self) -> torch.Tensor:
        return (self.pred == self.gold).double()

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean()) if len(self.questions) else float("nan")

    def rows(self) -> list[dict]:
        return [
            {
                "subject": q.subject,
                "index": q.index,
                "gold": LETTERS[q.gold],
                "pred": LETTERS[int(p)],
                "loglik": [round(float(x), 6) for x in ll],
            }
            for q, p, ll in zip(self.questions, self.pred, self.loglik)
        ]


# A mask provider: None (no ablation), one HeadSet / PrunePlan / [L, H] tensor for every question, a
# [N, L, H] tensor, or a per-question function ``question_index -> [L, H] tensor`` (dynamic ablation).
MaskSpec = HeadSet | PrunePlan | torch.Tensor | Callable[[int], torch.Tensor] | None


def _mask_getter(lm: LoadedModel, masks: MaskSpec) -> Callable[[int], torch.Tensor | None]:
    if masks is None:
        return lambda i: None
    if isinstance(masks, HeadSet):
        m = mask_for(lm, masks)
        return lambda i: m
    if isinstance(masks, PrunePlan):
        return lambda i: masks
    if isinstance(masks, torch.Tensor):
        return (lambda i: masks[i]) if masks.dim() == 3 else (lambda i: masks)
    return masks


def _logprobs_at(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def _reference_loglik(lm: LoadedModel, item: EncodedQuestion) -> list[float]:
    """The definition: for each choice, run (context + continuation)[:-1] and sum the continuation's log-probs."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    out = []
    for cont in item.continuations:
        full = item.context + cont
        inp = tuple(full[:-1])
        if inp not in seen:
            logits = lm.model(input_ids=torch.tensor([inp], device=lm.device), use_cache=False).logits[0]
            seen[inp] = _logprobs_at(logits)
        lp = seen[inp]
        start = len(item.context) - 1
        out.append(float(sum(lp[start + j, tok] for j, tok in enumerate(cont))))
    return out


def evaluate_reference(lm: LoadedModel, enc: EncodedMMLU, masks: MaskSpec = None, progress: bool = False, label: str = "") -> EvalResult:
    get_mask = _mask_getter(lm, masks)
    items = enc.items
    loglik = torch.zeros(len(items), 4, dtype=torch.float64)
    with HeadAblation(lm) as abl:
        for i, item in enumerate(tqdm(items, desc="MMLU (reference)", disable=not progress)):
            abl.set_mask(get_mask(i))
            loglik[i] = torch.tensor(_reference_loglik(lm, item))
    return EvalResult([it.question for it in items], loglik, label)


def _expand_cache(cache, batch: int):
    c = copy.deepcopy(cache)
    if batch > 1:
        c.batch_repeat_interleave(batch)
    return c


@torch.no_grad()
def _fast_subject(lm: LoadedModel, subject: EncodedSubject, rows: Sequence[int], batch_size: int,
                  abl: "HeadAblation | None" = None, masks: torch.Tensor | None = None) -> list[dict[int, list[float]]]:
    """Log-likelihoods for ``rows`` (indices into subject.items), one dict per head set.

    ``masks`` None: one set, the ablation the caller has already set. ``masks`` [n, L, H]: n static head sets in
    the same passes (row ``s`` of the prefix batch carries set ``s``; question chunks are laid out set-major)."""
    model, dev = lm.model, lm.device
    n = 1 if masks is None else masks.shape[0]
    if masks is not None:
        abl.set_mask(masks)
    cache = model(input_ids=torch.tensor([subject.prefix] * n, device=dev), use_cache=True, logits_to_keep=1).cache
    p = len(subject.prefix)
    order = sorted(rows, key=lambda r: len(subject.items[r].context))
    chunk_size = max(1, batch_size // n)
    out: list[dict[int, list[float]]] = [{} for _ in range(n)]
    for start in range(0, len(order), chunk_size):
        chunk = order[start : start + chunk_size]
        c = len(chunk)
        suffixes = [subject.items[r].context[p:] for r in chunk]
        lengths = [len(x) for x in suffixes]
        ids = torch.zeros(n * c, max(lengths), dtype=torch.long)
        for s in range(n):
            for q, x in enumerate(suffixes):
                ids[s * c + q, : len(x)] = torch.tensor(x)
        if masks is not None:
            abl.set_mask(masks.repeat_interleave(c, dim=0))
        # Right padding needs no attention mask: under the causal mask, pads after a row's last real token
        # never reach it. Logits are computed only at the positions where some row ends.
        ends = sorted(set(m - 1 for m in lengths))
        logits = model(input_ids=ids.to(dev), cache=_expand_cache(cache, c), use_cache=True,
                       logits_to_keep=torch.tensor(ends, device=dev)).logits  # [n*c, len(ends), V]
        for s in range(n):
            for q, r in enumerate(chunk):
                lp = _logprobs_at(logits[s * c + q, ends.index(lengths[q] - 1)])
                out[s][r] = [float(lp[t[0]]) for t in subject.items[r].continuations]
    return out


class _NoAblation:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def set_mask(self, mask):
        assert mask is None


def evaluate(
    lm: LoadedModel,
    enc: EncodedMMLU,
    masks: MaskSpec = None,
    batch_size: int = 8,
    progress: bool = True,
    label: str = "",
) -> EvalResult:
    """The fast path. ``masks`` as in MaskSpec; questions sharing a mask share one prefix pass."""
    get_mask = _mask_getter(lm, masks)
    loglik = torch.zeros(len(enc), 4, dtype=torch.float64)
    questions: list[MMLUQuestion] = []
    offset = 0
    desc = f"MMLU {label}".strip()
    # No hooks at all when nothing is ablated (the model may not even have per-layer attention, e.g. skipped layers).
    with (HeadAblation(lm) if masks is not None else _NoAblation()) as abl:
        for subject in tqdm(enc.subjects, desc=desc, unit="subject", disable=not progress, leave=False):
            groups: dict[bytes | None, list[int]] = {}
            group_mask: dict[bytes | None, torch.Tensor | None] = {}
            for r, item in enumerate(subject.items):
                m = get_mask(offset + r)
                key = m if m is None or isinstance(m, PrunePlan) else m.detach().to(torch.float32).cpu().numpy().tobytes()
                groups.setdefault(key, []).append(r)
                group_mask[key] = m
            for key, rows in groups.items():
                abl.set_mask(group_mask[key])
                fast_rows = [r for r in rows if subject.items[r].fast]
                results = _fast_subject(lm, subject, fast_rows, batch_size)[0] if fast_rows else {}
                for r in rows:
                    ll = results[r] if r in results else _reference_loglik(lm, subject.items[r])
                    loglik[offset + r] = torch.tensor(ll)
            questions += [it.question for it in subject.items]
            offset += len(subject.items)
    return EvalResult(questions, loglik, label)


# ---------------------------------------------------------------------------------------------------------------
# Statistics


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def indistinguishable_from_chance(result: EvalResult, chance: float = 0.25) -> bool:
    lo, hi = wilson_interval(float(result.correct.sum()), len(result.questions))
    return lo <= chance <= hi


@dataclass(frozen=True)
class PairedDelta:
    """Ablated minus baseline accuracy on the same questions, in accuracy points, with a 95% CI."""

    delta: float
    ci_low: float
    ci_high: float
    n: int

    def to_json(self) -> dict:
        return {"delta_points": round(self.delta, 4), "ci95_points": [round(self.ci_low, 4), round(self.ci_high, 4)], "n": self.n}


def answer_kl(ablated: EvalResult, baseline: EvalResult) -> torch.Tensor:
    """Per question, KL(unablated || ablated) in nats between the distributions over the four answer letters
    (each model's log-likelihoods renormalised over A-D)."""
    p = torch.log_softmax(baseline.loglik.double(), dim=-1)
    q = torch.log_softmax(ablated.loglik.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).clamp(min=0.0)


def agreement(ablated: EvalResult, baseline: EvalResult) -> float:
    return float((ablated.pred == baseline.pred).double().mean())


def paired_delta(ablated: EvalResult, baseline: EvalResult, z: float = 1.96) -> PairedDelta:
    d = (ablated.correct - baseline.correct) * 100.0
    n = d.numel()
    mean = float(d.mean())
    se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("inf")
    return PairedDelta(mean, mean - z * se, mean + z * se, n)


@torch.no_grad()
def evaluate_many(
    lm: LoadedModel,
    enc: EncodedMMLU,
    head_sets: Sequence[HeadSet],
    batch_size: int = 8,
    progress: bool = True,
    label: str = "",
) -> list[EvalResult]:
    """Evaluate several static head sets in the same forward passes: row ``s`` of every batch carries head set
    ``s``'s mask (the ablation is per row). Per subject, one prefix pass of ``len(head_sets)`` rows, then each
    chunk of questions for every set at once. Same numbers as ``evaluate`` once per set."""
    n = len(head_sets)
    masks = torch.stack([mask_for(lm, hs) for hs in head_sets])  # [n, L, H]
    loglik = torch.zeros(n, len(enc), 4, dtype=torch.float64)
    offset = 0
    with HeadAblation(lm) as abl:
        for subject in tqdm(enc.subjects, desc=f"MMLU {label}".strip(), unit="subject", disable=not progress, leave=False):
            fast_rows = [r for r, it in enumerate(subject.items) if it.fast]
            if fast_rows:
                for s, results in enumerate(_fast_subject(lm, subject, fast_rows, batch_size, abl, masks)):
                    for r, ll in results.items():
                        loglik[s, offset + r] = torch.tensor(ll)
            for r, it in enumerate(subject.items):
                if not it.fast:
                    for s in range(n):
                        abl.set_mask(masks[s])
                        loglik[s, offset + r] = torch.tensor(_reference_loglik(lm, it))
            offset += len(subject.items)
    questions = [it.question for it in enc.items]
    return [EvalResult(questions, loglik[s], label) for s in range(n)]
