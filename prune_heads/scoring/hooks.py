"""All score functions from one forward pass per batch.

Per layer, three probes collect what the functions need, and the layer's statistics are reduced to
``[batch, head]`` values before the next layer runs:

- the value projection's output  -> ||v_j|| per KV head                      (ftvvn, avvn)
- the attention itself           -> first-token weight and entropy per query (awft, aeqd), from
                                    :mod:`.attention_stats`: no ``[seq, seq]`` weights are materialised
- o_proj's input (head outputs)  -> ||o_i||, ||W_O^h o_i^h||                 (lthon, ahon, ahon_wo)

Right padding: row ``b`` holds ``length[b]`` real tokens at positions ``0..length[b]-1``; statistics
average over those positions only. Under a causal mask, padding after the real tokens cannot change them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from prune_heads import memory
from prune_heads.heads import BASE_KEYS, ScoreTable
from prune_heads.models.batching import text_batches
from prune_heads.models.loading import LoadedModel
from prune_heads.models.placement import live_weight
from prune_heads.scoring import attention_stats

_EPS = 1e-12


@contextmanager
def attention_implementation(lm: LoadedModel, name: str) -> Iterator[None]:
    """Run the model with another ``attn_implementation`` for the duration, then restore its own."""
    model = lm.model
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)


def eager_attention(lm: LoadedModel):
    """transformers' reference attention, which can return the weights (used by tests as the reference)."""
    return attention_implementation(lm, "eager")


def stats_attention(lm: LoadedModel):
    """Attention that reports first-token weights and entropies (see :mod:`.attention_stats`)."""
    attention_stats.register()
    return attention_implementation(lm, attention_stats.IMPLEMENTATION)


