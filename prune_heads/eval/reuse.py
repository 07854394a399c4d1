"""Layer reuse: a point that ablates heads from layer ``c`` up starts its forward pass at layer ``c``.

Ablation zeroes heads before ``o_proj``: every layer below the first one a head set touches computes exactly what the
unablated model computes, and so does the residual stream entering that layer (its keys and values too). So the
residual stream entering layer ``c`` is read once per text (:func:`read_below`: the forward runs up to layer ``c``
and stops there, never reaching the layers above or the LM head), and every point whose first changed layer is
``c`` starts from it (:class:`StartAt`): the decoder layers below ``c`` are swapped, for the duration of the pass,
for stand-ins that cost nothing, the last of them handing layer ``c`` the kept residual stream.

The model's own forward runs unchanged around the stand-ins (embeddings, rotary tables, attention masks with sliding
windows, soft-capping, final norm and LM head: each family's modelling code), so what the layers from ``c`` up see is
what they see in the full pass. A KV cache stays consistent: each stand-in appends a one-value placeholder per token
to its layer's cache (``[rows, 1, tokens, 1]``), so every layer reports the same length and the masks and positions
the model derives from the cache are the full pass's; the placeholders are never read.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from prune_heads.eval.encoding import EncodedSubject, EncodedTask
from prune_heads.eval.prefix_cache import expanded
from prune_heads.heads import HeadSet
from prune_heads.models.batching import pass_budget
from prune_heads.models.counting import weight_bytes
from prune_heads.models.dtypes import available_bytes
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.planner import PrunePlan


def first_changed_layer(target: "HeadSet | PrunePlan | torch.Tensor | None") -> int | None:
    """The lowest layer whose computation ``target`` changes (None: nothing ablated, or a mask per input row, which
    a kept residual stream cannot serve)."""
    if target is None or isinstance(target, torch.Tensor):
        return None
    if isinstance(target, PrunePlan):
        changed = [i for i, lp in enumerate(target.layers) if not lp.is_identity] + target.removed.layers()
        return min(changed) if changed else None
    return min(target.layers()) if target else None


class _Stop(Exception):
    """Raised at the entrance of the layer being read: nothing above it runs."""


def read_below(lm: LoadedModel, layer: int, **forward: object) -> torch.Tensor:
    """The residual stream entering decoder layer ``layer`` (``[rows, tokens, hidden]``) for the model inputs
    ``forward`` (``input_ids``, ``cache``, ...): the model runs its layers below ``layer`` (filling their part of a
    cache passed in) and stops."""
    seen: list[torch.Tensor] = []

    def stop(module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    handle = lm.arch.decoder_layers(lm.model)[layer].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            lm.model(**forward)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"the forward pass never reached decoder layer {layer}")
    return seen[0]


@contextmanager
def keeping(lm: LoadedModel, layer: int | None) -> Iterator[list[torch.Tensor]]:
    """Inside, the residual stream entering ``layer`` is kept from every forward pass (a host copy per pass, in
    order): an unablated read that also leaves what later points start from, at no extra pass (no layer: nothing)."""
    kept: list[torch.Tensor] = []
    if layer is None:
        yield kept
        return

    def keep(module, args, kwargs):
        kept.append(_kept(args[0] if args else kwargs["hidden_states"]))

    handle = lm.arch.decoder_layers(lm.model)[layer].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        yield kept
    finally:
        handle.remove()


class _StandIn(nn.Module):
    """Decoder layer ``index`` below the starting layer: appends a placeholder to its cache layer and hands the
    hidden states on (the last one hands on the kept residual stream). Anything else asked of it (its attention
    module's shapes, say) the layer it stands in for answers."""

    def __init__(self, index: int, start: "StartAt", original: nn.Module):
        super().__init__()
        self.index, self.start = index, start
        self.__dict__["_original"] = original  # not a submodule: its parameters are counted once, where they live

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)

    def forward(self, hidden_states: torch.Tensor, *args, cache=None, **kwargs) -> torch.Tensor:
        rows, tokens = hidden_states.shape[:2]
        if cache is not None:
            placeholder = hidden_states.new_zeros(rows, 1, tokens, 1)
            cache.update(placeholder, placeholder, self.index)
        if self.index < self.start.layer - 1:
            return hidden_states
        residual = self.start.residual
        if residual is None or residual.shape[:2] != (rows, tokens):
            shape = None if residual is None else tuple(residual.shape)
            raise RuntimeError(f"the kept residual stream {shape} does not match the pass ({rows} x {tokens} tokens)")
        return residual.to(device=hidden_states.device, dtype=hidden_states.dtype)


