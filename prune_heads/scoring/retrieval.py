"""Retrieval heads: the heads that attend, while the model reads a pass key back, to that key's own tokens in the
needle (the copy attention of Wu et al., 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

Per head, the mean attention weight that each position predicting a key token puts on that same token inside the
needle, over the pass-key prompts. High: the head carries the retrieval. It is the probe's view of which heads matter
on long contexts (used to test that the guard refuses removing them, and shown beside the dormancy scores).
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from prune_heads.data.probes import ProbeSet
from prune_heads.models.loading import LoadedModel
from prune_heads.scoring.hooks import eager_attention


@torch.no_grad()
def retrieval_scores(lm: LoadedModel, probe: ProbeSet, progress: bool = False) -> torch.Tensor:
    """``[layer, head]``: mean attention from the key-reading positions to the key inside the needle (eager attention,
    one prompt at a time; the weights of one layer live only inside its hook)."""
    if probe.metric != "match":
        raise ValueError("retrieval scores read pass-key prompts (a probe with a needle)")
    geos = lm.arch.geometries(lm.model)
    total = torch.zeros(len(geos), max(g.num_heads for g in geos), dtype=torch.float64)
    current: dict[str, object] = {}

    def hook(layer: int):
        def read(module, args, output):
            weights = output[1]  # [1, heads, seq, seq] under eager attention
            item = current["item"]
            queries = torch.arange(len(item.ids) - item.target - 1, len(item.ids) - 1)
            keys = torch.arange(item.needle[0], item.needle[1])
            picked = weights[0][:, queries, keys].float().mean(-1).double().cpu()  # [heads]
            total[layer, : picked.numel()] += picked
        return read

    handles = [lm.arch.attention(lm.model, i).register_forward_hook(hook(i)) for i in range(len(geos))]
    try:
        with eager_attention(lm):
            for item in tqdm(probe.items, desc="retrieval heads", disable=not progress, leave=False):
                current["item"] = item
                lm.model(input_ids=torch.tensor([item.ids], device=lm.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return total / len(probe.items)
