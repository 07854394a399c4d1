"""Finite or refused. Every figure prune-heads measures (log-likelihoods, answer and next-token KL, greedy agreement,
generations, probe losses) is read from the model's logits, so the logits are checked where they are produced: a
forward hook on the output embedding (``lm_head``) for as long as a measurement runs. A model whose activations
overflow in its dtype (a float16 checkpoint whose finite weights exceed float16's range in a layer) stops the run
with ``NonFinite`` before a NaN can be averaged, compared or counted as agreement."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from prune_heads.errors import NonFinite
from prune_heads.heads import HeadSet


def described(target: object) -> str:
    """A head set, plan or mask as the error names it: "unablated", "with 3 heads ablated", ..."""
    if target is None:
        return "unablated"
    if isinstance(target, str):
        return target
    if isinstance(target, HeadSet):
        return f"with {len(target)} heads ablated" if len(target) else "unablated"
    if isinstance(target, torch.Tensor):
        if target.dim() == 3:
            return "with a head mask per input"
        return f"with {int((target == 0).sum())} heads ablated"
    removed = getattr(target, "removed", None)  # a PrunePlan
    return f"with {len(removed)} heads removed" if isinstance(removed, HeadSet) else "with heads ablated"


@contextmanager
def finite_logits(lm, task: str, target: object = None) -> Iterator[None]:
    """Within: every forward pass of ``lm`` (a ``LoadedModel``) whose logits hold a NaN or an infinity raises
    ``NonFinite`` naming ``task``, ``target`` (the head set ablated, if any) and the model's dtype."""
    head = lm.model.get_output_embeddings()
    if head is None:  # no output embedding module to watch: nothing to hook
        yield
        return

    def check(module, args, output):
        if not bool(torch.isfinite(output).all()):
            raise NonFinite(task, described(target), lm.dtype)

    handle = head.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
