"""How the command line words what the core says. The core names an option by its parameter name in backticks
(```budget```, ```export_format```: errors.py); here it becomes the flag of this command table (``--budget``,
``--format``). Lines the core says (``prune_heads.console``) go to stderr through click in their style, colour only
on a terminal (click strips it elsewhere)."""
from __future__ import annotations

import logging
import re

import click

from prune_heads.console import LOG

_FLAGS: dict[str, str] = {}  # parameter name -> flag, from the command table (learn_flags)


def learn_flags(cli: click.Group) -> None:
    """Read every command's options: each under its parameter name (a setting's name: `lora_adapter` is --adapter)
    and under its own spelling (`no_export` is --no-export; a secondary flag such as --no-confirm is no_confirm); the
    command table calls this once it is defined."""
    flags = _FLAGS
    commands = [cli, *cli.commands.values()]
    for command in commands:
        for p in command.params:
            if isinstance(p, click.Option):
                long = [o for o in p.opts if o.startswith("--")]
                if long:
                    flags.setdefault(p.name, long[0])
                for o in [*long, *p.secondary_opts]:
                    flags.setdefault(o[2:].replace("-", "_"), o)


def worded(text: str) -> str:
    """``text`` with every option the core names in backticks as this command line's flag."""
    flags = _FLAGS
    return re.sub(r"`([a-z_][a-z0-9_]*)`", lambda m: flags.get(m.group(1), m.group(0)), text)


def worded_json(obj):
    """A report's content with its texts worded (warnings and reasons quote the core's messages)."""
    if isinstance(obj, str):
        return worded(obj)
    if isinstance(obj, dict):
        return {k: worded_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [worded_json(v) for v in obj]
    return obj


class ClickHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.secho(worded(record.getMessage()), err=True, **getattr(record, "style", {}))
        except Exception:  # noqa: BLE001  (logging's own rule: a failed line never stops the run)
            self.handleError(record)


def show_core_messages() -> None:
    """Print the core's lines (once per process; idempotent)."""
    if not any(isinstance(h, ClickHandler) for h in LOG.handlers):
        LOG.addHandler(ClickHandler(logging.INFO))  # the loader's debug events are for benchmarks, not the user
    if LOG.level == logging.NOTSET or LOG.level > logging.INFO:
        LOG.setLevel(logging.INFO)
    LOG.propagate = False
