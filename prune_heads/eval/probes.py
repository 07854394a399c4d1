"""A long-context probe's pass: every item read once (ablated or not), logits kept for its scored tokens only.

Per item: the mean loss of the target tokens (nats per token), the share of them that are the argmax given the ones
before (token accuracy), whether all are (match: what greedy decoding would write), and for ``kl`` probes the mean
next-token KL from the unablated model over the target positions (a second, unablated read of the same item).

Beside those read rates, their probabilities (what the guard judges, search/guard.py): ``p_match``, the probability
the model gives the whole target (the key, teacher-forced: exp of minus its summed loss), and ``p_token``, the mean
probability it gives each target token. A read rate turns on a threshold (a key is written or not), so a prompt says
one bit; the probabilities move with every token's log-likelihood, so each prompt says more. On the embedded model
(benchmarks/RESULTS.md 52c: 8 prompts per length, 512 and 2,048 tokens, the search's 3-, 6- and 9-head points) the
copy probe's per-prompt change had a 1.9x to 3.4x smaller sd as a probability than as a token accuracy, and every key
was retrieved before and after while the key's probability fell by up to 8.9 points (sd 0.6 to 2.4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from prune_heads.data.probes import ProbeItem, ProbeSet
from prune_heads.eval.reuse import StartAt, TaskStart, starting_at
from prune_heads.heads import HeadSet
from prune_heads.models.finite import finite_logits
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import HeadAblation
from prune_heads.plan.planner import PrunePlan

METRIC_FIELDS = ("nll", "token_accuracy", "match", "kl", "p_match", "p_token")


@dataclass
class ProbeResult:
    """Per item of ``probe`` (in its order): ``nll`` (nats/token), ``token_accuracy`` and ``match`` (0/1), ``kl``
    (nats; zeros where not measured or unablated), ``p_match`` and ``p_token`` (probabilities), float64 tensors of
    ``[len(probe.items)]``."""

    probe: ProbeSet
    nll: torch.Tensor
    token_accuracy: torch.Tensor
    match: torch.Tensor
    kl: torch.Tensor
    p_match: torch.Tensor
    p_token: torch.Tensor

    def metric(self) -> torch.Tensor:
        """The values the probe is judged by."""
        return getattr(self, self.probe.metric)

    def at_length(self, length: int) -> "ProbeResult":
        rows = torch.tensor([it.length == length for it in self.probe.items])
        items = tuple(it for it in self.probe.items if it.length == length)
        return ProbeResult(ProbeSet(self.probe.name, items, self.probe.metric),
                           *(getattr(self, f)[rows] for f in METRIC_FIELDS))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in METRIC_FIELDS}

    def summary(self) -> dict:
        """Means per length: what the report, the card and the terminal show."""
        out = {}
        for n in self.probe.lengths:
            part = self.at_length(n)
            out[str(n)] = {"prompts": len(part.probe.items), **{
                f: round(float(getattr(part, f).mean()), 6) for f in METRIC_FIELDS
                if f != "kl" or self.probe.metric == "kl"}}
        return out


    def describe(self) -> str:
        """One line: the judged value per length (the loss for text, whose KL is measured against this model)."""
        words = {"match": "keys retrieved", "token_accuracy": "repeated tokens predicted", "kl": "loss"}
        what = words[self.probe.metric]
        parts = []
        for n, row in self.summary().items():
            value = (f"{row['nll']:.3f} nat/token" if self.probe.metric == "kl"
                     else f"{row[self.probe.metric] * 100:.0f}%")
            parts.append(f"{value} at {n} tokens")
        return f"{what} " + ", ".join(parts) + f" ({len(self.probe.items)} prompts)"


def _target_logits(lm: LoadedModel, item: ProbeItem, at: StartAt | None = None,
                   kept: torch.Tensor | None = None) -> torch.Tensor:
    """The logits predicting each target token, as the model computes them: ``[target, vocab]`` (from the residual
    stream ``kept`` entering ``at``'s layer, when the pass starts there)."""
    ids = torch.tensor([item.ids], device=lm.device)
    if at is not None:
        at.feed(kept[None])
    return lm.model(input_ids=ids, use_cache=False, logits_to_keep=item.target + 1).logits[0, :-1]


CHUNK = 128  # target positions turned into float32 log-probabilities at a time (a 2,048-token copy prompt's 1,023
# targets at once were 0.4 GB of float32 beside the model: the guard's memory peak on the embedded model)


def _item_values(logits: torch.Tensor, gold: torch.Tensor, reference: torch.Tensor | None) -> dict[str, float]:
    """One item's nll, token accuracy, match, KL from the unablated ``reference`` logits (when given) and the target's
    probabilities, computed over the target positions a chunk at a time."""
    nll, hits, kl, p_token = 0.0, [], 0.0, 0.0
    for start in range(0, logits.shape[0], CHUNK):
        logp = torch.log_softmax(logits[start:start + CHUNK].float(), dim=-1)
        want = gold[start:start + CHUNK]
        gold_logp = logp.gather(-1, want[:, None]).double()
        nll -= float(gold_logp.sum())
        p_token += float(gold_logp.exp().sum())
        hits.append(logp.argmax(-1) == want)
        if reference is not None:
            ref = torch.log_softmax(reference[start:start + CHUNK].float(), dim=-1)
            kl += float((ref.exp() * (ref - logp)).sum(-1).clamp(min=0).double().sum())
    hit = torch.cat(hits).double()
    n = gold.numel()
    return {"nll": nll / n, "token_accuracy": float(hit.mean()), "match": float(hit.min()), "kl": kl / n,
            "p_match": math.exp(-nll), "p_token": p_token / n}


@torch.no_grad()
def probe_pass(lm: LoadedModel, probe: ProbeSet, masks: "HeadSet | PrunePlan | torch.Tensor | None",
               progress: bool = False, label: str = "", start: TaskStart | None = None) -> ProbeResult:
    """Every item of ``probe`` read with ``masks`` ablated (None: the model as it is); a ``[N, L, H]`` tensor holds
    one mask per item (study's dynamic ablation). ``start``: each read starts at its layer from the item's kept
    residual stream (reuse.py)."""
    n = len(probe.items)
    per_item = isinstance(masks, torch.Tensor) and masks.dim() == 3
    values = {f: torch.zeros(n, dtype=torch.float64) for f in METRIC_FIELDS}
    ablated = masks is not None and not (isinstance(masks, HeadSet) and not masks)
    checked = masks if ablated else None
    with HeadAblation(lm) as abl, finite_logits(lm, f"the long-context probe {probe.name}", checked), \
            starting_at(lm, None if start is None else start.layer) as at:
        for i, item in enumerate(tqdm(probe.items, desc=label or probe.name, disable=not progress, leave=False)):
            gold = torch.tensor(item.ids[-item.target:], device=lm.device)
            kept = None if at is None else start.texts[i]
            reference = None
            if probe.metric == "kl" and ablated:
                abl.set_mask(None)
                reference = _target_logits(lm, item, at, kept)
            abl.set_mask((masks[i] if per_item else masks) if ablated else None)
            for field, value in _item_values(_target_logits(lm, item, at, kept), gold, reference).items():
                values[field][i] = value
    return ProbeResult(probe, *(values[f] for f in METRIC_FIELDS))
