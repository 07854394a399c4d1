"""The exceptions prune-heads raises on purpose, one hierarchy: ``PruneHeadsError`` is the root, ``UserError`` (also a
``ValueError``) is bad input whose message names the problem and the fix; the command line turns each into one line
and exit code 2, the Python API raises it as it is. They carry facts; the CLI words them.

    PruneHeadsError
      UserError (ValueError)            bad input: the message names the problem and the fix
        UnsupportedModel                a model of a family (or a kind) prune-heads has no adapter for
        AlreadyPruned                   weights whose head counts disagree with their config (pruned by another tool)
        HeadIndexError (IndexError)     a head set naming a layer or head the model does not have
        NotSliceable (TypeError)        a projection whose weights cannot be sliced by rows (a quantised linear layer)
        NonFinite                       the model computed NaN or infinity where something is measured
        DiskFull                        a write of the run failed for lack of space
"""
from __future__ import annotations

import errno
from pathlib import Path


class PruneHeadsError(Exception):
    """The root of every exception prune-heads raises on purpose."""


class UserError(PruneHeadsError, ValueError):
    """Bad input from the user: the message names the problem and the fix. An option is named by its parameter name
    in backticks (```budget```); the command line shows it as its flag (``--budget``), a library user as written."""


class UnsupportedModel(UserError):
    """A model prune-heads cannot work on: a family without an architecture adapter, or not a transformers causal
    language model."""


class AlreadyPruned(UserError):
    """A model whose attention weights disagree with its config's head counts: pruned by another tool that left the
    config as it was, so no head index can be trusted."""


class HeadIndexError(UserError, IndexError):
    """A head set naming a layer or a head the model does not have."""


class NotSliceable(UserError, TypeError):
    """A projection prune-heads cannot slice by rows: a quantised linear layer (bitsandbytes, GPTQ, AWQ, ...)."""


class DiskFull(UserError):
    """A write of the run failed for lack of space: where, what was being written, and about how many bytes the
    write needed in all (None: not known). The CLI adds how much is free once the run's partial files are gone."""

    def __init__(self, directory: str | Path, what: str, needed: int | None = None):
        self.directory, self.what, self.needed = Path(directory), what, needed
        super().__init__(f"the disk holding {self.directory} filled up while writing {what}")


# How a full disk reads when it reaches us through a library that does not raise OSError(ENOSPC): safetensors' Rust
# writer ("No space left on device (os error 28)"), torch.save's zip writer ("PytorchStreamWriter failed writing
# file ...: file write failed"), numpy's short write under the GGUF writer ("9216 requested and 7072 written").
_FULL_DISK_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded",
                    "PytorchStreamWriter failed writing", " requested and ")


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or an exception it was raised from) is a write that failed for lack of space."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFull):
            return True
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in _FULL_DISK_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


class NonFinite(UserError):
    """The model computed a non-finite value (NaN or infinite) on ``task`` with ``heads`` (a description: "unablated",
    "with 3 heads ablated") in ``dtype``: nothing measured from it is averaged, compared or counted."""

    def __init__(self, task: str, heads: str, dtype: object):
        self.task, self.heads, self.dtype = task, heads, str(dtype).removeprefix("torch.")
        super().__init__(f"the model's logits on {task} ({heads}) are not finite (NaN or infinite) in {self.dtype}: "
                         "its activations overflow in this dtype, so nothing can be measured from them; load it in "
                         "float32 or bfloat16 (`dtype` float32)")
