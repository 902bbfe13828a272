"""The replay DataFrame: one tidy row per (trace, step), made from one engine call's results
once they pass the check.

Every replay loop (:func:`trace_replay.runs.replay`'s, a cluster actor's) scores a group of
requests through :func:`run_checked`, so each engine result passes the same check
(:func:`~trace_replay.engines.validate.check_results`) before it is stored or returned.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from trace_replay.engines.base import BatchFailed, Engine, ReplayRequest, TraceResult
from trace_replay.engines.validate import ImpossibleResult, check_results
from trace_replay.traces.sets import Trace

__all__ = [
    "COLUMNS",
    "REQUIRED",
    "TokenDecoder",
    "check_frame",
    "possible",
    "run_checked",
    "to_frame",
    "tokens_digest",
]

COLUMNS = [
    "trace_id",
    "step",
    "position",
    "token_id",
    "token",
    "logprob",
    "rank",
    "top_token_ids",
    "top_logprobs",
    "top_tokens",
    "entropy",
    "tail_logmass",
]
# what every reader of a replay frame needs (analysis, report, merge); the rest is optional
REQUIRED = ("trace_id", "step", "token_id", "logprob", "rank")


def tokens_digest(
    prompt_token_ids: Sequence[int] | None, trace_token_ids: Sequence[int] | np.ndarray
) -> str | None:
    """A trace's ``tokens_digest``: 16 hex digits of a SHA-256 of its prompt and trace token
    ids (``None`` without prompt ids). Two runs' rows of one trace id are compared only
    where it is equal (:mod:`trace_replay.analysis.same_traces`).

    Examples
    --------
    >>> tokens_digest([1, 2], [3]) == tokens_digest((1, 2), (3,)) != tokens_digest([1], [2, 3])
    True
    """
    if prompt_token_ids is None:
        return None
    digest = hashlib.sha256()
    for ids in (prompt_token_ids, trace_token_ids):
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(np.asarray(ids, dtype="<i8").tobytes())
    return digest.hexdigest()[:16]


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


_SPLIT = "\ufffd"  # what a decode gives for the bytes of a character it does not finish


class TokenDecoder:
    """Decode token ids to text, memoized (datasets repeat tokens a lot): each id is decoded
    once, into a table indexed by id, so an array of ids is looked up without a loop.

    :meth:`completed` gives a trace's tokens the text each one completes, so the texts of a
    trace's rows join back into the trace's decoded text (a character whose bytes several
    tokens share belongs to the token holding its last byte).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._texts = np.empty(0, dtype=object)  # id -> its lone decode
        self._split = np.zeros(0, dtype=bool)  # id -> that decode holds U+FFFD
        self._known = np.zeros(0, dtype=bool)
        self._runs: dict[tuple, list] = {}  # (token before, split tokens) -> their texts

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([int(token_id)])
        return text

    def _table(self, token_ids: np.ndarray) -> None:
        """Decode the ids of ``token_ids`` (>= 0) not in the table yet."""
        size = int(token_ids.max()) + 1
        if size > len(self._known):
            grow = size - len(self._known)
            self._texts = np.concatenate([self._texts, np.empty(grow, dtype=object)])
            self._split = np.concatenate([self._split, np.zeros(grow, dtype=bool)])
            self._known = np.concatenate([self._known, np.zeros(grow, dtype=bool)])
        new = np.unique(token_ids[~self._known[token_ids]])
        for token_id in new.tolist():
            self._texts[token_id] = text = self(token_id)
            self._split[token_id] = _SPLIT in text
        self._known[new] = True

    def many(self, token_ids: np.ndarray) -> np.ndarray:
        """The lone decode of each id of an array (any shape), as an object array of that
        shape; each distinct id is decoded once."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if token_ids.size == 0 or token_ids.min() < 0:  # no table row (checked ids never)
            texts = np.empty(token_ids.shape, dtype=object)
            texts.reshape(-1)[:] = [self(t) for t in token_ids.reshape(-1).tolist()]
            return texts
        self._table(token_ids)
        return self._texts[token_ids]

    def completed(self, token_ids: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Per token, the text it completes, for traces of ``steps`` tokens each, laid end to
        end in ``token_ids``.

        A token decoded alone gives U+FFFD for bytes of a character it does not finish (a
        multi-byte character split across tokens): such a token gets the characters its
        bytes finish (maybe none, ``""``), and the token holding a character's last byte
        gets the whole character, so ``"".join`` of a trace's texts is the trace decoded at
        once. A trace that ends inside a character keeps U+FFFD on its last token, as the
        decode of the whole trace does. Only runs of tokens whose lone decode holds U+FFFD
        are decoded again, after the token before them, once per distinct run.
        """
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        texts = self.many(token_ids)
        if token_ids.size == 0 or token_ids.min() < 0:
            return texts
        rows = np.flatnonzero(self._split[token_ids])
        if not rows.size:
            return texts
        ends = np.cumsum(steps)
        trace = np.searchsorted(ends, rows, side="right")
        # runs of split tokens: consecutive rows of one trace, [first, last)
        cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(trace) != 0)) + 1
        firsts, lasts = rows[np.r_[0, cut]], rows[np.r_[cut - 1, len(rows) - 1]] + 1
        starts = (ends - steps)[trace[np.r_[0, cut]]]
        ids = token_ids.tolist()
        for first, last, start in zip(firsts.tolist(), lasts.tolist(), starts.tolist()):
            key = (ids[first - 1] if first > start else None, tuple(ids[first:last]))
            got = self._runs.get(key)
            if got is None:
                got = self._runs[key] = self._complete(*key)
            texts[first:last] = got
        return texts

    def _complete(self, before: int | None, run: tuple[int, ...]) -> list[str]:
        """The texts of ``run``, split tokens of one trace (after the token ``before``, if
        any), each the text it completes."""
        # decoded after the token before them, which keeps a tokenizer's own spacing at a
        # start; its text is cut off again
        texts = [self(t) for t in run]
        context = [] if before is None else [before]
        pending, done = [], ""  # done: the text given to the pending tokens so far
        for at, token_id in enumerate(run):
            pending.append(token_id)
            prefix = self(context[0]) if context else ""
            full = self.tokenizer.decode(context + pending)
            if not full.startswith(prefix):  # no common text to cut: the lone decode stays
                context, pending, done = pending[-1:], [], ""
                continue
            text = full[len(prefix) :]
            complete = text if at == len(run) - 1 else text.rstrip(_SPLIT)
            if complete.startswith(done):
                texts[at] = complete[len(done) :]
            done = complete
            if complete == text:  # a character boundary: go on from this token
                context, pending, done = pending[-1:], [], ""
        return texts


