"""User values in the Markdown prune-heads publishes (model cards, study.md, compare.md): a model name, a file
name, an lm-eval task or group name reaches them as written, never as markup (a heading, a link, live HTML, a ``|``
that splits a table)."""
from __future__ import annotations

import re


def code(value: object) -> str:
    """A value that came from a user (a model name, a file name, a path) as a Markdown code span: shown verbatim,
    never read as markup (headings, links, HTML). Control characters and line breaks become U+FFFD; the fence is
    longer than any run of backticks inside."""
    text = re.sub(r"[\x00-\x1f\x7f\u2028\u2029]", "\ufffd", str(value))
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plain(value: object) -> str:
    """A sentence that may hold a user's value, as Markdown text that renders as written: line breaks and control
    characters become spaces, and every character Markdown or HTML reads as markup is backslash-escaped (a ``|``
    too, so a table cell stays one cell; ``$``, which GitHub and the Hub read as math; ``&``, which starts an HTML
    entity)."""
    text = re.sub(r"[\x00-\x1f\x7f\u2028\u2029]", " ", str(value))
    return re.sub(r"([\\`*_{}\[\]()<>#+!|~$&-])", r"\\\1", text)
