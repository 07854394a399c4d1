"""Greedy generation for evaluation: batched, with a KV cache written in place, a prompt prefix shared by the batch
computed once, and each sequence leaving the batch as soon as it is finished.

What lm-eval's ``HFLM.generate_until`` produces with ``model.generate`` (greedy, left padding, the task's stop
sequences and ``max_gen_toks``), without what costs it time on a CPU: transformers' ``DynamicCache`` concatenates every
layer's keys and values at each new token (the whole cache copied per token), a batch runs until its last sequence
stops, and each document's few-shot exemplars are prefilled again. Here:

- the tokens every prompt of a batch starts with (lm-eval's description and ``first_n`` exemplars: GSM8K's and MMLU
  chain-of-thought's five worked examples) are prefilled once, for one row, repeated into the batch's cache and kept
  for the next batch that starts with them too;
- the cache is reserved once per batch (``prefix_cache.ReservedLayer``) and each token written into it in place;
- a sequence is finished when it produces an end-of-sequence token or its text contains a stop sequence, and it leaves
  the batch (the rows still running are moved to the front of the cache);
- logits are computed for the last position only.

Each prompt's own tokens sit right-aligned after the shared prefix, padding between them masked out and positions
counted from the prefix, so a row computes what the prompt alone computes (up to float rounding of batched kernels,
as with left padding). For full-attention models only (``ArchAdapter.full_attention``): under a sliding window the
padding would take places in the window.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from prune_heads.eval.prefix_cache import ReservedLayer, reservable, reserve
from prune_heads.io.parallel import LOCAL, Ranks
from prune_heads.models.loading import LoadedModel

MIN_SHARED = 8  # a common prefix shorter than this is prefilled with each prompt


@dataclass(frozen=True)
class GreedyRequest:
    """How a group of prompts generates: at most ``max_new`` tokens each, stopping at an end-of-sequence token in
    ``eos_ids`` or once the decoded generation contains one of ``stops``."""

    max_new: int
    stops: tuple[str, ...]
    eos_ids: frozenset[int]


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every row shares (at most the shortest row less one: each row keeps a token of its
    own, whose logits start its generation)."""
    first, n = rows[0], min(len(r) for r in rows) - 1
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return max(n, 0)


def _finished(tokens: list[int], request: GreedyRequest, tokenizer) -> bool:
    """An end-of-sequence token, ``max_new`` tokens, or a stop sequence in the text (special tokens kept, as lm-eval's
    stop check decodes)."""
    if tokens[-1] in request.eos_ids or len(tokens) >= request.max_new:
        return True
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    return any(s and s in text for s in request.stops)


class _Batch:
    """The running rows of one batch: their cache, attention mask and the position of their next token."""

    def __init__(self, cache, mask: torch.Tensor, positions: torch.Tensor, rows: list[int]):
        self.cache, self.mask, self.positions, self.rows = cache, mask, positions, rows

    def keep(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.mask.device)
        if all(isinstance(layer, ReservedLayer) for layer in self.cache.layers):
            for layer in self.cache.layers:  # the rows still running move to the front of the buffers
                layer.keep_rows(index)
        else:
            self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.rows = [self.rows[i] for i in keep]


def shared_lengths(prompts: list[list[int]], batches: list[list[int]]) -> list[int]:
    """Per batch (prompt indices, in sorted order), how many leading tokens it prefills once: what it shares with the
    batches beside it (a task's description and exemplars, not the first words its own questions happen to share),
    else what it shares alone; 0 under MIN_SHARED. Fixed by the batches alone, whichever rank runs them, in whatever
    order."""
    out = []
    for k, batch in enumerate(batches):
        near = [i for b in batches[max(k - 1, 0):k + 2] for i in b]
        n = common_prefix([prompts[i] for i in near]) if len(near) > 1 else 0
        if n < MIN_SHARED:
            n = common_prefix([prompts[i] for i in batch]) if len(batch) > 1 else 0
        out.append(n if n >= MIN_SHARED else 0)
    return out


class _Prefixes:
    """The last shared prefix computed (its tokens and its one-row cache), reused by the next batch that shares the
    same one (prompts sorted by their tokens put a task's documents, with its exemplars, side by side)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.cache = None

    def for_batch(self, lm: LoadedModel, prompts: list[list[int]], shared: int):
        """The one-row cache of the batch's first ``shared`` tokens (None for none), computed unless it is the last."""
        if not shared:
            return None
        if self.cache is None or prompts[0][:shared] != self.tokens:
            self.tokens = prompts[0][:shared]
            ids = torch.tensor([self.tokens], device=lm.device)
            self.cache = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1).cache
        return self.cache