def to_frame(
    results: Sequence[TraceResult],
    traces: Mapping[str, Trace],
    decode: TokenDecoder,
    *,
    labelled: bool | None = None,
) -> pd.DataFrame:
    """Build the replay frame for ``results``; ``ref_logprob`` is added when a trace has one.

    Rows are the results' steps in order, one per (trace, step). When any of ``traces`` is
    a tokenized chat trace (or ``labelled`` says so, for rows of a run whose chat traces are
    elsewhere), every row also gets its ``turn`` (index of the message, nullable Int64) and
    ``role`` (that message's role, or ``"template"``); rows of other traces get nulls there.
    An engine's per-step ``extra`` arrays become columns of their own, after ``entropy``
    (null on the rows of a result without one). The last column, ``tokens_digest``, is
    each trace's :func:`tokens_digest` (its prompt ids and the token ids of its rows), by
    which comparisons pair two runs' traces. The columns are built for all results at
    once (one array per column, not one frame per trace): this runs after every engine
    call, on the host, while the device waits.

    Raises
    ------
    ValueError
        When a result's ``extra`` array or its trace's ``ref_logprobs`` is shorter than
        its steps (the engine result itself is checked before, by ``check_results``).
    """
    if labelled is None:
        labelled = any(trace.trace_roles is not None for trace in traces.values())
    if not results:
        labels = ["turn", "role"] if labelled else []
        return pd.DataFrame(
            {
                c: pd.Series(dtype=object)
                for c in COLUMNS + ["ref_logprob"] + labels + ["tokens_digest"]
            }
        )
    steps = np.array([len(r.token_ids) for r in results], dtype=np.int64)
    starts = np.cumsum(steps) - steps
    step = np.arange(steps.sum(), dtype=np.int64) - np.repeat(starts, steps)
    prompt_len = np.array([r.prompt_len for r in results], dtype=np.int64)
    token_ids = _joined(r.token_ids for r in results).astype(np.int64)
    top_token_ids, top_logprobs, top_tokens = [], [], []
    texts = decode.many(_joined(r.top_token_ids for r in results))
    at = 0
    for r in results:  # a list per row; ragged widths stay as they came (check_rows names them)
        top_token_ids += r.top_token_ids.astype(np.int64).tolist()
        top_logprobs += r.top_logprobs.astype(np.float64).tolist()
        top_tokens += texts[at : at + r.top_token_ids.size].reshape(r.top_token_ids.shape).tolist()
        at += r.top_token_ids.size
    columns = {
        "trace_id": np.repeat(
            np.array([r.trace_id for r in results], dtype=object), steps
        ).tolist(),
        "step": step,
        "position": np.repeat(prompt_len, steps) + step,
        "token_id": token_ids,
        "token": decode.completed(token_ids, steps).tolist(),
        "logprob": _joined(r.logprob for r in results).astype(np.float64),
        "rank": _joined(r.rank for r in results).astype(np.int64),
        "top_token_ids": top_token_ids,
        "top_logprobs": top_logprobs,
        "top_tokens": top_tokens,
        "entropy": _joined(r.entropy for r in results).astype(np.float64),
        # NaN for an engine that records no tail (and in files written before it existed)
        "tail_logmass": _per_step(
            results, steps, "tail_logmass", lambda r: r.tail_logmass, fill=np.nan
        ).astype(np.float64),
    }
    for name in dict.fromkeys(k for r in results for k in r.extra):
        columns[name] = _per_step(results, steps, name, functools.partial(_extra, name=name))
    columns["ref_logprob"] = _per_step(
        results, steps, "ref_logprob", lambda r: traces[r.trace_id].ref_logprobs, fill=np.nan
    ).astype(np.float64)
    if labelled:
        columns["turn"] = pd.array(
            _per_step(results, steps, "turn", lambda r: traces[r.trace_id].trace_turns),
            dtype="Int64",
        )
        roles = _per_step(results, steps, "role", lambda r: traces[r.trace_id].trace_roles)
        # text when every row has a role, else objects with None (as a frame per trace gave)
        unlabelled = any(not traces[r.trace_id].trace_roles for r in results)
        columns["role"] = pd.Series(roles, dtype=object) if unlabelled else roles.tolist()
    digests = [tokens_digest(traces[r.trace_id].prompt_token_ids, r.token_ids) for r in results]
    columns["tokens_digest"] = np.repeat(np.array(digests, dtype=object), steps).tolist()
    return pd.DataFrame(columns)


