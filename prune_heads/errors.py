"""The exception types the CLI turns into a one-line message and exit code 2. They carry facts; the CLI words them."""
from __future__ import annotations

import errno
from pathlib import Path


class UserError(Exception):
    """Bad input from the user: the message names the problem and the fix. An option is named by its parameter name
    in backticks (```budget```); the command line shows it as its flag (``--budget``), a library user as written."""


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