def _batch_cache(cache, rows: int, capacity: int):
    """The batch's cache over a one-row prefix ``cache`` (left intact for the next batch): reserved buffers of
    ``rows`` rows and ``capacity`` tokens, or (a cache type that cannot be reserved) a deep copy repeated per row."""
    out = copy.copy(cache)
    out.layers = list(cache.layers)
    if reservable(out):
        reserve(out, rows, capacity)
    else:
        out.layers = [copy.deepcopy(layer) for layer in cache.layers]
        out.batch_repeat_interleave(rows)
    return out


@torch.no_grad()
def _prefill(lm: LoadedModel, prompts: list[list[int]], max_new: int, prefix: object, shared: int
             ) -> tuple[_Batch, torch.Tensor]:
    """The batch after its prompts (the ``shared`` prefix once, its one-row cache ``prefix``, then each prompt's own
    tokens) and each row's first greedy token."""
    dev, model = lm.device, lm.model
    rows = len(prompts)
    own = [p[shared:] for p in prompts]
    width = max(len(o) for o in own)
    cache = _batch_cache(prefix, rows, shared + width + max_new) if shared else None
    ids = torch.full((rows, width), _pad_id(lm), dtype=torch.long, device=dev)
    mask = torch.zeros(rows, shared + width, dtype=torch.long, device=dev)
    mask[:, :shared] = 1
    positions = torch.zeros(rows, width, dtype=torch.long, device=dev)
    for r, o in enumerate(own):  # right-aligned: padding sits between the shared prefix and the prompt's own tokens
        ids[r, width - len(o):] = torch.tensor(o, device=dev)
        mask[r, shared + width - len(o):] = 1
        positions[r, width - len(o):] = torch.arange(shared, shared + len(o), device=dev)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=1)
    cache = out.cache
    if not shared and reservable(cache):
        reserve(cache, rows, width + max_new)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    return _Batch(cache, mask, lengths, list(range(rows))), out.logits[:, -1].argmax(-1)


def _pad_id(lm: LoadedModel) -> int:
    tok = lm.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def greedy_generate(lm: LoadedModel, prompts: Sequence[Sequence[int]], request: GreedyRequest,
                    batch_size: int) -> list[list[int]]:
    """Each prompt's greedy generation (token ids, the last one the end-of-sequence token or the one that completed
    a stop sequence), in the prompts' order (``greedy_batches`` collected)."""
    out: list[list[int]] = [[] for _ in prompts]
    for chunk, generated in greedy_batches(lm, prompts, request, batch_size):
        for i, tokens in zip(chunk, generated):
            out[i] = tokens
    return out


def greedy_batches(lm: LoadedModel, prompts: Sequence[Sequence[int]], request: GreedyRequest, batch_size: int,
                   ranks: Ranks = LOCAL) -> Iterator[tuple[list[int], list[list[int]]]]:
    """(prompt indices, their generations) batch by batch, as each batch finishes. Batches of ``batch_size`` prompts
    taken in the order of their tokens, so that prompts sharing a prefix (a task's description and exemplars) share
    a batch and its prefix's cache. ``ranks``: this rank's deal of those batches (round-robin), the very batches one
    process would run."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))  # shared prefixes side by side
    rows = [list(p) for p in prompts]
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    shared = shared_lengths(rows, batches)
    prefixes = _Prefixes()
    for k in ranks.deal(range(len(batches))):
        with torch.no_grad():
            mine = [rows[i] for i in batches[k]]
            prefix = prefixes.for_batch(lm, mine, shared[k])
            generated = _generate_batch(lm, mine, request, prefix, shared[k])
        yield batches[k], generated


def _generate_batch(lm: LoadedModel, prompts: list[list[int]], request: GreedyRequest, prefix: object,
                    shared: int) -> list[list[int]]:
    model, dev = lm.model, lm.device
    batch, nxt = _prefill(lm, prompts, request.max_new, prefix, shared)
    tokens: list[list[int]] = [[] for _ in prompts]
    while True:
        keep = []
        for j, t in enumerate(nxt.tolist()):
            row = batch.rows[j]
            tokens[row].append(t)
            if not _finished(tokens[row], request, lm.tokenizer):
                keep.append(j)
        if not keep:
            return tokens
        if len(keep) < len(batch.rows):
            batch.keep(keep)
            nxt = nxt[torch.tensor(keep, device=dev)]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(keep), 1)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=batch.mask, position_ids=batch.positions[:, None],
                    cache=batch.cache, use_cache=True, logits_to_keep=1)
        batch.positions = batch.positions + 1
        nxt = out.logits[:, -1].argmax(-1)