def _joined(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def _extra(result: TraceResult, name: str) -> Any:
    """``result``'s extra column ``name`` (None where it has none)."""
    return result.extra.get(name)


def _per_step(
    results: Sequence[TraceResult],
    steps: np.ndarray,
    name: str,
    values: Callable[[TraceResult], Any],
    fill: Any = None,
) -> np.ndarray:
    """One column from each result's per-step ``values`` (cut to its steps; ``None``: all
    ``fill``)."""
    chunks = []
    for result, count in zip(results, steps.tolist()):
        got = values(result)
        if got is None or (len(got) == 0 and count):
            chunks.append(np.full(count, fill, dtype=object if fill is None else None))
            continue
        got = np.asarray(got)[:count]
        if len(got) != count:
            raise ValueError(
                f"trace {result.trace_id!r}: {name} has {len(got)} values for its {count} steps"
            )
        chunks.append(got)
    if all(chunk.dtype != object for chunk in chunks):
        return np.concatenate(chunks)
    return np.concatenate([chunk.astype(object) for chunk in chunks])


def possible(
    requests: Sequence[ReplayRequest], results: Sequence[TraceResult], limits: Mapping[str, Any]
) -> list[TraceResult]:
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


def run_checked(
    engine: Engine,
    group: Sequence[ReplayRequest],
    traces: Mapping[str, Trace],
    decode: TokenDecoder,
    *,
    limits: Mapping[str, Any],
    on_tokens: Callable[[int], None] | None = None,
    keep: Callable[[pd.DataFrame], None] | None = None,
    labelled: bool | None = None,
) -> pd.DataFrame:
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
