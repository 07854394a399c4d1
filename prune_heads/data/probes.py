"""Long-context probes built from the model's own tokenizer, no data needed: what an MMLU budget cannot see.

``passkey``  a 5-digit key hidden at a spread of depths in repeated filler (the pass-key test of Mohtashami & Jaggi,
             2023, RULER's ``niah_single_1`` haystack): the model must read the key back at the end. Scored by the
             log-likelihood of the key's tokens and by greedy match (every key token is the argmax given the ones
             before it: exactly what greedy decoding would write), so no generation is needed.
``copy``     a random token sequence, then the same sequence again: only heads that copy from far back (induction)
             make the repeat predictable. Scored by the repeat's token accuracy and loss.
``text``     the user's own long documents (``guard_texts``): next-token KL from the unablated model on the last
             quarter of each document, read with everything before it as context.

Each probe is a ``ProbeSet`` of items whose scored tokens (the target) are the item's last tokens, so a pass keeps
logits for those positions only. Items are grouped by length (a few lengths up to the model's context, capped).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from prune_heads.errors import UserError
from prune_heads.models.loading import LoadedModel
from prune_heads.models.tokens import encode, encode_pair

PROBES = ("passkey", "copy", "text")
INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
TEXT_TAIL = 0.25  # the share of a user document that is scored


@dataclass(frozen=True)
class ProbeItem:
    """One prompt: its token ids, how many of its last tokens are scored, and where it came from."""

    ids: tuple[int, ...] = field(repr=False)
    target: int  # the last ``target`` tokens are scored (each predicted from everything before it)
    length: int  # the length class the item belongs to (its nominal length in tokens)
    depth: float = 0.0  # passkey: where the needle starts, as a fraction of the prompt
    needle: tuple[int, int] = (0, 0)  # passkey: token span [start, end) of the key inside the needle


@dataclass(frozen=True)
class ProbeSet:
    """A probe's items, in order of length; ``metric`` is what each item is judged by."""

    name: str
    items: tuple[ProbeItem, ...]
    metric: str  # match (passkey: the key read back greedily) | token_accuracy (copy) | kl (text)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted({it.length for it in self.items}))

    def to_json(self) -> dict:
        return {"name": self.name, "metric": self.metric, "lengths": list(self.lengths),
                "prompts": {str(n): sum(it.length == n for it in self.items) for n in self.lengths},
                "tokens": sum(len(it.ids) for it in self.items)}


@dataclass(frozen=True)
class ProbeOptions:
    """Which probes, at which lengths, how many prompts each (per probe name), and the seed of keys and tokens."""

    names: tuple[str, ...] = ("passkey", "copy")
    lengths: tuple[int, ...] = (256, 1024, 2048)
    prompts: tuple[tuple[str, int], ...] = (("passkey", 8), ("copy", 4), ("text", 16))
    seed: int = 0

    def prompts_of(self, name: str) -> int:
        return dict(self.prompts).get(name, 8)


def probe_lengths(lengths: tuple[int, ...], context: int | None, cap: int | None) -> tuple[int, ...]:
    """The requested lengths that fit the model's context and the cap (the cap itself when none fits but it does)."""
    limit = min(x for x in (context, cap) if x) if (context or cap) else None
    kept = tuple(n for n in lengths if limit is None or n <= limit)
    if not kept and limit:
        kept = (limit,)
    if not kept or min(kept) < 64:
        raise UserError(f"long-context probes need at least 64 tokens; `probe_max_length` {cap} with a context of "
                        f"{context} leaves none; raise `probe_max_length` or pass `no_guard`")
    return kept


