"""One engine call of a run: its results checked and made rows, or its possible ones kept.

Every replay loop (:func:`trace_replay.runs.replay`'s, a cluster actor's) scores a group of
requests through this one function, so each engine result passes the same check
(:func:`~trace_replay.engines.validate.check_results`) before it is stored or returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pandas as pd

from trace_replay.engines.base import BatchFailed, Engine, ReplayRequest, TraceResult
from trace_replay.engines.validate import ImpossibleResult, check_results
from trace_replay.runs.frame import TokenDecoder, to_frame
from trace_replay.traces.trace import Trace

__all__ = ["possible", "run_checked"]


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
