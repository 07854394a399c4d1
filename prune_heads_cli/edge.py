"""Where a run ends badly, worded for the user: a typed error from the core (UserError, DiskFull) or an interrupt
becomes one line and an exit code; anything else is a bug, reported in one line with the traceback in a log file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click


def interrupted() -> None:
    from prune_heads.io.staging import StagedDirectory

    staged = StagedDirectory.current
    where = f" in {staged.path}" if staged is not None else ""
    click.secho(f"interrupted: nothing under the final --out name was touched; finished work is kept{where}; "
                "rerun the same command to resume", err=True, fg="yellow")
    sys.exit(130)


def left_behind() -> None:
    """A warning for each previous --out that --force replaced but could not remove entirely (a mount point in it, a
    read-only file system): where it is kept, so nothing stays behind without a word."""
    from prune_heads.console import warn
    from prune_heads.io.staging import StagedDirectory

    for out, old, error in StagedDirectory.left_behind:
        warn(f"the previous {out.name} was replaced, but part of it could not be removed ({error}); it is kept as "
             f"{old}: remove it yourself")
    StagedDirectory.left_behind.clear()


def written_directory(error: BaseException) -> Path:
    """The directory a failed write was writing to: the file the error names, else the run's --out."""
    from prune_heads.io.staging import StagedDirectory

    while error is not None:
        if isinstance(error, OSError) and error.filename:
            return Path(error.filename).parent
        error = error.__cause__ or error.__context__
    staged = StagedDirectory.last
    return staged.path if staged is not None else Path.cwd()


def disk_full(directory: Path, what: str, needed: int | None = None) -> None:
    """One line: where the disk filled up, what that needed, what is free now that the run's partial files are gone
    (its finished work stays cached, so the same command resumes)."""
    from prune_heads.io.diskspace import free_bytes, gib, with_margin

    existing = next((p for p in (directory, *directory.parents) if p.exists()), Path("/"))
    free = gib(free_bytes(existing))
    need = (f"it needs about {gib(with_margin(needed))}" if needed else "it needs more") + f", {free} are free now"
    click.secho(f"error: the disk holding {directory} filled up while writing {what}; {need} (this run's partial "
                "files were removed, its finished work is kept); free some space and rerun the same command to resume",
                err=True, fg="red")
    sys.exit(2)


def path_problem(error: BaseException) -> str | None:
    """A path the file system refuses, as one line naming the path and the limit (None: not such an error): a name
    longer than the file system allows (ENAMETOOLONG), or a name that cannot be encoded for it."""
    import errno

    from prune_heads.io.files import NAME_MAX

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:
            path = os.fsdecode(error.filename or "?")
            longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
            return (f"the path {path[:60]}{'...' if len(path) > 60 else ''} is too long for the file system: a name "
                    f"in it has {longest} bytes, more than the {NAME_MAX} a file or directory name may have (a whole "
                    "path at most 4096); choose a shorter name")
        if isinstance(error, UnicodeEncodeError) and "surrogate" in str(error):
            return (f"the name {error.object[:60]!r} holds bytes that are not UTF-8, which the model libraries cannot "
                    "use; rename the file or directory with UTF-8 characters only")
        error = error.__cause__ or error.__context__
    return None


def terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops like Ctrl-C: through the same clean-up path


def unexpected(error: BaseException) -> None:
    """A bug or an unforeseen failure: one line naming it, the traceback in a log file, exit code 1."""
    import tempfile
    import traceback

    fd, log = tempfile.mkstemp(prefix="prune-heads-", suffix=".log")
    with open(fd, "w") as f:
        traceback.print_exception(type(error), error, error.__traceback__, file=f)
    first = (str(error).strip().splitlines() or [""])[0][:200]
    if getattr(sys.stderr, "name", "") == os.devnull:  # a rank other than 0 prints nothing else, but its failure
        sys.stderr = sys.__stderr__
    click.secho(f"error: unexpected failure ({type(error).__name__}: {first}); the traceback is in {log}; "
                "please report it", err=True, fg="red")
    sys.exit(1)
