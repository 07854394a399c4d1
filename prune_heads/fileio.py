"""Atomic file writes (a reader sees the previous file or the complete new one, never half of one), the --out rule,
and the staging directory every command writes into. Input files are read by readers.py."""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import UserError


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are ordinary files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def sha256_file(path: str | os.PathLike) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> Path:
    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, _write)


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


class StagedDirectory:
    """Write a whole output directory beside its final name, then rename it into place.

    Until ``commit`` everything lives in ``.{name}.partial`` next to ``out``, so an interrupted run never leaves a
    directory that looks finished under the final name. The name is fixed, so rerunning the same command finds
    the finished work cached in ``.{name}.partial/cache`` and resumes; a lock keeps two runs apart. ``force``
    replaces an existing ``out`` (moved aside first, removed only after the new one is in place); ``resume``
    also allows a finished ``out`` of ours (one that carries the ``MARKER`` file) and reuses its cache.

    ``inputs``: the files and directories the run reads; an ``out`` that is one of them, lies inside one, or contains
    one is refused even with ``force`` (replacing it would delete the input)."""

    current: "StagedDirectory | None" = None

    def __init__(self, out: str | os.PathLike, force: bool, resume: bool = False, inputs: tuple | list = ()):
        import fcntl

        self.out = Path(out)
        check_out(self.out, force, resume, inputs)
        self.path = self.out.parent / f".{self.out.name}.partial"
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.resumed = self.path.is_dir() and any((self.path / "cache").glob("*.safetensors"))
            self.path.mkdir(exist_ok=True)
            (self.path / MARKER).write_text("written by prune-heads\n")
        except OSError as e:
            raise UserError(f"--out {self.out} cannot be written ({e.strerror or type(e).__name__}); choose a "
                            "directory you can write to") from None
        self._lock = open(self.path / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise UserError(f"another prune-heads run is writing {self.out} (lock held on {self.path}); wait for it "
                            "or choose another --out") from None
        previous = self.out / "cache"
        if resume and previous.is_dir():
            (self.path / "cache").mkdir(exist_ok=True)
            for f in previous.glob("*.safetensors"):
                target = self.path / "cache" / f.name
                if not target.exists():
                    try:
                        os.link(f, target)
                    except OSError:
                        import shutil

                        shutil.copy2(f, target)
            self.resumed = True
        StagedDirectory.current = self

    @property
    def cache_dir(self) -> Path:
        return self.path / "cache"

    def _release(self) -> None:
        if not self._lock.closed:
            self._lock.close()
        (self.path / ".lock").unlink(missing_ok=True)
        StagedDirectory.current = None

    @property
    def offload_dir(self) -> Path:
        """Where accelerate offloads weights with --device-map (a copy of the model: removed before commit)."""
        return self.path / ".offload"

    def commit(self) -> Path:
        import shutil

        self._release()
        shutil.rmtree(self.offload_dir, ignore_errors=True)
        old = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.rmdir(old)
            os.replace(self.out, old)
        mask = _umask()
        os.chmod(self.path, 0o777 & ~mask)
        for f in self.path.rglob("*"):  # some writers (and mkstemp) leave 0600 files
            if f.is_file():
                os.chmod(f, 0o666 & ~mask)
        os.replace(self.path, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def keep_for_resume(self) -> None:
        """After a failure: keep the finished work for the next run; drop the directory if there is none."""
        import shutil

        self._release()
        shutil.rmtree(self.offload_dir, ignore_errors=True)
        if not any(self.cache_dir.glob("*.safetensors")):
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "StagedDirectory":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.keep_for_resume()


MARKER = ".prune-heads"  # in every directory prune-heads writes: what --resume may continue and replace
MANIFEST_NAME = "prune_heads.json"


def _overlaps(out: Path, path: Path) -> str | None:
    """How ``out`` collides with the input ``path`` (None if it does not)."""
    out, path = out.resolve(), path.resolve()
    if out == path:
        return "is"
    if path.is_relative_to(out):
        return "contains"
    if out.is_relative_to(path):
        return "is inside"
    return None


def is_ours(out: Path) -> bool:
    """A directory a prune-heads run wrote (its marker, or an export's manifest)."""
    return (out / MARKER).is_file() or (out / MANIFEST_NAME).is_file()


def check_out(out: Path, force: bool, resume: bool = False, inputs: tuple | list = ()) -> None:
    """The one rule for --out: never delete or replace what prune-heads did not write unless --force, never an input
    even with --force; --resume continues only a run of ours."""
    for path in inputs:
        how = _overlaps(out, Path(path))
        if how:
            raise UserError(f"--out {out} {how} the input {path}; writing there would destroy it (even with --force); "
                            "choose another --out")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; choose another path")
    if not out.is_dir() or not any(out.iterdir()) or force:
        return
    if resume and is_ours(out):
        return
    if resume:
        raise UserError(f"--out {out} is not empty and was not written by prune-heads, so there is nothing to "
                        "resume; choose an empty directory, or pass --force to replace it")
    raise UserError(f"--out {out} is not empty; choose an empty directory, pass --resume to continue from its "
                    "cached results, or --force to replace it")
