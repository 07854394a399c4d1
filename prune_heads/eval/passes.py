"""Multiple-choice log-likelihood passes (MMLU 5-shot and the other tasks of data/tasks.py), as
lm-evaluation-harness computes them, with and without ablation (tokenisation: encoding.py).

Three paths compute the same numbers:
- ``task_loglik_reference``: one full sequence per question and choice, nothing shared (the definition);
- ``task_loglik``, fast path: within a subject every MMLU prompt starts with the same description and five
  exemplars, so their KV cache is computed once per subject and ablation mask, and only the question tokens run on
  top of it, in batches; only the answer position's logits are computed;
- ``task_loglik``, batched path: questions whose tokens do not extend a shared prefix or whose answers span several
  tokens (the cloze tasks), and per-question ablation masks (dynamic ablation). A question's choices share its
  context: it runs once into a KV cache and the choices run on top (WinoGrande's per-choice contexts instead go as
  (context, continuation) requests in right-padded batches, each row with its own mask, logits only at the
  continuation positions).

The fast path of a point whose heads start above layer 0 starts at that layer, from the residual stream the unablated
model computes below it (reuse.py: the same numbers, only the layers the point changes are read).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from prune_heads import memory
from prune_heads.eval.encoding import EncodedQuestion, EncodedSubject, EncodedTask
from prune_heads.eval.prefix_cache import expanded, reservable, reserve
from prune_heads.eval.results import EvalResult
from prune_heads.eval.reuse import Keep, SubjectFeed, SubjectStart, TaskStart, keeping, starting_at
from prune_heads.heads import HeadSet
from prune_heads.models.batching import pass_budget
from prune_heads.models.finite import finite_logits
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import HeadAblation, mask_for
from prune_heads.plan.planner import PrunePlan


def empty_loglik(enc: "EncodedTask", *leading: int) -> torch.Tensor:
    return torch.full((*leading, len(enc), enc.num_choices), float("-inf"), dtype=torch.float64)


def _store(loglik: torch.Tensor, row: int, values: Sequence[float]) -> None:
    loglik[row, : len(values)] = torch.tensor(values, dtype=torch.float64)


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


def _per_question(masks: MaskSpec) -> bool:
    """A mask per question: a [N, L, H] tensor or a function of the question index."""
    if isinstance(masks, torch.Tensor):
        return masks.dim() == 3
    return callable(masks) and not isinstance(masks, (HeadSet, PrunePlan))


def _logprobs_at(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


@torch.no_grad()
def _reference_loglik(lm: LoadedModel, item: EncodedQuestion) -> list[float]:
    """The definition: for each choice, run (context + continuation)[:-1] and sum the continuation's log-probs."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    out = []
    for choice in range(len(item.continuations)):
        context, cont = item.request(choice)
        full = context + cont
        inp = tuple(full[:-1])
        if inp not in seen:
            logits = lm.model(input_ids=torch.tensor([inp], device=lm.device), use_cache=False).logits[0]
            seen[inp] = _logprobs_at(logits)
        lp = seen[inp]
        start = len(context) - 1
        out.append(float(sum(lp[start + j, tok] for j, tok in enumerate(cont))))
    return out


def task_loglik_reference(lm: LoadedModel, enc: EncodedTask, masks: MaskSpec = None, progress: bool = False,
                       label: str = "") -> EvalResult:
    get_mask = _mask_getter(lm, masks)
    items = enc.items
    loglik = empty_loglik(enc)
    with HeadAblation(lm) as abl, finite_logits(lm, enc.task, masks):
        for i, item in enumerate(tqdm(items, desc="MMLU (reference)", disable=not progress)):
            abl.set_mask(get_mask(i))
            _store(loglik, i, _reference_loglik(lm, item))
    return EvalResult([it.question for it in items], loglik, label)


