"""Tests for trace_replay.engines.builtin.drafts: speculative settings and prompt-lookup drafts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_replay.engines.builtin.drafts import ngram_drafts, parse_speculative


def lookup_oracle(tokens: list[int], k: int, max_ngram: int = 3) -> list[int | None]:
    """The prompt-lookup rule, one row at a time: the longest n-gram (n <= max_ngram) ending
    the context that occurred earlier, its latest occurrence, the k tokens after it; all zeros
    when nothing matches. ``None`` where the k tokens run past the context: nothing followed
    there, so any draft is as good (verification checks each draft against the trace)."""
    length = len(tokens)
    for n in range(max_ngram, 0, -1):
        if length <= n:
            continue
        tail = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == tail]
        if starts:
            follow = starts[-1] + n
            return [tokens[i] if i < length else None for i in range(follow, follow + k)]
    return [0] * k


def test_parse_speculative_defaults_and_normalizes():
    """None stays None; a dict becomes (method, k) with method "trace" and k = 4 by default."""
    assert parse_speculative(None) is None
    assert parse_speculative({}) == ("trace", 4)
    assert parse_speculative({"method": "ngram", "num_tokens": 2}) == ("ngram", 2)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("trace", TypeError, "must be a dict"),
        ({"method": "eagle"}, ValueError, "method must be one of"),
        ({"num_tokens": 0}, ValueError, "positive integer"),
        ({"num_tokens": True}, ValueError, "positive integer"),
        ({"k": 3}, ValueError, r"unknown keys \['k'\]"),
    ],
)
def test_parse_speculative_names_the_problem(bad, error, message):
    """A malformed setting is refused before any model work, saying what is wrong."""
    with pytest.raises(error, match=message):
        parse_speculative(bad)


def test_repeated_ngram_proposes_what_followed_it():
    """After "... 5 6 7 8 ... 5 6", the drafts are what followed "5 6" before: 7 8."""
    context = torch.tensor([[1, 5, 6, 7, 8, 2, 5, 6]])
    assert ngram_drafts(context, torch.tensor([8]), k=2).tolist() == [[7, 8]]


def test_no_earlier_occurrence_proposes_zeros():
    """A context whose last token never occurred before proposes 0s, which verify rejects."""
    context = torch.tensor([[1, 2, 3, 4]])
    assert ngram_drafts(context, torch.tensor([4]), k=3).tolist() == [[0, 0, 0]]


def test_entries_past_context_len_are_ignored():
    """Padding past a row's committed tokens is never matched nor proposed."""
    padded = torch.tensor([[3, 4, 3, 9, 9, 9]])
    assert ngram_drafts(padded, torch.tensor([3]), k=3).tolist() == [[4, 3, 0]]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
    k=st.integers(1, 4),
)
def test_matches_the_row_by_row_rule(rows, k):
    """Vectorized over rows of different lengths, each row gets what the one-row rule gives."""
    width = max(len(row) for row in rows)
    context = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    drafts = ngram_drafts(context, torch.tensor([len(row) for row in rows]), k=k)
    for row, got in zip(rows, drafts.tolist()):
        expected = lookup_oracle(row, k)
        assert [g for g, e in zip(got, expected) if e is not None] == [
            e for e in expected if e is not None
        ], (row, got, expected)
