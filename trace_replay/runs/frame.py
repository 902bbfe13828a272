"""The replay DataFrame: one tidy row per (trace, step), made from one engine call's results
once they pass the check.

Every replay loop (:func:`trace_replay.runs.replay`'s, a cluster actor's) scores a group of
requests through :func:`run_checked`, so each engine result passes the same check
(:func:`~trace_replay.engines.validate.check_results`) before it is stored or returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from trace_replay.engines.base import BatchFailed, Engine, ReplayRequest, TraceResult
from trace_replay.engines.validate import ImpossibleResult, check_results
from trace_replay.traces.sets import Trace

__all__ = ["COLUMNS", "REQUIRED", "TokenDecoder", "check_frame", "possible", "run_checked",
           "to_frame"]

COLUMNS = ["trace_id", "step", "position", "token_id", "token", "logprob", "rank",
           "top_token_ids", "top_logprobs", "top_tokens", "entropy"]
# what every reader of a replay frame needs (analysis, report, merge); the rest is optional
REQUIRED = ("trace_id", "step", "token_id", "logprob", "rank")


def check_frame(df: pd.DataFrame, name: str) -> None:
    """Refuse a frame lacking :data:`REQUIRED` or holding a (trace, step) twice; the error
    starts with ``name``."""
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{name} lacks replay columns {missing}")
    dup = df.duplicated(["trace_id", "step"])
    if dup.any():
        row = df[dup].iloc[0]  # by position: the index may repeat (a concat)
        raise ValueError(f"{name} has duplicate rows for trace {row.trace_id!r} step {row.step}")


class TokenDecoder:
    """Decode single token ids to text, memoized (datasets repeat tokens a lot)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([int(token_id)])
        return text


def to_frame(results: Sequence[TraceResult], traces: Mapping[str, Trace],
             decode: TokenDecoder, *, labelled: bool | None = None) -> pd.DataFrame:
    """Build the replay frame for ``results``; ``ref_logprob`` is added when a trace has one.

    When any of ``traces`` is a tokenized chat trace (or ``labelled`` says so, for rows of
    a run whose chat traces are elsewhere), every row also gets its ``turn`` (index of the
    message, nullable Int64) and ``role`` (that message's role, or ``"template"``); rows of
    other traces get nulls there. An engine's per-step ``extra`` arrays become columns of
    their own, after ``entropy``.
    """
    if labelled is None:
        labelled = any(trace.trace_roles is not None for trace in traces.values())
    parts = []
    for result in results:
        steps = len(result.token_ids)
        part = {
            "trace_id": [result.trace_id] * steps,
            "step": np.arange(steps, dtype=np.int64),
            "position": result.prompt_len + np.arange(steps, dtype=np.int64),
            "token_id": result.token_ids.astype(np.int64),
            "token": [decode(t) for t in result.token_ids],
            "logprob": result.logprob.astype(np.float64),
            "rank": result.rank.astype(np.int64),
            "top_token_ids": [row.astype(np.int64).tolist() for row in result.top_token_ids],
            "top_logprobs": [row.astype(np.float64).tolist() for row in result.top_logprobs],
            "top_tokens": [[decode(t) for t in row] for row in result.top_token_ids],
            "entropy": result.entropy.astype(np.float64),
            **result.extra,  # engine-specific columns, e.g. the server engine's rank_exact
        }
        ref = traces[result.trace_id].ref_logprobs
        part["ref_logprob"] = (np.asarray(ref, dtype=np.float64)[:steps] if ref is not None
                               else np.full(steps, np.nan))
        if labelled:
            trace = traces[result.trace_id]
            part["turn"] = pd.array(trace.trace_turns[:steps] if trace.trace_turns
                                    else [None] * steps, dtype="Int64")
            part["role"] = list(trace.trace_roles[:steps]) if trace.trace_roles else [None] * steps
        parts.append(pd.DataFrame(part))
    if not parts:
        labels = ["turn", "role"] if labelled else []
        return pd.DataFrame({c: pd.Series(dtype=object)
                             for c in COLUMNS + ["ref_logprob"] + labels})
    return pd.concat(parts, ignore_index=True)


def possible(requests: Sequence[ReplayRequest], results: Sequence[TraceResult],
             limits: Mapping[str, Any]) -> list[TraceResult]:
    """Those of ``results`` (one per request, in order) that pass ``check_results``; none
    when their count is not the requests'."""
    if len(results) != len(requests):
        return []
    kept = []
    for request, result in zip(requests, results):
        try:
            check_results([request], [result], **limits)
        except ImpossibleResult:
            continue
        kept.append(result)
    return kept


def run_checked(engine: Engine, group: Sequence[ReplayRequest], traces: Mapping[str, Trace],
                decode: TokenDecoder, *, limits: Mapping[str, Any],
                on_tokens: Callable[[int], None] | None = None,
                keep: Callable[[pd.DataFrame], None] | None = None,
                labelled: bool | None = None) -> pd.DataFrame:
    """The checked rows of ``group``, scored by one ``engine.run`` call.

    Parameters
    ----------
    engine, group
        The engine and the requests it scores, in order.
    traces
        The tokenized traces by id, whose ``ROW_FIELDS`` the rows copy.
    decode
        Token ids to texts (the engine's tokenizer).
    limits
        ``top_k`` and ``vocab_size`` for :func:`~trace_replay.engines.validate.check_results`.
    on_tokens
        Passed to ``engine.run`` (progress).
    keep
        On an impossible result or a failed request, gets the rows of the group's finished,
        possible traces before the error is raised, so a failed call loses no finished trace.
    labelled
        Whether the rows get ``turn`` and ``role`` columns (``None``: when a trace of
        ``traces`` is a chat trace), as :func:`~trace_replay.runs.frame.to_frame`.

    Raises
    ------
    ImpossibleResult
        Naming the trace, step and field of the first impossible score.
    """
    def keep_possible(done: list[ReplayRequest], results: list) -> None:
        kept = possible(done, results, limits)
        if keep is not None and kept:
            keep(to_frame(kept, traces, decode, labelled=labelled))

    try:
        results = engine.run(group, on_tokens=on_tokens)
    except BatchFailed as failed:  # some requests failed; keep those that finished
        done = [(r, res) for r, res in zip(group, failed.results) if res is not None]
        keep_possible([r for r, _ in done], [res for _, res in done])
        raise failed.error from None
    try:
        check_results(group, results, **limits)
    except ImpossibleResult:
        keep_possible(list(group), results)
        raise
    return to_frame(results, traces, decode, labelled=labelled)
