"""The staging directory every command writes into (renamed into place once complete, so an interrupted or failed
run never leaves a half-written --out), the --out rule (what may be written where, and what --force and --resume may
replace), and the run identity in each staging directory's marker (what a rerun may resume)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from prune_heads.errors import DiskFull, UserError, is_disk_full
from prune_heads.io.files import current_umask, hidden_name, remove_tree, write_text


def cache_entries(directory: Path) -> list[Path]:
    """The finished work in a cache directory: result entries (safetensors) and lm-eval's request caches (SQLite)."""
    return [*directory.glob("*.safetensors"), *directory.glob("*.sqlite")] if directory.is_dir() else []


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
    last: "StagedDirectory | None" = None  # the latest one opened, still known after a failure released it
    left_behind: list = []  # (out, the previous out moved aside, why part of it stays) of each --force replacement

    def __init__(self, out: str | os.PathLike, force: bool, resume: bool | None = False, inputs: tuple | list = (),
                 identity: dict | None = None):
        # An --out that is a symbolic link is written through: the link stays, its target gets the results.
        self.out = Path(out).resolve() if Path(out).is_symlink() else Path(out)
        identity = json.loads(json.dumps(identity, default=str)) if identity else None  # as it reads back
        check_out(self.out, force, resume, inputs, identity)  # resume None: a command that cannot resume
        self.path = self.out.parent / hidden_name(self.out.name, ".partial")
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(exist_ok=True)
        except OSError as e:
            raise UserError(f"`out` {self.out} cannot be written ({e.strerror or type(e).__name__}); choose a "
                            "directory you can write to") from None
        self._lock = _locked(self.path, self.out)
        try:
            self._claim(force, identity)
            self.resumed = bool(cache_entries(self.cache_dir))
            write_text(self.path / MARKER, json.dumps({"written_by": "prune-heads", "run": identity}) + "\n")
        except BaseException as e:
            self._release()
            if not any(self.path.iterdir()):
                self.path.rmdir()
            if is_disk_full(e):
                raise DiskFull(self.path, "the staging directory's marker") from None
            if isinstance(e, OSError):
                raise UserError(f"`out` {self.out} cannot be written ({e.strerror or type(e).__name__}); choose a "
                                "directory you can write to") from None
            raise
        previous = self.out / "cache"
        if previous.is_dir() and (resume or (force and same_model(read_identity(self.out), identity))):
            self._link_cache(previous)  # entries are keyed by everything they depend on: safe to reuse
        StagedDirectory.current = StagedDirectory.last = self

    def _claim(self, force: bool, identity: dict | None) -> None:
        """Continue the unfinished work in the staging directory only if it is this run's; --force discards another
        run's (keeping the cache of the same model: its entries are keyed by everything they depend on)."""

        previous = read_identity(self.path)
        why = identity_difference(previous, identity)
        if why is None:
            return
        if not force:
            raise UserError(f"`out` {self.out} is not empty: {self.path} holds the unfinished work of another run "
                            f"({why}); rerun that command to finish it, or pass `force` to discard it")
        keep = {".lock", "cache"} if same_model(previous, identity) else {".lock"}
        for f in self.path.iterdir():
            if f.name not in keep:
                shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()

    def _link_cache(self, previous: Path) -> None:
        """Reuse ``previous``'s cache entries: safetensors entries hard-linked (never written again), lm-eval's
        request caches copied."""
        self.cache_dir.mkdir(exist_ok=True)
        for f in cache_entries(previous):
            target = self.cache_dir / f.name
            if not target.exists():
                try:
                    if f.suffix == ".sqlite":  # written in place as it grows: a copy, never the old file itself
                        raise OSError
                    os.link(f, target)
                except OSError:
                    shutil.copy2(f, target)
        self.resumed = True

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

        self._release()
        shutil.rmtree(self.offload_dir, ignore_errors=True)
        old = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(prefix=hidden_name(self.out.name, ".old-", room=8), dir=self.out.parent))
            os.rmdir(old)
            os.replace(self.out, old)
        mask = current_umask()
        os.chmod(self.path, 0o777 & ~mask)
        for f in self.path.rglob("*"):  # some writers (and mkstemp) leave 0600 files
            if f.is_file():
                os.chmod(f, 0o666 & ~mask)
        os.replace(self.path, self.out)
        if old is not None:
            error = remove_tree(old)
            if error is not None:  # said once the command is done (prune_heads_cli/edge.py)
                StagedDirectory.left_behind.append((self.out, old, error))
        return self.out

    def keep_for_resume(self) -> None:
        """After a failure: keep the finished work (the cache) for the next run and remove everything else this run
        wrote (partial shards, spilled logits, offloaded weights); drop the directory if there is no finished work."""

        self._release()
        if not cache_entries(self.cache_dir):
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for f in self.path.iterdir():
            if f.name in ("cache", MARKER):
                continue
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)

    def __enter__(self) -> "StagedDirectory":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.keep_for_resume()