class StartAt:
    """``with StartAt(lm, c) as start: start.feed(residual); lm.model(...)``: every forward inside runs its decoder
    layers from ``c`` up on the residual stream last fed (``[rows, tokens, hidden]``, the pass's shape)."""

    def __init__(self, lm: LoadedModel, layer: int):
        if layer < 1:
            raise ValueError("a pass starts above layer 0 or runs in full")
        self.lm, self.layer = lm, layer
        self.residual: torch.Tensor | None = None
        self._swapped: list[nn.Module] = []

    def feed(self, residual: torch.Tensor) -> None:
        self.residual = residual

    def __enter__(self) -> "StartAt":
        layers = self.lm.arch.decoder_layers(self.lm.model)
        for i in range(self.layer):
            self._swapped.append(layers[i])
            layers[i] = _StandIn(i, self, layers[i])
        return self

    def __exit__(self, *exc) -> None:
        layers = self.lm.arch.decoder_layers(self.lm.model)
        for i, original in enumerate(self._swapped):
            layers[i] = original
        self._swapped.clear()
        self.residual = None


@contextmanager
def starting_at(lm: LoadedModel, layer: int | None) -> Iterator[StartAt | None]:
    """``StartAt`` for a layer, or nothing (None) for a pass that runs in full."""
    if layer is None:
        yield None
        return
    with StartAt(lm, layer) as start:
        yield start


def padded(pieces: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[rows, width, hidden]``: each row's kept residual stream (``[tokens, hidden]``) right-padded with zeros (a
    pad position feeds nothing a real token reads, as the right-padded token ids it stands beside)."""
    out = pieces[0].new_zeros(len(pieces), width, pieces[0].shape[-1])
    for row, piece in enumerate(pieces):
        out[row, : piece.shape[0]] = piece
    return out


# -- what is kept per text ------------------------------------------------------------------------------------------


@dataclass
class SubjectStart:
    """A subject's residual streams entering decoder layer ``layer``: its shared prefix ``[prefix tokens, hidden]``
    and each question's tokens after it (``{row: [tokens, hidden]}``), read on top of the prefix."""

    layer: int
    prefix: torch.Tensor
    questions: dict[int, torch.Tensor]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prefix, *self.questions.values()))


@dataclass
class TaskStart:
    """Where a task's passes start (``layer``) and what they start from: per subject (None where no question takes
    the shared-prefix path), and per free-standing text (a probe item), in order."""

    layer: int
    subjects: list[SubjectStart | None] = field(default_factory=list)
    texts: list[torch.Tensor] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return (sum(s.bytes for s in self.subjects if s is not None)
                + sum(t.numel() * t.element_size() for t in self.texts))

    @property
    def tokens(self) -> int:
        return (sum(s.prefix.shape[0] + sum(q.shape[0] for q in s.questions.values())
                    for s in self.subjects if s is not None) + sum(t.shape[0] for t in self.texts))


@dataclass
class Keep:
    """What an unablated task read is asked to leave: the residual streams entering ``layer``, per subject (None
    where no question takes the shared-prefix path), appended as the read goes (passes.py)."""

    layer: int
    subjects: list[SubjectStart | None] = field(default_factory=list)

    def start(self) -> TaskStart:
        return TaskStart(self.layer, self.subjects)


