"""Next-token KL on held-out text: damage measured on text itself, whatever the model's accuracy on a task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from prune_heads.heads import HeadSet
from prune_heads.models.batching import text_batches
from prune_heads.models.finite import finite_logits
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import HeadAblation
from prune_heads.plan.planner import PrunePlan


@dataclass(frozen=True)
class HeldOutText:
    """Held-out texts the next-token KL is measured on (token ids), and where they came from. ``scored``: per text,
    how many of its last tokens the KL reads (an lm-eval prompt followed by the unablated model's own greedy
    generation: the generated tokens); None: every position."""

    sequences: list[list[int]] = field(repr=False)
    source: str
    scored: list[int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.sequences)


@dataclass(frozen=True)
class TextDamage:
    """Per held-out text, how far the ablated model's next-token predictions move from the unablated model's, read
    at the text's scored positions (``[len(texts)]`` each): the mean KL(unablated || ablated) in nats, the share of
    positions where the two predict the same token (greedy), and whether they predict the same token at every one
    (on a generation: whether the ablated model's greedy generation is the unablated one's, token for token, the token
    that ended it included)."""

    kl: torch.Tensor
    agreement: torch.Tensor
    same: torch.Tensor

    def means(self) -> dict:
        """The three over the texts, as reports write them."""
        return {"kl_text_nats": round(float(self.kl.double().mean()), 6),
                "token_agreement": round(float(self.agreement.double().mean()), 6),
                "same_generation": round(float(self.same.double().mean()), 6)}

    @staticmethod
    def empty(n: int) -> "TextDamage":
        return TextDamage(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64),
                          torch.ones(n, dtype=torch.float64))

    def to_tensors(self) -> dict:
        return {"kl": self.kl, "agreement": self.agreement, "same": self.same}


@torch.no_grad()
def next_token_damage(
    lm: LoadedModel,
    sequences: Sequence[Sequence[int]],
    masks: "HeadSet | PrunePlan | torch.Tensor",
    batch_size: int = 8,
    scored: Sequence[int] | None = None,
    source: str = "the held-out text",
) -> TextDamage:
    """Per sequence, the next-token damage (``TextDamage``) of ``masks``: KL in nats, greedy agreement, all agreeing.
    Damage measured on text itself, whatever the model's accuracy.

    ``scored[i]``: only the predictions of sequence i's last ``scored[i]`` tokens count (a prompt followed by a
    generation: the generated tokens, each predicted from everything before it); None: every position. ``source``: what
    the texts are, as an error names them (non-finite logits stop the measurement: ``eval.finite``).
    ``masks`` of shape ``[len(sequences), L, H]``: each sequence its own head mask (a study's dynamic ablation)."""
    out = TextDamage.empty(len(sequences))
    per_row = isinstance(masks, torch.Tensor) and masks.dim() == 3
    dev = lm.device
    with HeadAblation(lm) as abl:
        for idx in text_batches(lm, sequences, batch_size, full_logits=True):
            lengths = torch.tensor([len(sequences[i]) for i in idx])
            ids = torch.zeros(len(idx), int(lengths.max()), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[row]] = torch.tensor(list(sequences[i]))
            ids = ids.to(dev)
            abl.set_mask(None)
            with finite_logits(lm, source):
                p = torch.log_softmax(lm.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            abl.set_mask(masks[idx] if per_row else masks)
            with finite_logits(lm, source, masks):
                q = torch.log_softmax(lm.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            kl = (p.exp() * (p - q)).sum(-1).clamp(min=0.0).double().cpu()  # [B, S]
            agree = (p.argmax(-1) == q.argmax(-1)).double().cpu()  # [B, S]
            for row, i in enumerate(idx):
                # the logits at positions L-1-n .. L-2 predict the last n tokens; right padding: real tokens only
                end = int(lengths[row]) - (0 if scored is None else 1)
                begin = 0 if scored is None else end - scored[i]
                out.kl[i] = kl[row, begin:end].mean()
                out.agreement[i] = agree[row, begin:end].mean()
                out.same[i] = float(bool(agree[row, begin:end].all()))
    return out


def text_measures(meta: dict) -> dict:
    """An evaluation's next-token damage on held-out text as reports write it (``search.verifier.with_text_damage``
    puts the means in its meta), or nothing where none was measured."""
    if "kl_text" not in meta:
        return {}
    return {"kl_text_nats": round(meta["kl_text"], 6), "token_agreement": round(meta["token_agreement"], 6),
            "same_generation": round(meta["same_generation"], 6)}
