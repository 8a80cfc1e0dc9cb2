"""Counts in messages: "1 token", "2 tokens" (one rule for every line a user reads)."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for exactly one (`plural`: an irregular plural)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