@torch.no_grad()
def _batched_loglik(
    lm: LoadedModel,
    items: Sequence[EncodedQuestion],
    batch_size: int,
    abl=None,
    row_masks: Sequence[torch.Tensor] | None = None,
) -> list[list[float]]:
    """Every (context, continuation) request of ``items`` in right-padded batches, longest first; with ``row_masks``
    (one [L, H] mask per item) each row is ablated with its own question's mask. Logits are computed only at the
    positions that predict continuation tokens."""
    out = [[0.0] * len(it.continuations) for it in items]
    separate = []
    for i, it in enumerate(items):
        if it.contexts is None and len(it.context) >= 2:
            out[i] = _shared_context_loglik(lm, it, abl, None if row_masks is None else row_masks[i])
        else:
            separate.append(i)
    requests = []  # (item, choice, model input, continuation, position predicting its first token)
    for i in separate:
        it = items[i]
        for c in range(len(it.continuations)):
            context, cont = it.request(c)
            requests.append((i, c, (context + cont)[:-1], cont, len(context) - 1))
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r][2]))
    dev = lm.device
    for start in range(0, len(order), batch_size):
        chunk = [requests[r] for r in order[start : start + batch_size]]
        ids = torch.zeros(len(chunk), max(len(r[2]) for r in chunk), dtype=torch.long)
        for row, r in enumerate(chunk):
            ids[row, : len(r[2])] = torch.tensor(r[2])
        if row_masks is not None:
            abl.set_mask(torch.stack([row_masks[r[0]] for r in chunk]))
        keep = sorted({r[4] + j for r in chunk for j in range(len(r[3]))})
        where = {p: k for k, p in enumerate(keep)}
        # Right padding needs no attention mask: under the causal mask, pads after a row's last real token never
        # reach it.
        logits = lm.model(input_ids=ids.to(dev), use_cache=False, logits_to_keep=torch.tensor(keep, device=dev)).logits
        for row, (i, c, _, cont, first) in enumerate(chunk):
            lp = _logprobs_at(logits[row, [where[first + j] for j in range(len(cont))]])  # [len(cont), V]
            out[i][c] = float(lp[torch.arange(len(cont)), torch.tensor(cont)].sum())
    return out


@torch.no_grad()
def _shared_context_loglik(
    lm: LoadedModel, item: EncodedQuestion, abl=None, mask: torch.Tensor | None = None
) -> list[float]:
    """One question whose choices share its context: the context (but its last token) runs once into a KV cache,
    then every choice's ``[last context token] + continuation[:-1]`` runs on top of it, one row per choice (right
    padding after a row's tokens cannot reach them). ``mask``: this question's own [L, H] ablation."""
    dev, n = lm.device, len(item.continuations)
    if mask is not None:
        abl.set_mask(mask[None])
    cache = lm.model(input_ids=torch.tensor([item.context[:-1]], device=dev), use_cache=True, logits_to_keep=1).cache
    rows = [[item.context[-1]] + cont[:-1] for cont in item.continuations]
    ids = torch.zeros(n, max(len(r) for r in rows), dtype=torch.long)
    for c, r in enumerate(rows):
        ids[c, : len(r)] = torch.tensor(r)
    if mask is not None:
        abl.set_mask(mask[None].expand(n, *mask.shape))
    logits = lm.model(input_ids=ids.to(dev), cache=expanded(cache, n), use_cache=True).logits  # [n, width, V]
    out = []
    for c, cont in enumerate(item.continuations):
        lp = _logprobs_at(logits[c, : len(cont)])
        out.append(float(lp[torch.arange(len(cont)), torch.tensor(cont)].sum()))
    return out


@torch.no_grad()
def _fast_subject(
    lm: LoadedModel,
    subject: EncodedSubject,
    rows: Sequence[int],
    batch_size: int,
    abl: "HeadAblation | None" = None,
    masks: torch.Tensor | None = None,
    start: SubjectStart | None = None,
    keep: Keep | None = None,
) -> list[dict[int, list[float]]]:
    """Log-likelihoods for ``rows`` (indices into subject.items), one dict per head set.

    ``masks`` None: one set, the ablation the caller has already set. ``masks`` [n, L, H]: n static head sets in
    the same passes (row ``s`` of the prefix batch carries set ``s``; question chunks are laid out set-major).
    ``start``: the passes start at its layer from its kept residual streams; ``keep``: the (unablated) passes leave
    the residual streams entering its layer in it (reuse.py)."""
    n = 1 if masks is None else masks.shape[0]
    if masks is not None:
        abl.set_mask(masks)
    # Activations in host memory only: on an accelerator the C heap holds none of them.
    with memory.policy().per_layer(lm.arch.decoder_layers(lm.model) if lm.device.type == "cpu" else ()), \
            starting_at(lm, None if start is None else start.layer) as at, \
            keeping(lm, None if keep is None else keep.layer) as kept:
        feed = SubjectFeed(at, start, n)
        out = _subject_passes(lm, subject, rows, batch_size, n, abl, masks, feed)
    if keep is not None:
        keep.subjects.append(feed.kept(kept, subject, keep.layer))
    return out


