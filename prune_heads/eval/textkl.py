"""Next-token KL on held-out text: damage measured on text itself, whatever the model's accuracy on a task.
"""
from __future__ import annotations

from typing import Sequence

import torch

from prune_heads.heads import HeadSet
from prune_heads.models.batching import text_batches
from prune_heads.models.loading import LoadedModel
from prune_heads.plan.ablation import HeadAblation
from prune_heads.plan.planner import PrunePlan


@torch.no_grad()
def next_token_kl(
    lm: LoadedModel,
    sequences: Sequence[Sequence[int]],
    masks: "HeadSet | PrunePlan | torch.Tensor",
    batch_size: int = 8,
) -> torch.Tensor:
    """Per sequence, the mean over its positions of KL(unablated || ablated) in nats between the two models'
    next-token distributions: damage measured on text itself, whatever the model's accuracy. ``[len(sequences)]``."""
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
                out[i] = kl[row][real[row]].mean()
    return out
