"""Next-token KL on held-out text: damage measured on text itself, whatever the model's accuracy on a task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from prune_heads.heads import HeadSet
from prune_heads.models.batching import text_batches
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


@torch.no_grad()
def next_token_kl(
    lm: LoadedModel,
    sequences: Sequence[Sequence[int]],
    masks: "HeadSet | PrunePlan | torch.Tensor",
    batch_size: int = 8,
    scored: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per sequence, the mean over its positions of KL(unablated || ablated) in nats between the two models'
    next-token distributions: damage measured on text itself, whatever the model's accuracy. ``[len(sequences)]``.

    ``scored[i]``: only the predictions of sequence i's last ``scored[i]`` tokens count (a prompt followed by a
    generation: the generated tokens, each predicted from everything before it); None: every position."""
    out = torch.zeros(len(sequences), dtype=torch.float64)
    dev = lm.device
    with HeadAblation(lm) as abl:
        for idx in text_batches(lm, sequences, batch_size, full_logits=True):
            lengths = torch.tensor([len(sequences[i]) for i in idx])
            ids = torch.zeros(len(idx), int(lengths.max()), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[row]] = torch.tensor(list(sequences[i]))
            ids = ids.to(dev)
            abl.set_mask(None)
            p = torch.log_softmax(lm.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            abl.set_mask(masks)
            q = torch.log_softmax(lm.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            kl = (p.exp() * (p - q)).sum(-1).clamp(min=0.0).double().cpu()  # [B, S]
            real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]  # right padding: real tokens only
            for row, i in enumerate(idx):
                if scored is None:
                    out[i] = kl[row][real[row]].mean()
                else:  # the logits at positions L-1-n .. L-2 predict the last n tokens
                    end = int(lengths[row]) - 1
                    out[i] = kl[row][end - scored[i]:end].mean()
    return out
