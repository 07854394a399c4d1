"""Run ``prune-heads`` as one torchrun rank while recording every file-system write it makes under a directory.

``torchrun --nproc-per-node 2 tests/rank_probe.py ARGS...`` with PROBE_WATCH (the directory to watch) and PROBE_LOG
(a file prefix: each rank writes PROBE_LOG.RANK, one line per write: event and path). Python's audit hooks see every
open for writing (builtin open and os.open, so tempfile and every atomic write), rename, replace, mkdir, link, chmod
and removal made from Python."""
import atexit
import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
WRITE_EVENTS = {"os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.link", "os.symlink", "os.chmod",
                "os.truncate", "shutil.copyfile", "shutil.move"}
watch = os.path.realpath(os.environ["PROBE_WATCH"])
seen: list[str] = []


def _under_watch(path) -> bool:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        return False
    return os.path.realpath(os.path.abspath(path)).startswith(watch + os.sep)


def _hook(event, args):
    if event == "open" and args:
        path, mode, flags = (list(args) + [None, None])[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & WRITE_FLAGS)
        if writes and _under_watch(path):
            seen.append(f"open {path}")
    elif event in WRITE_EVENTS and args and any(_under_watch(a) for a in args[:2]):
        seen.append(f"{event} {args[0]}")


def _dump():
    with open(f"{os.environ['PROBE_LOG']}.{os.environ.get('RANK', '0')}", "w") as f:
        f.write("\n".join(seen) + "\n")


if __name__ == "__main__":
    atexit.register(_dump)
    sys.addaudithook(_hook)
    from prune_heads_cli.main import main

    main(sys.argv[1:])