def passkey_item(lm: LoadedModel, length: int, depth: float, key: str) -> ProbeItem:
    """A pass-key prompt of at most ``length`` tokens with the needle at ``depth``; the target is the key."""
    filler_tokens = max(1, len(encode(lm, FILLER * 8)) // 8)
    fixed = len(encode(lm, INTRO + NEEDLE.format(key=key) + QUESTION + " " + key))
    n = max(0, (length - fixed) // filler_tokens + 1)
    while True:
        before = round(depth * n)
        context = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n - before) + QUESTION
        context_ids, answer = encode_pair(lm, context, " " + key)
        if len(context_ids) + len(answer) <= length:
            break
        if n == 0:
            raise UserError(f"a long-context probe of {length} tokens is shorter than the pass-key prompt itself "
                            f"({len(context_ids) + len(answer)} tokens with this tokenizer); probe longer lengths")
        n -= 1
    ids = tuple(context_ids + answer)
    start = _find(ids, answer)  # the first occurrence: the key inside the needle (intro and filler hold no digits)
    return ProbeItem(ids, len(answer), length, start / len(ids), (start, start + len(answer)))


def _find(ids: tuple[int, ...], part: list[int]) -> int:
    """Where ``part`` first occurs in ``ids``."""
    for i in range(len(ids) - len(part) + 1):
        if list(ids[i:i + len(part)]) == part:
            return i
    raise AssertionError("the key's tokens do not occur in the prompt as they are read back")


def passkey_probe(lm: LoadedModel, lengths: tuple[int, ...], prompts: int, seed: int) -> ProbeSet:
    """``prompts`` pass-key prompts per length, needles spread evenly over the depths, a fresh random key each."""
    rng = random.Random(f"passkey:{seed}")
    items = [passkey_item(lm, n, (i + 0.5) / prompts, str(rng.randint(10000, 99999)))
             for n in lengths for i in range(prompts)]
    return ProbeSet("passkey", tuple(items), "match")


def copy_probe(lm: LoadedModel, lengths: tuple[int, ...], prompts: int, seed: int) -> ProbeSet:
    """``prompts`` sequences per length: random ordinary tokens, then the same tokens again; the repeat after its
    first token is the target (the first cannot be known to repeat)."""
    rng = random.Random(f"copy:{seed}")
    special = set(lm.tokenizer.all_special_ids)
    vocab = min(len(lm.tokenizer), lm.model.get_input_embeddings().num_embeddings)
    ordinary = [t for t in range(vocab) if t not in special]
    start = encode(lm, "")  # BOS for the families that read one
    items = []
    for n in lengths:
        half = (n - len(start)) // 2
        for _ in range(prompts):
            seq = rng.choices(ordinary, k=half)
            items.append(ProbeItem(tuple(start + seq + seq), half - 1, n))
    return ProbeSet("copy", tuple(items), "token_accuracy")


def text_probe(lm: LoadedModel, texts: list[str], lengths: tuple[int, ...], prompts: int, source: str) -> ProbeSet:
    """The user's documents, each cut to the longest probe length it fills (at most ``prompts`` per length); the
    last quarter of each is the target."""
    items, per_length = [], {n: 0 for n in lengths}
    for text in texts:
        ids = encode(lm, text)
        fits = [n for n in lengths if len(ids) >= n and per_length[n] < prompts]
        if not fits:
            continue
        n = max(fits)
        per_length[n] += 1
        items.append(ProbeItem(tuple(ids[:n]), max(1, int(n * TEXT_TAIL)), n))
    if not items:
        raise UserError(f"no text in {source} is at least {min(lengths)} tokens long; `guard_texts` needs long "
                        "documents (one per line, or JSONL 'text')")
    return ProbeSet("text", tuple(sorted(items, key=lambda it: it.length)), "kl")


def build_probes(lm: LoadedModel, options: ProbeOptions, texts: list[str] | None = None,
                 source: str = "") -> tuple[ProbeSet, ...]:
    """Every probe ``options`` names, at its lengths (already fitted to the model's context)."""
    unknown = [n for n in options.names if n not in PROBES]
    if unknown:
        raise UserError(f"`guard` {','.join(unknown)} is not a probe; choose from {', '.join(PROBES)}")
    if "text" in options.names and not texts:
        raise ValueError("the probe text needs texts (settings refuse `guard` text without `guard_texts`)")
    built = []
    for name in options.names:
        n = options.prompts_of(name)
        if name == "passkey":
            built.append(passkey_probe(lm, options.lengths, n, options.seed))
        elif name == "copy":
            built.append(copy_probe(lm, options.lengths, n, options.seed))
        else:
            built.append(text_probe(lm, texts, options.lengths, n, source))
    return tuple(built)