MARKER = ".prune-heads"  # in every directory prune-heads writes: what --resume may continue and replace (JSON: the
# identity of the run that wrote it: command, model source and hash, the settings that define its results)
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


def _locked(path: Path, out: Path):
    import fcntl

    lock = open(path / ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another prune-heads run is writing {out} (lock held on {path}); wait for it or choose "
                        "another `out`") from None
    return lock


def read_identity(directory: Path) -> dict | None:
    """The identity of the run that wrote ``directory`` (None: none recorded, or a marker of an older version)."""
    try:
        data = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("run") if isinstance(data, dict) and isinstance(data.get("run"), dict) else None


def same_model(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and a.get("model") == b.get("model")


def identity_difference(old: dict | None, new: dict | None) -> str | None:
    """How the run that wrote a directory differs from this one, in words (None: the same run, or unknown)."""
    if old is None or new is None or old == new:
        return None
    if old.get("command") != new.get("command"):
        return f"written by prune-heads {old.get('command')}, not {new.get('command')}"
    if old.get("model") != new.get("model"):
        m = old.get("model") or {}
        return f"model {m.get('path')} with weights sha256 {str(m.get('fingerprint'))[:12]}..."
    before, after = _defining_settings(old), _defining_settings(new)
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return "other settings: " + ", ".join(f"{k} {before.get(k)!r} there, {after.get(k)!r} now" for k in keys[:3])


def _defining_settings(identity: dict) -> dict:
    """The settings of a run identity with its command's own extras (heads, ...) beside them."""
    extras = {k: v for k, v in identity.items() if k not in ("command", "model", "settings")}
    return {**(identity.get("settings") or {}), **extras}


def check_out(out: Path, force: bool, resume: bool | None = False, inputs: tuple | list = (),
              identity: dict | None = None) -> None:
    """The one rule for --out: never delete or replace what prune-heads did not write unless --force, never an input
    even with --force; --resume continues only a run of ours (``resume`` None: the command has no --resume)."""
    for path in inputs:
        how = _overlaps(out, Path(path))
        if how:
            raise UserError(f"`out` {out} {how} the input {path}; writing there would destroy it (even with `force`); "
                            "choose another `out`")
    if out.exists() and not out.is_dir():
        raise UserError(f"`out` {out} exists and is not a directory; choose another path")
    if not out.is_dir() or not any(out.iterdir()) or force:
        return
    if resume and is_ours(out):
        why = identity_difference(read_identity(out), identity)
        if why:
            raise UserError(f"`out` {out} is not empty: it holds the results of another run ({why}), so `resume` "
                            "cannot continue it; choose another `out`, or pass `force` to replace it")
        return
    if resume:
        raise UserError(f"`out` {out} is not empty and was not written by prune-heads, so there is nothing to "
                        "resume; choose an empty directory, or pass `force` to replace it")
    also = "" if resume is None else ", pass `resume` to continue from its cached results,"
    raise UserError(f"`out` {out} is not empty; choose an empty directory{also} or pass `force` to replace it")
