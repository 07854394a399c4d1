"""User calibration text: JSONL with a ``text`` field, or plain text with one input per line."""
from __future__ import annotations

from pathlib import Path

from prune_heads.errors import UserError
from prune_heads.io.readers import parse_json, read_text


def load_calibration(path: str | Path, limit: int | None = None, what: str = "calibration file") -> list[str]:
    """The texts of ``path`` (the first ``limit``); ``what`` names the file in errors (--calibration, --kl-text,
    --heal-data files are read alike)."""
    path = Path(path)
    if path.is_file():
        lines = [ln for ln in read_text(path, what).splitlines() if ln.strip()]
    elif not path.exists():
        raise UserError(
            f"{what} {path} does not exist; pass a .jsonl file with a 'text' field or a text file"
        )
    else:
        raise UserError(f"{what} {path} is not a regular file; pass a text or .jsonl file")
    if not lines:
        raise UserError(f"{what} {path} is empty; it needs at least one non-empty line of text")
    is_jsonl = path.suffix == ".jsonl" or lines[0].lstrip().startswith("{")
    texts: list[str] = []
    if is_jsonl:
        for n, line in enumerate(lines, 1):
            row = parse_json(line, path, what, line=n)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise UserError(
                    f"{what} {path}, line {n}, has no string 'text' field; each line needs "
                    '{"text": "..."}'
                )
            if row["text"].strip():
                texts.append(row["text"])
    else:
        texts = lines
    if not texts:
        raise UserError(f"{what} {path} has no non-empty texts")
    return texts[:limit] if limit else texts