def _kept(hidden: torch.Tensor) -> torch.Tensor:
    """A row's residual stream as kept: its own storage, in host memory."""
    return hidden.detach().to("cpu", copy=True)


def read_subject(lm: LoadedModel, subject: EncodedSubject, rows: Sequence[int], batch_size: int,
                 layer: int) -> SubjectStart:
    """The residual streams entering ``layer`` of ``subject``'s prefix and of its questions ``rows`` on top of it:
    the passes the shared-prefix path runs (passes.py), stopped at ``layer``."""
    from transformers import DynamicCache

    dev, p = lm.device, len(subject.prefix)
    cache = DynamicCache(config=lm.model.config)
    prefix = read_below(lm, layer, input_ids=torch.tensor([subject.prefix], device=dev), cache=cache,
                        use_cache=True)[0]
    order = sorted(rows, key=lambda r: -len(subject.items[r].context))
    longest = len(subject.items[order[0]].context) - p
    chunk_size = max(1, min(batch_size, pass_budget(lm).cached_rows(p + longest, batch_size)))
    questions: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), chunk_size):
        chunk = order[start : start + chunk_size]
        suffixes = [subject.items[r].context[p:] for r in chunk]
        ids = torch.zeros(len(chunk), max(len(s) for s in suffixes), dtype=torch.long)
        for q, s in enumerate(suffixes):
            ids[q, : len(s)] = torch.tensor(s)
        hidden = read_below(lm, layer, input_ids=ids.to(dev), cache=expanded(cache, len(chunk)), use_cache=True)
        for q, r in enumerate(chunk):
            questions[r] = _kept(hidden[q, : len(suffixes[q])])
    return SubjectStart(layer, _kept(prefix), questions)


class SubjectFeed:
    """What a subject's shared-prefix passes (passes.py) starting above layer 0 are handed (nothing for a full pass),
    and the chunks of questions the passes ran, in order (what an unablated read's kept residual streams are laid out
    by)."""

    def __init__(self, at: StartAt | None, start: SubjectStart | None, n: int):
        self.at, self.start, self.n = at, start, n
        self.chunks: list[Sequence[int]] = []

    def prefix(self) -> None:
        if self.at is not None:
            self.at.feed(self.start.prefix.expand(self.n, -1, -1))

    def questions(self, chunk: Sequence[int], width: int) -> None:
        """Set-major rows of ``chunk``'s questions, ``width`` tokens wide."""
        self.chunks.append(chunk)
        if self.at is not None:
            self.at.feed(padded([self.start.questions[r] for _ in range(self.n) for r in chunk], width))

    def kept(self, kept: Sequence[torch.Tensor], subject: EncodedSubject, layer: int) -> SubjectStart:
        """The residual streams ``keeping`` took from the prefix pass and each chunk's, per question."""
        p = len(subject.prefix)
        questions = {r: hidden[q, : len(subject.items[r].context) - p]
                     for chunk, hidden in zip(self.chunks, kept[1:]) for q, r in enumerate(chunk)}
        return SubjectStart(layer, kept[0][0], questions)


def read_task(lm: LoadedModel, enc: EncodedTask, layer: int, batch_size: int) -> TaskStart:
    """Every subject's kept residual streams at ``layer``, for the questions that take the shared-prefix path."""
    subjects = []
    for subject in enc.subjects:
        rows = [r for r, it in enumerate(subject.items) if it.fast]
        subjects.append(read_subject(lm, subject, rows, batch_size, layer) if rows else None)
    return TaskStart(layer, subjects)


def read_texts(lm: LoadedModel, texts: Sequence[Sequence[int]], layer: int) -> TaskStart:
    """The residual stream entering ``layer`` of each text read alone (a long-context probe's prompts)."""
    return TaskStart(layer, texts=[
        _kept(read_below(lm, layer, input_ids=torch.tensor([list(t)], device=lm.device), use_cache=False)[0])
        for t in texts])


