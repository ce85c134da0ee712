"""Reading JSONL prompt files, with errors that name the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (line number, row) for every non-blank line of a JSONL file; every row must be an object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt file not found")
    with path.open(encoding="utf-8", errors="strict") as f:
        for line_no, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__} "
                                 f"{line.strip()[:40]}")
            yield line_no, row


def _lines(f: Any, path: Path) -> Iterator[tuple[int, str]]:
    line_no = 0
    try:
        for line_no, line in enumerate(f, 1):
            yield line_no, line
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}:{line_no + 1}: not UTF-8 text ({err.reason})") from None


def file_and_limit(spec: str | Path) -> tuple[Path, int | None]:
    """"FILE:N" -> (FILE, N), the first N rows of FILE; "FILE" -> (FILE, None).

    A path that exists as given is taken whole, even if it ends in ":<digits>".
    """
    text = str(spec)
    head, sep, tail = text.rpartition(":")
    if not sep or not tail.isdigit() or Path(text).exists():
        return Path(text), None
    if int(tail) < 1:
        raise ValueError(f"{text}: the row limit after ':' must be >= 1")
    return Path(head), int(tail)
