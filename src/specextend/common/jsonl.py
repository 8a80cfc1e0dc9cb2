"""JSON Lines, read and written in one place: prompt files (field `text` of each record), and
results (NaN-safe values, durable appends, rows read back past a line cut short by a killed run).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UserError


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


def read_rows(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Complete rows of a results file (bench rows, needle trials, sweep runs). A trailing partial
    line (a killed writer) is ignored, and with `repair` cut off so that later appends start on a
    fresh line; another line that is not JSON is ignored with a warning."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        with open(path, "r+b") as f:
            f.truncate(end)
    rows = []
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            print(f"specextend: warning: {path} line {lineno} is not valid JSON; ignored", file=sys.stderr)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- prompt files


def read_texts(path: Path) -> list[str]:
    """Field `text` of every record (blank lines are not records); UserError when unusable."""
    texts = []
    for lineno, line in _records(path, str(path)):
        text = _record_text(str(path), lineno, line)
        if not text.strip():
            raise UserError(f"{path} line {lineno} has an empty 'text'")
        texts.append(text)
    if not texts:
        raise UserError(f"{path} holds no records")
    return texts


def text_at(name: str, index: int) -> str:
    """Field `text` of the index-th record of the file `name` (0-based; blank lines are not records)."""
    if index < 0:
        raise UserError(f"--index must be >= 0, got {index}")
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"JSONL file not found: {name}")
    count = 0
    for lineno, line in _records(path, name):
        if count == index:
            return _record_text(name, lineno, line)
        count += 1
    raise UserError(f"--index {index} is out of range: {name} has {count} records")


def read_requests(name: str) -> list[dict[str, Any]]:
    """The records of a prompts file (`generate --prompts-file`): field `prompt` (text, or token
    ids) and the line's own settings; each record also gets its line number as `_line`."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"prompts file not found: {name}")
    out = []
    for lineno, line in _records(path, name):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{name} line {lineno} is not valid JSON: {e.msg}") from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not (isinstance(prompt, str) and prompt.strip()) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise UserError(f"{name} line {lineno} has no field 'prompt' (a non-empty string or a list of token ids)")
        out.append({**record, "_line": lineno})
    if not out:
        raise UserError(f"{name} holds no records")
    return out


def _records(path: Path, name: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each record, read lazily; errors name the file as `name`."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 text: {e.reason}") from None
    except OSError as e:
        raise UserError(f"cannot read {name}: {e.strerror}") from None


def _record_text(name: str, lineno: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{name} line {lineno} is not valid JSON: {e.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserError(f"{name} line {lineno} has no string field 'text'")
    return record["text"]
