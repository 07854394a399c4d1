"""``score_heads``: every score function of the paper on every head of a model in memory, from one pass."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prune_heads.api.held import Heads, held, settings_of
from prune_heads.errors import UserError
from prune_heads.heads import SCORE_KEYS, HeadSet, ScoreTable, score_direction
from prune_heads.models.tokens import encode
from prune_heads.pipeline.stages import open_run, score

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class HeadScores:
    """Per-head scores by score function: ``scores["ahon_ln"]`` is a ``[layers, heads]`` tensor (the mean over the
    calibration inputs), ``scores.per_input["ahon_ln"]`` is ``[inputs, layers, heads]``; ``calibration`` says what
    was read, ``token_counts`` how many tokens each input had."""

    per_input: dict[str, torch.Tensor]
    calibration: str
    token_counts: tuple[int, ...]

    def __getitem__(self, scorer: str) -> torch.Tensor:
        return self.per_input[_known(scorer, self.per_input)].mean(dim=0)

    def keys(self) -> list[str]:
        """The score functions held, in the paper's order."""
        return list(self.per_input)

    @property
    def table(self) -> ScoreTable:
        return ScoreTable(dict(self.per_input), list(self.token_counts))

    def ranking(self, scorer: str = "ahon_ln") -> list[tuple[int, int]]:
        """Every ``(layer, head)``, most dormant first by ``scorer`` (low scores are dormant, but for ``awft``)."""
        return self.table.ranking(_known(scorer, self.per_input))

    def plot(self, scorer: str = "ahon_ln", heads: Heads | None = None, path: str | Path | None = None):
        """The layer x head heatmap the command line draws (``heads``, e.g. a HeadSelection, outlined in red); written
        to ``path`` as PNG when given. Returns the matplotlib figure (a notebook shows it)."""
        from prune_heads.report import plots

        chosen = getattr(heads, "heads", heads)
        chosen = chosen if isinstance(chosen, HeadSet) else HeadSet.of(chosen or {})
        return plots.score_figure(self[scorer], scorer, chosen, None if path is None else Path(path))


def _known(scorer: str, held_keys: Iterable[str]) -> str:
    if scorer not in held_keys:
        raise UserError(f"no scores for {scorer!r}; these were computed: {', '.join(held_keys)}")
    return scorer


def score_heads(model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str] | None = None, *,
                scorers: Sequence[str] | None = None, batch_size: int | None = None, progress: bool = True,
                **settings) -> HeadScores:
    """Every score function of the paper (and its layer-normalised ``_ln`` form) on every head, from one pass over
    ``texts`` (each truncated to ``max_length`` tokens), else over the task's prompts as ``prune-heads score`` reads
    them (``calibration_size`` of them, round-robin over subjects). ``scorers`` keeps only those functions.
    ``settings``: the command's settings by name (``max_length``, ``calibration_size``, ``task``, ``recipe``, ...).

    The model is read where it sits, in its dtype, and left as it was."""
    for key in scorers or ():
        score_direction(key)  # an unknown name fails before any pass
    lm = held(model, tokenizer)
    run_settings, inputs = settings_of(lm, progress=progress, batch_size=batch_size, **settings)
    run = open_run(run_settings, inputs, None, encode=texts is None, loaded=lm)
    if texts is None:
        scored = score(run)
        table, source = scored.table, scored.calibration
    else:
        seqs = [s for s in (encode(lm, t)[: run_settings.max_length] for t in _texts(texts)) if len(s) >= 2]
        if not seqs:
            raise UserError("texts holds no text of at least 2 tokens; pass a list of strings")
        table, source = run.work.scores(seqs), f"{len(seqs)} texts given"
    keep = list(scorers or SCORE_KEYS)
    return HeadScores({k: v for k, v in table.per_input.items() if k in keep}, source, tuple(table.token_counts))


def _texts(texts) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise UserError("texts must be a list of strings (one calibration text each), not a single string")
    return list(texts)