def _subject_passes(lm, subject, rows, batch_size, n, abl, masks, feed) -> list[dict[int, list[float]]]:
    """``_fast_subject``'s passes: the prefix once (n rows), then the questions in chunks on its KV cache."""
    model, dev = lm.model, lm.device
    feed.prefix()
    cache = model(input_ids=torch.tensor([subject.prefix] * n, device=dev), use_cache=True, logits_to_keep=1).cache
    p = len(subject.prefix)
    order = sorted(rows, key=lambda r: -len(subject.items[r].context))
    longest = len(subject.items[order[0]].context) - p
    # Every row of a chunk holds its own copy of the prefix's KV cache: as many rows as the pass budget allows.
    chunk_size = max(1, min(batch_size, pass_budget(lm).cached_rows(p + longest, batch_size)) // n)
    widest, reserved = min(chunk_size, len(order)), reservable(cache)
    if reserved:  # one buffer per layer for the whole subject; with n sets every chunk fills it (padded)
        reserve(cache, n * widest, p + longest)
    out: list[dict[int, list[float]]] = [{} for _ in range(n)]
    for start in range(0, len(order), chunk_size):
        chunk = order[start : start + chunk_size]
        padded_chunk = chunk + chunk[-1:] * (widest - len(chunk)) if reserved and n > 1 else chunk
        ids, lengths = _suffix_ids(subject, padded_chunk, n, p)
        if masks is not None:
            abl.set_mask(masks.repeat_interleave(len(padded_chunk), dim=0))
        feed.questions(padded_chunk, ids.shape[1])
        # Right padding needs no attention mask: under the causal mask, pads after a row's last real token
        # never reach it. Logits are computed only at the positions where some row ends.
        ends = sorted(set(m - 1 for m in lengths))
        logits = model(
            input_ids=ids.to(dev),
            cache=cache if reserved else expanded(cache, len(padded_chunk)),
            use_cache=True,
            logits_to_keep=torch.tensor(ends, device=dev),
        ).logits  # [n*c, len(ends), V]
        if reserved:
            cache.crop(-ids.shape[1])
        memory.policy().after_pass()
        for s in range(n):
            for q, r in enumerate(chunk):
                lp = _logprobs_at(logits[s * len(padded_chunk) + q, ends.index(lengths[q] - 1)])
                out[s][r] = [float(lp[t[0]]) for t in subject.items[r].continuations]
    return out


def _suffix_ids(subject: EncodedSubject, chunk: Sequence[int], n: int, p: int) -> tuple[torch.Tensor, list[int]]:
    """``[n * len(chunk), longest]`` right-padded question tokens after the prefix (set-major), and their lengths."""
    suffixes = [subject.items[r].context[p:] for r in chunk]
    lengths = [len(x) for x in suffixes]
    c = len(chunk)
    ids = torch.zeros(n * c, max(lengths), dtype=torch.long)
    for s in range(n):
        for q, x in enumerate(suffixes):
            ids[s * c + q, : len(x)] = torch.tensor(x)
    return ids, lengths


def _subject_start(start: TaskStart | None, k: int) -> SubjectStart | None:
    return None if start is None else start.subjects[k]


class _NoAblation:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def set_mask(self, mask):
        assert mask is None


def task_loglik(
    lm: LoadedModel,
    enc: EncodedTask,
    masks: MaskSpec = None,
    batch_size: int = 8,
    progress: bool = True,
    label: str = "",
    start: TaskStart | None = None,
    keep: Keep | None = None,
) -> EvalResult:
    """``masks`` as in MaskSpec. One mask for every question: the fast path per subject (shared prefix), the batched
    path for the questions it cannot take. A mask per question (dynamic ablation): the batched path, row by row.
    ``start``: the fast path starts at its layer from the residual streams kept there; ``keep``: the fast path leaves
    those entering its layer in it (reuse.py)."""
    get_mask = _mask_getter(lm, masks)
    loglik = empty_loglik(enc)
    items = enc.items
    desc = f"{enc.task} {label}".strip()
    # No hooks at all when nothing is ablated (the model may not even have per-layer attention, e.g. skipped layers).
    with HeadAblation(lm) if masks is not None else _NoAblation() as abl, finite_logits(lm, enc.task, masks):
        if _per_question(masks):
            row_masks = [get_mask(i).to(torch.float32) for i in range(len(items))]
            for i, ll in enumerate(_batched_all(lm, items, batch_size, abl, row_masks, progress, desc)):
                _store(loglik, i, ll)
            return EvalResult([it.question for it in items], loglik, label)
        abl.set_mask(get_mask(0))
        offset, slow = 0, []
        for k, subject in enumerate(tqdm(
            enc.subjects, desc=desc, unit="subject", disable=not progress or len(enc.subjects) < 2, leave=False
        )):
            fast_rows = [r for r, it in enumerate(subject.items) if it.fast]
            results = _fast_subject(lm, subject, fast_rows, batch_size, start=_subject_start(start, k),
                                    keep=keep)[0] if fast_rows else {}
            if keep is not None and not fast_rows:
                keep.subjects.append(None)
            for r, ll in results.items():
                _store(loglik, offset + r, ll)
            slow += [offset + r for r, it in enumerate(subject.items) if not it.fast]
            offset += len(subject.items)
        if slow:
            for i, ll in zip(slow, _batched_all(lm, [items[i] for i in slow], batch_size, abl, None, progress, desc)):
                _store(loglik, i, ll)
    return EvalResult([it.question for it in items], loglik, label)


def _batched_all(lm, items, batch_size, abl, row_masks, progress, desc) -> list[list[float]]:
    """``_batched_loglik`` in blocks of questions, with a progress bar."""
    if not items:
        return []
    block = max(1, 16 * batch_size // max(1, max(len(it.continuations) for it in items)))
    out: list[list[float]] = []
    bar = tqdm(total=len(items), desc=desc, unit="question", disable=not progress, leave=False)
    for start in range(0, len(items), block):
        part = items[start : start + block]
        masks = row_masks[start : start + block] if row_masks is not None else None
        out += _batched_loglik(lm, part, batch_size, abl, masks)
        bar.update(len(part))
    bar.close()
    return out


@torch.no_grad()
def task_loglik_many(
    lm: LoadedModel,
    enc: EncodedTask,
    head_sets: Sequence[HeadSet],
    batch_size: int = 8,
    progress: bool = True,
    label: str = "",
    start: TaskStart | None = None,
) -> list[EvalResult]:
    """Evaluate several static head sets in the same forward passes: row ``s`` of every batch carries head set
    ``s``'s mask (the ablation is per row). Per subject, one prefix pass of ``len(head_sets)`` rows, then each
    chunk of questions for every set at once. Same numbers as ``task_loglik`` once per set."""
    n = len(head_sets)
    masks = torch.stack([mask_for(lm, hs) for hs in head_sets])  # [n, L, H]
    loglik = empty_loglik(enc, n)
    items = enc.items
    offset, slow = 0, []
    with HeadAblation(lm) as abl, finite_logits(lm, enc.task, head_sets[0] if n == 1 else f"{n} head sets in one pass"):
        for k, subject in enumerate(tqdm(
            enc.subjects,
            desc=f"{enc.task} {label}".strip(),
            unit="subject",
            disable=not progress or len(enc.subjects) < 2,
            leave=False,
        )):
            fast_rows = [r for r, it in enumerate(subject.items) if it.fast]
            if fast_rows:
                starting = _subject_start(start, k)
                for s, results in enumerate(_fast_subject(lm, subject, fast_rows, batch_size, abl, masks, starting)):
                    for r, ll in results.items():
                        _store(loglik[s], offset + r, ll)
            slow += [offset + r for r, it in enumerate(subject.items) if not it.fast]
            offset += len(subject.items)
        if slow:  # every head set's rows in the same batches, each row with its set's mask
            rows = [(s, i) for s in range(n) for i in slow]
            results = _batched_all(
                lm,
                [items[i] for _, i in rows],
                batch_size,
                abl,
                [masks[s] for s, _ in rows],
                progress,
                f"{enc.task} {label}".strip(),
            )
            for (s, i), ll in zip(rows, results):
                _store(loglik[s], i, ll)
    questions = [it.question for it in enc.items]
    return [EvalResult(questions, loglik[s], label) for s in range(n)]