class _ScoringProbe:
    """Hooks on every layer; ``run`` returns the per-input base scores of one batch."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.arch = lm.arch
        self.geometries = self.arch.geometries(lm.model)
        self.token_mask: torch.Tensor | None = None  # [B, S] bool
        self.lengths: torch.Tensor | None = None  # [B]
        self._v_norm: dict[int, torch.Tensor] = {}
        self._attention: dict[int, dict[str, torch.Tensor]] = {}
        self._gram: dict[int, torch.Tensor] = {}
        self._o_stats: dict[int, dict[str, torch.Tensor]] = {}
        self.results: dict[str, list[torch.Tensor]] = {}
        self._handles: list = []
        self._attention_modules: list[torch.nn.Module] = []

    # -- reductions -----------------------------------------------------------------------------------------

    def _masked_mean(self, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Mean over real tokens; x has the sequence at ``seq_dim`` and batch at 0."""
        m = self.token_mask.to(x.dtype)
        shape = [m.shape[0]] + [1] * (x.dim() - 1)
        shape[seq_dim] = m.shape[1]
        return (x * m.view(shape)).sum(seq_dim) / self.lengths.to(x.dtype).view(-1, *([1] * (x.dim() - 2)))

    def _on_value(self, layer: int, value_slice: slice | None):
        geo = self.geometries[layer]

        def hook(module, args, output):
            v = output if value_slice is None else output[..., value_slice]
            v = v.float().view(*v.shape[:-1], geo.num_kv_heads, geo.head_dim)  # [B, S, KV, D]
            self._v_norm[layer] = v.norm(dim=-1)  # [B, S, KV]

        return hook

    def _on_head_outputs(self, layer: int, o_proj: torch.nn.Linear):
        geo = self.geometries[layer]

        def pre_hook(module, args):
            o = args[0].float().view(*args[0].shape[:-1], geo.num_heads, geo.head_dim)  # [B, S, H, D]
            o_norm = o.norm(dim=-1)  # [B, S, H]
            # Each head's contribution to the residual stream, ||W_O^h o_i^h||, as sqrt(o^T G_h o) with the head's
            # Gram matrix G_h = W_O^h^T W_O^h ([D, D]): a D x D product per head instead of D x hidden.
            gram = self._gram[layer]
            wo_sq = (torch.einsum("bshd,hde->bshe", o, gram) * o).sum(-1)
            wo_norm = wo_sq.clamp(min=0).sqrt()  # [B, S, H]
            last = (self.lengths - 1).clamp(min=0)
            rows = torch.arange(o.shape[0], device=o.device)
            self._o_stats[layer] = {
                "lthon": o_norm[rows, last],  # [B, H]
                "ahon": self._masked_mean(o_norm, 1),
                "ahon_wo": self._masked_mean(wo_norm, 1),
            }

        return pre_hook

    def _head_gram(self, layer: int, o_proj: torch.nn.Linear) -> torch.Tensor:
        """``[H, D, D]``: each head's W_O^h^T W_O^h. Computed before the first pass, not inside it: a small tensor
        kept from the middle of a pass would split a freed activation block, and the heap would grow by about one
        activation per layer (~60 MiB on SmolLM2-135M)."""
        geo = self.geometries[layer]
        w = live_weight(o_proj).float().view(o_proj.out_features, geo.num_heads, geo.head_dim)  # [out, H, D]
        return torch.einsum("ohd,ohe->hde", w, w)

    def _on_attention_stats(self, layer: int):
        def receiver(stats: attention_stats.AttentionStats) -> None:
            qmask = self.token_mask[:, None, :]  # [B, 1, S_q]: padding queries count for nothing
            n = self.lengths.float()[:, None]
            self._attention[layer] = {
                "awft": torch.where(qmask, stats.first_token_weight, 0.0).sum(-1) / n,  # [B, H]
                "aeqd": torch.where(qmask, stats.entropy, 0.0).sum(-1) / n,
            }

        return receiver

    def _on_attention(self, layer: int):
        geo = self.geometries[layer]

        def hook(module, args, output):
            attn = self._attention.pop(layer, None)
            if attn is None:
                raise RuntimeError(f"layer {layer}: attention statistics were not reported; the scoring pass needs "
                                   f"attn_implementation={attention_stats.IMPLEMENTATION!r}")
            v_norm = self._v_norm.pop(layer)  # [B, S, KV]
            v_per_head = v_norm.repeat_interleave(geo.group_size, dim=-1)  # [B, S, H]: the KV head each reads
            stats = {**self._o_stats.pop(layer), **attn,
                     "ftvvn": v_per_head[:, 0], "avvn": self._masked_mean(v_per_head, 1)}
            for key in BASE_KEYS:
                self.results.setdefault(key, [None] * len(self.geometries))[layer] = stats[key]

        return hook

    # -- lifecycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> "_ScoringProbe":
        for layer in range(len(self.geometries)):
            attn = self.arch.attention(self.lm.model, layer)
            v_module, v_slice = self.arch.value_projection(attn)
            o_proj = self.arch.output_projection(attn)
            self._gram[layer] = self._head_gram(layer, o_proj)
            self._handles += [
                v_module.register_forward_hook(self._on_value(layer, v_slice)),
                o_proj.register_forward_pre_hook(self._on_head_outputs(layer, o_proj)),
                attn.register_forward_hook(self._on_attention(layer)),
            ]
            attention_stats.receive(attn, self._on_attention_stats(layer))
            self._attention_modules.append(attn)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn in self._attention_modules:
            attention_stats.receive(attn, None)
        self._attention_modules.clear()

    @torch.no_grad()
    def scores_of(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """Base scores ``{key: [B, L, H]}`` of one right-padded batch."""
        dev = self.lm.device
        self.lengths = lengths.to(dev)
        self.token_mask = torch.arange(input_ids.shape[1], device=dev)[None, :] < self.lengths[:, None]
        self.results = {}
        self.lm.model(input_ids=input_ids.to(dev), attention_mask=self.token_mask.long(), use_cache=False,
                      logits_to_keep=1)
        return {k: torch.stack(v, dim=1).cpu() for k, v in self.results.items()}


def derived_scores(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the layer-normalised ``<key>_ln`` (value / layer mean, same input) and ``lthon_hn``."""
    out = dict(base)
    for key in BASE_KEYS:
        denom_key = "ahon" if key == "lthon" else key
        out[f"{key}_ln"] = base[key] / (base[denom_key].mean(dim=-1, keepdim=True) + _EPS)
    out["lthon_hn"] = base["lthon"] / (base["ahon"] + _EPS)
    return out


def score_heads(
    lm: LoadedModel,
    sequences: Sequence[Sequence[int]],
    batch_size: int = 8,
    progress: bool = True,
) -> ScoreTable:
    """Score every head on every input sequence (token ids). Per-input values are kept (dynamic mode)."""
    if not sequences:
        raise ValueError("score_heads needs at least one input sequence")
    pad_id = 0
    per_input: dict[str, list[torch.Tensor | None]] = {}
    bar = tqdm(total=len(sequences), desc="scoring heads", unit="input", disable=not progress)
    with stats_attention(lm), _ScoringProbe(lm) as probe:
        for idx in text_batches(lm, sequences, batch_size):
            lengths = torch.tensor([len(sequences[i]) for i in idx])
            ids = torch.full((len(idx), int(lengths.max())), pad_id, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[row]] = torch.tensor(list(sequences[i]), dtype=torch.long)
            base = probe.scores_of(ids, lengths)
            memory.policy().after_pass()
            for key, value in derived_scores(base).items():
                slots = per_input.setdefault(key, [None] * len(sequences))
                for row, i in enumerate(idx):
                    slots[i] = value[row]
            bar.update(len(idx))
    bar.close()
    tables = {k: torch.stack(v) for k, v in per_input.items()}  # [N, L, H] in input order
    return ScoreTable(tables, [len(s) for s in sequences])