class ResidualStore:
    """The residual streams a run keeps for reuse, one :class:`TaskStart` per (texts, layer), the least recently
    used dropped once they hold more than ``limit`` bytes; a start larger than ``limit`` is never read (its points
    run in full). ``summary()``: what was kept and how often it served, for the report."""

    def __init__(self, limit: int):
        self.limit = limit
        self._kept: OrderedDict[tuple[str, int], TaskStart] = OrderedDict()
        self._log: dict[tuple[str, int], dict] = {}

    def start(self, what: str, key: str, layer: int | None, size: int, read) -> TaskStart | None:
        """The kept start of ``key`` (``what`` it is: a task's name, a probe's) at ``layer``, read by ``read()`` when
        not kept; None for a full pass (no layer, layer 0, nothing to keep, or ``size`` bytes over the limit)."""
        if not layer or not size:
            return None
        entry = self._log.setdefault((key, layer), {"what": what, "layer": layer, "bytes": size, "reads": 0,
                                                    "passes": 0, "kept": size <= self.limit})
        if size > self.limit:
            return None
        entry["passes"] += 1
        if (key, layer) in self._kept:
            self._kept.move_to_end((key, layer))
            return self._kept[(key, layer)]
        start = read()
        entry.update(reads=entry["reads"] + 1, bytes=start.bytes, tokens=start.tokens)
        self._kept[(key, layer)] = start
        self._evict()
        return start

    def wants(self, key: str, layer: int | None, size: int) -> bool:
        """Whether a read of ``key`` should keep its residual stream at ``layer`` (it fits, and is not kept yet)."""
        return bool(layer) and 0 < size <= self.limit and (key, layer) not in self._kept

    def put(self, what: str, key: str, start: TaskStart) -> None:
        """A start kept by a read that ran anyway (an unablated one, ``keeping``): no read of its own."""
        self._log[(key, start.layer)] = {"what": what, "layer": start.layer, "bytes": start.bytes, "reads": 0,
                                         "passes": 0, "kept": True, "tokens": start.tokens, "kept_by": "unablated read"}
        self._kept[(key, start.layer)] = start
        self._evict()

    def _evict(self) -> None:
        while sum(s.bytes for s in self._kept.values()) > self.limit and len(self._kept) > 1:
            self._kept.popitem(last=False)

    def summary(self) -> dict:
        return {"limit_bytes": self.limit, "starts": list(self._log.values())}


REUSE_SHARE = 0.25  # the residual streams kept (in host memory) hold at most this share of the weights' bytes and of
REUSE_FLOOR = 64 * 2**20  # the host memory free at the start, and never less than this


def reuse_limit(lm: LoadedModel) -> int:
    """Bytes a run keeps of residual streams: a quarter of the weights' bytes and of the host memory free when the
    run starts (they are kept there, whatever device computes), never under 64 MiB. The embedded model's README run
    (float32, 135 MB kept at most) reads ~190 MB of them over the run, the least recently used dropped; full MMLU's
    1.57 million tokens on an 8B model (4,096 wide, bf16: 12.8 GB) exceed its 4 GB, so those points run in full,
    while the search's blocks of subjects fit."""
    free = available_bytes(torch.device("cpu")) or 0
    return max(REUSE_FLOOR, int(REUSE_SHARE * min(weight_bytes(lm.model), free or weight_bytes(lm.model))))


def _token_bytes(lm: LoadedModel) -> int:
    return lm.config.hidden_size * lm.dtype.itemsize


def task_bytes(lm: LoadedModel, enc: EncodedTask) -> int:
    """What ``read_task`` keeps of ``enc``: every token of the shared-prefix path, one hidden vector each."""
    tokens = 0
    for subject in enc.subjects:
        fast = [len(it.context) - len(subject.prefix) for it in subject.items if it.fast]
        tokens += len(subject.prefix) + sum(fast) if fast else 0
    return tokens * _token_bytes(lm)


def texts_bytes(lm: LoadedModel, texts: Sequence[Sequence[int]]) -> int:
    return sum(len(t) for t in texts) * _token_bytes(lm)
