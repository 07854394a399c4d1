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
    from prune_heads.pipeline.recipes import RECIPE_ONLY
    from prune_heads.pipeline.settings import declarations

    page = (site / "reference" / "settings" / "index.html").read_text(encoding="utf-8")
    assert [name for name in [*declarations(), *RECIPE_ONLY] if f"<code>{name}</code>" not in page] == []


def test_the_api_reference_documents_every_public_function_and_class(tmp_path):
    """docs/reference/api.md names every public function and class (mkdocstrings renders their docstrings; the site
    test above builds it under --strict)."""
    import prune_heads

    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    assert [n for n in prune_heads.__all__ if n != "__version__" and not re.search(rf"\b{n}\b", page)] == []


@pytest.mark.slow
@pytest.mark.embedded
def test_the_python_api_guide_runs_as_written(tmp_path):
    """docs/guides/python-api.md's code blocks, in order, as one notebook runs them (in a fresh Python, in an empty
    directory): on the embedded model loaded with plain transformers, every step and its assertions."""
    guide = (ROOT / "docs" / "guides" / "python-api.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) >= 6
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("['awft', 'aeqd', 'ftvvn', 'avvn'] (30, 9)"), done.stdout
    assert any(" heads: {" in line for line in lines) and "confirmed on unseen questions: True" in lines
    assert (tmp_path / "smollm2-pruned" / "config.json").is_file()
    assert "pruned_llama per-layer" in lines or "llama uniform" in lines
