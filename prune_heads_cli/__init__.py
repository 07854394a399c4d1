"""The prune-heads command line: the command table (main.py), its shared options (options.py), what each command does
(commands.py: the main job and export; measure.py: score, eval, compare, study), and the edge where errors, option
names and the memory policy are decided (edge.py, console.py, memory.py).

This package sits above both the core (``prune_heads``) and the exporters (``exporters``) and is the only code that
imports both."""

import os as _os
import signal as _signal
import sys as _sys


def _quiet_interrupt(signum, frame):  # Ctrl-C while the libraries import (before main runs): no traceback
    _os.write(2, b"interrupted before anything was written\n")
    _os._exit(130)


# Only when this process is the command (the console script, or python -m while it imports), never for a library
# user; main() puts Python's handler back once it can clean up.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("prune-heads", "-m", "__main__.py") and \
        _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    try:
        _signal.signal(_signal.SIGINT, _quiet_interrupt)
    except ValueError:  # not the main thread
        pass
