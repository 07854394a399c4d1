"""The documentation site (mkdocs.yml, docs/): it builds under --strict, its command-line reference is generated from
the click command table and holds every option of every command, and the README stays a quickstart."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from prune_heads_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
SETUP = ("bash .ci/install && prune-heads --model smollm2-135m --out ./pruned", "python -m pytest -q")


def test_the_readme_is_a_quickstart_with_the_two_set_up_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert tuple(block) == SETUP


def _every_option() -> dict[str, list[str]]:
    """{command: every option string and argument name}, the main command's own included."""
    out = {"prune-heads": [o for p in cli.params for o in p.opts if isinstance(p, click.Option)]}
    for name, command in cli.commands.items():
        out[name] = [o for p in command.params for o in (p.opts if isinstance(p, click.Option) else [p.name.upper()])]
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None and not os.environ.get("CI"),
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strict_and_its_cli_reference_holds_every_option(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    text = re.sub(r"<[^>]+>", " ", page).replace("&#45;", "-").replace("&ndash;", "-")
    missing = {name: [o for o in opts if o not in text] for name, opts in _every_option().items()}
    assert not {k: v for k, v in missing.items() if v}, missing
    for name in cli.commands:
        assert f"prune-heads {name}" in text, name
