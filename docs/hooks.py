"""MkDocs hook: the settings reference (docs/reference/settings.md) is generated from the declaration of every setting
(prune_heads/pipeline/settings.py) when the site builds, as the command-line reference is from the command table."""
from __future__ import annotations

MARKER = "<!-- settings-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from prune_heads.pipeline.recipes import RECIPE_ONLY
    from prune_heads.pipeline.settings import reference_rows

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| setting (API keyword) | recipe key | flag | default | what it is |", "|---|---|---|---|---|"]
    for row in reference_rows():
        code = lambda value: f"`{cell(value)}`" if value else ""  # noqa: E731
        lines.append(f"| `{row['name']}` | {code(row['recipe'])} | {code(row['flag'])} | {code(row['default'])} | "
                     f"{cell(row['help'])} |")
    lines += ["", "Recipe keys that are not a setting of their own:", "", "| recipe key | what it is |", "|---|---|"]
    lines += [f"| `{key}` | {cell(text)} |" for key, (_, text) in RECIPE_ONLY.items()]
    return markdown.replace(MARKER, "\n".join(lines))
