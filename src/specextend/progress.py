"""Progress lines for the user: one line on stderr, prefixed with the program's name."""

from __future__ import annotations

import sys


def say(progress: bool, message: str) -> None:
    """Print `specextend: message` on stderr when `progress` is on (commands turn it off with -q)."""
    if progress:
        print(f"specextend: {message}", file=sys.stderr, flush=True)
