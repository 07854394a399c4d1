"""Atomic file writes: a reader sees the previous file or the complete new one, never half of one. The staging
directory every command writes into, the --out rule and the run identity are in staging.py; input files are read by
readers.py."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from prune_heads.errors import UserError

NAME_MAX = 255  # bytes in one path component on Linux file systems (ext4, xfs, btrfs, tmpfs)


def hidden_name(name: str, suffix: str, room: int = 0) -> str:
    """``.{name}{suffix}``, the name of a file or directory kept beside ``name`` while it is written; when that would
    pass ``NAME_MAX`` bytes (with ``room`` more for a random part), ``name`` is cut and a digest of it keeps the
    result unique and the same on every run (a rerun finds its staging directory)."""
    import hashlib

    whole = f".{name}{suffix}"
    if len(os.fsencode(whole)) + room <= NAME_MAX:
        return whole
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    keep = NAME_MAX - room - len(os.fsencode(f".-{digest}{suffix}"))
    cut = os.fsencode(name)[:keep].decode("utf-8", "ignore")
    return f".{cut}-{digest}{suffix}"


def check_path_names(paths: dict[str, object]) -> None:
    """Each path (keyed by the option that gave it) one the file system and the model libraries can use: every name
    in it at most ``NAME_MAX`` bytes, and UTF-8 (tokenizers and safetensors take UTF-8 paths only). Checked before
    anything is read or written, so the refusal is one line naming the option, the path and the limit."""
    for option, path in paths.items():
        if path is None:
            continue
        label = option if option.isupper() else f"`{option}`"  # an argument (DIRECTORY), or an option's name
        text = os.fspath(path)
        if isinstance(text, bytes) or any("\udc80" <= c <= "\udcff" for c in text):
            shown = repr(os.fsdecode(text))[1:-1]
            raise UserError(f"{label} {shown} holds bytes that are not UTF-8, which the model libraries cannot "
                            "open; rename it with UTF-8 characters only")
        for part in Path(text).parts:
            if len(os.fsencode(part)) > NAME_MAX:
                raise UserError(f"{label} {text[:60]}... is too long for the file system: the name {part[:20]}... "
                                f"has {len(os.fsencode(part))} bytes, more than the {NAME_MAX} a file or directory "
                                "name may have; choose a shorter name")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary file beside ``path`` to write inside the block; afterwards it is fsynced and renamed into place
    (on any failure it is removed and ``path`` is left as it was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=hidden_name(path.name, ".", room=12), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def sha256_file(path: str | os.PathLike) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN or infinity replaced by None: what JSON can hold (NaN is not JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(json_safe(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    return write_text(path, "".join(json.dumps(json_safe(r), allow_nan=False) + "\n" for r in rows))


def remove_tree(path: str | os.PathLike) -> OSError | None:
    """Remove a directory tree, read-only parts included (a name that cannot be removed for its directory's missing
    write permission is removed once that is granted, as a user would with ``chmod -R u+w``): None once it is gone,
    else the error that kept part of it (a mount point, a file system mounted read-only, a file that is not the
    user's)."""
    import shutil
    import stat

    failed: list[OSError] = []

    def retry(function, name, info):
        if function not in (os.unlink, os.rmdir):  # opening or listing a directory: nothing a permission bit mends
            failed.append(info[1])
            return
        parent = os.path.dirname(name)
        try:
            os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
            function(name)
        except OSError as e:
            failed.append(e)

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)
    return failed[0] if failed else None
