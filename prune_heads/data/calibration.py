"""User calibration text: JSONL with a ``text`` field, or plain text with one input per line."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..readers import read_text


def load_calibration(path: str | Path, limit: int | None = None) -> list[str]:
    path = Path(path)
    if path.is_file():
        lines = [ln for ln in read_text(path, "calibration file").splitlines() if ln.strip()]
    elif not path.exists():
        raise UserError(
            f"calibration file {path} does not exist; pass a .jsonl file with a 'text' field or a text file"
        )
    else:
        raise UserError(f"calibration file {path} is not a regular file; pass a text or .jsonl file")
    if not lines:
        raise UserError(f"calibration file {path} is empty; it needs at least one non-empty line of text")
    is_jsonl = path.suffix == ".jsonl" or lines[0].lstrip().startswith("{")
    texts: list[str] = []
    if is_jsonl:
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(
                    f"calibration file {path}, line {n}, is not valid JSON; fix it or use a plain text file"
                ) from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise UserError(
                    f"calibration file {path}, line {n}, has no string 'text' field; each line needs "
                    '{"text": "..."}'
                )
            if row["text"].strip():
                texts.append(row["text"])
    else:
        texts = lines
    if not texts:
        raise UserError(f"calibration file {path} has no non-empty texts")
    return texts[:limit] if limit else texts
