"""Wording shared by messages: counts with their nouns."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str) -> str:
    """``"1 trace"``, ``"2 traces"``, ``"0 traces"``: the count and its noun, agreeing."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
