"""How a benchmark script hands its result over: printed, and written to ``--out`` if given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(text: str, out: str | None) -> int:
    """Print a markdown report and write it to ``out``; the script's exit code (0)."""
    print(text)
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
    return 0


def emit_rows(rows: list[dict[str, Any]], out: str | None) -> int:
    """Print one JSON object per row and write them all to ``out`` as a JSON list."""
    for row in rows:
        print(json.dumps(row))
    if out:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0
