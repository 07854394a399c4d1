"""Parameter counts: the one place the card's, the manifest's and the report's figures come from.

A tied LM head (``tie_word_embeddings``) is the embedding matrix itself: it is counted once, whether it is counted in
a model (``named_parameters`` already yields a shared tensor once) or in safetensors files (a checkpoint may still
store ``lm_head.weight`` beside the embedding; transformers ties it on load).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

TIED_HEAD = "lm_head.weight"


def is_tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def count_parameters(shapes: Mapping[str, Sequence[int]], tied: bool) -> int:
    """Parameters of a state dict given as ``{name: shape}``; a tied LM head counts once (with the embedding)."""
    return sum(math.prod(shape) for name, shape in shapes.items() if not (tied and name.endswith(TIED_HEAD)))


def model_parameters(model) -> int:
    """Parameters of a loaded model (a tensor shared by two modules, as a tied head, once)."""
    return count_parameters({n: p.shape for n, p in model.named_parameters()}, is_tied(model.config))


def weight_bytes(model) -> int:
    """Bytes of a loaded model's parameters as they are held (each tensor once, tied ones included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def safetensors_shapes(paths: Iterable[str | Path]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in these safetensors files (headers only, checked to be whole)."""
    from prune_heads.models.checks import safetensors_header

    shapes: dict[str, tuple[int, ...]] = {}
    for path in paths:
        header = safetensors_header(Path(path), str(path))
        shapes.update({name: tuple(h["shape"]) for name, h in header.items() if name != "__metadata__"})
    return shapes


def checkpoint_parameters(paths: Iterable[str | Path], config) -> int:
    """Parameters stored in a checkpoint's safetensors files, as the model they load into has them."""
    return count_parameters(safetensors_shapes(paths), is_tied(config))


@contextlib.contextmanager
def layer_tokens_counted(decoder_layers) -> Iterator[None]:
    """Inside, every token a decoder layer reads (rows x tokens of its input) is charged to the run's clock
    (timings.StageClock.read): what each stage read, layer by layer (a pass that starts above layer 0 is charged
    only for the layers it runs)."""
    from prune_heads import timings

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        timings.clock().read(int(hidden.shape[0]) * int(hidden.shape[1]))

    handles = [layer.register_forward_pre_hook(count, with_kwargs=True) for layer in decoder_layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
