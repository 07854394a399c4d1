"""What a run tells its user while it works: lines on the ``prune_heads`` logger, each with the style it is shown in.

The core only says things; the command line (``prune_heads_cli``) decides how they are shown (it installs the
handler that prints them to stderr, coloured). A library user (the Python API) sees them once logging is
configured (``logging.basicConfig(level=logging.INFO)``); until then nothing is printed."""
from __future__ import annotations

import logging

LOG = logging.getLogger("prune_heads")
LOG.addHandler(logging.NullHandler())  # a library's logger: silent until the application configures logging


def say(message: str, **style) -> None:
    """One line for the user; ``style``: how a terminal may show it (fg, bold)."""
    LOG.info(message, extra={"style": style})


def warn(message: str) -> None:
    """A warning the user must not miss (the run goes on)."""
    LOG.warning("WARNING: " + message, extra={"style": {"fg": "red", "bold": True}})
