"""Results as JSON: NaN-safe values, and durable appends to a JSON Lines file (bench rows, needle trials)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def finite_json(x: Any) -> Any:
    """JSON has no NaN/inf; a broken timer must not make the output unparsable."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_json(v) for v in x]
    return x


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one complete line, on disk (flush + fsync) before the caller goes on.

    A run killed mid-write leaves a last line without its newline; the record then starts on a
    fresh line, so only the cut line is lost (readers skip it).
    """
    line = json.dumps(finite_json(record), ensure_ascii=False, allow_nan=False) + "\n"
    with open(path, "a+b") as f:  # appends always go to the end, whatever was read
        size = f.seek(0, os.SEEK_END)
        cut = False
        if size:
            f.seek(size - 1)
            cut = f.read(1) != b"\n"
        f.write((b"\n" if cut else b"") + line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
