"""How the package words things for people: counts with their nouns, tokens with their
whitespace visible (messages, plots, HTML and the explorer share these)."""

from __future__ import annotations

__all__ = ["WHITESPACE_MARKS", "plural", "visible_token"]

WHITESPACE_MARKS = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}


def plural(count: int, noun: str) -> str:
    """``"1 trace"``, ``"2 traces"``, ``"0 traces"``: the count and its noun, agreeing."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def visible_token(token: str) -> str:
    r"""Token text with whitespace made visible (space ·, newline ↵, tab →, CR ␍; empty ∅).

    Examples
    --------
    >>> visible_token(" a\n")
    '·a↵'
    """
    return "".join(WHITESPACE_MARKS.get(ch, ch) for ch in str(token)) if token else "∅"
