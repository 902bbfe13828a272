"""The one definition of an impossible score, which every engine result must pass.

:func:`trace_replay.runs.replay` checks each batch an engine returns (:func:`check_results`)
before anything is stored or returned, whatever the engine; a checkpoint part's rows are
checked again by the same rules when read back (:mod:`trace_replay.runs.parts`).

A possible score: ``logprob`` is not NaN and at most 0 (``-inf`` is probability 0, which a
server writes as -9999.0); ``rank`` is an integer from 1 to the vocabulary size ``V``; the
rank agrees with the logprob: ``r`` tokens (the token and the ``r - 1`` ranked above it, ties
either way) are at least as likely, so ``r * p <= 1``, that is ``logprob <= -log(r)``, and the
most likely of ``V`` tokens has ``p >= 1/V``, so rank 1 has ``logprob >= -log(V)`` (never
``-inf``, whatever ``V``); the top-k logprobs are not NaN, at most 0 and in descending order,
the first one (the most likely token's) at least ``-log(V)``; the rank agrees with them (rank
``r <= k``: the r-th listed logprob is the token's own, ties included; ``r > k``: every
listed one is at least the token's); a listed token has its own logprob there; the top-k
probabilities (with the token's when it is ranked past them) sum to at most 1; the top-k token
ids are distinct ids of the vocabulary; ``entropy`` is NaN (not computed) or from 0 to the
log of the vocabulary size; ``tail_logmass`` (the log of the mass outside the top-k) is NaN
(not recorded) or at most 0, and the top-k probabilities plus the tail's sum to 1 within
:data:`TAIL_ROUNDING`.
Comparisons allow :data:`ROUNDING` relative to ``max(1, |logprob|)`` (an infinite or NaN
logprob counting as 0).

Every logprob an engine is told, not only those a result keeps, obeys the first rule
(:func:`not_logprobs`): a server's answer listing 20 alternatives, of which a result keeps
the top-k, is impossible when any of the 20 is NaN or positive.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike

from trace_replay.engines.base import ReplayRequest, TraceResult

__all__ = [
    "ROUNDING",
    "TAIL_ROUNDING",
    "ImpossibleResult",
    "check_results",
    "impossible",
    "not_logprobs",
    "LOGPROB_RULE",
]

# float32 log-softmax rounds at ~1e-7 relative; the CUDA scorer's top-k logprobs (the token's
# logprob plus a logit difference) at a few times that. 1e-5 is far above both and far below
# any real disagreement, so a logprob may exceed 0 by 1e-5 at most.
ROUNDING = 1e-5
LOGPROB_RULE = "a logprob is a number <= 0"
# top-k probabilities + tail mass = 1: each is float32-rounded (a few 1e-7 each); a server's
# tail is 1 - sum(top) itself. 1e-4 is far above rounding, far below a tail that is wrong.
TAIL_ROUNDING = 1e-4


class ImpossibleResult(RuntimeError):
    """An engine returned a score no distribution gives; names the trace, step and field."""

    def __init__(
        self,
        message: str,
        *,
        trace_id: str | None,
        step: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.trace_id, self.step, self.field = trace_id, step, field

    def __reduce__(self) -> tuple:
        # the keyword-only fields go along, so the error survives pickling (a cluster actor's
        # error reaches the driver as it was raised)
        return (
            functools.partial(type(self), trace_id=self.trace_id, step=self.step, field=self.field),
            self.args,
        )


def not_logprobs(values: ArrayLike, slack: np.ndarray | float = ROUNDING) -> np.ndarray:
    """Where ``values`` cannot be logprobs: NaN, or above 0 by more than ``slack`` (by
    default :data:`ROUNDING`, the slack of a logprob near 0); ``-inf`` is probability 0."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.isnan(values) | (values > slack)


def impossible(
    logprob: np.ndarray,
    rank: np.ndarray,
    top_logprobs: np.ndarray,
    entropy: np.ndarray,
    *,
    vocab_size: int | None = None,
    token_ids: np.ndarray | None = None,
    top_token_ids: np.ndarray | None = None,
    tail_logmass: np.ndarray | None = None,
) -> list[tuple[str, str, np.ndarray]]:
    """The rules of a possible score, each as ``(field, problem, rows breaking it)``.

    Parameters
    ----------
    logprob, rank, entropy
        ``[N]`` arrays, one entry per scored step.
    top_logprobs
        ``[N, k]``, best first.
    vocab_size
        Bound of ``rank`` and of the top-k token ids (``None``: not checked).
    token_ids, top_token_ids
        ``[N]`` and ``[N, k]``: the scored tokens and the listed ones (``None``: the rules
        about ids are not checked).
    tail_logmass
        ``[N]``: log of the mass outside the top-k, NaN where not recorded (``None``: not
        checked).

    Returns
    -------
    list of (str, str, numpy.ndarray)
        The field a rule is about, the rule in words, and a boolean ``[N]`` mask of the rows
        breaking it.
    """
    logprob = np.asarray(logprob, dtype=np.float64)
    rank = np.asarray(rank)
    top = np.asarray(top_logprobs, dtype=np.float64).reshape(len(logprob), -1)
    entropy = np.asarray(entropy, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # -inf - -inf: NaN compares False
        # a NaN or -inf logprob gets the slack of 0, so it cannot excuse its other fields
        slack = ROUNDING * np.maximum(1.0, np.where(np.isfinite(logprob), np.abs(logprob), 0))
        whole = np.isfinite(rank) & (rank == np.round(rank))
        past_first = whole & (rank > 1)
        highest = np.inf if vocab_size is None else vocab_size
        bound = "" if vocab_size is None else f" and <= the vocabulary size {vocab_size}"
        floor = (
            ""
            if vocab_size is None
            else f" and >= -log(vocabulary size {vocab_size}) = {-np.log(vocab_size):.4f}"
        )
        rules = [
            ("logprob", LOGPROB_RULE, not_logprobs(logprob, slack)),
            ("rank", f"a rank is an integer >= 1{bound}", ~whole | (rank < 1) | (rank > highest)),
            # r tokens are at least as likely as the token (ranks counting ties either way):
            # r * p <= 1; rank 1 says no more than the logprob rule
            (
                "rank",
                "a token at rank r has logprob <= -log(r) (r tokens at least as likely "
                "cannot all have probability above 1/r)",
                past_first
                & (logprob > slack - np.log(np.where(past_first, rank, 1).astype(np.float64))),
            ),
            # the most likely of V tokens has p >= 1/V; with V unknown, still p > 0
            (
                "rank",
                f"rank 1 is the most likely token: its logprob is finite{floor}",
                (rank == 1) & _below_floor(logprob, slack, highest),
            ),
            # the uniform distribution's log V is the most; without V, any finite value
            (
                "entropy",
                "an entropy is >= 0 and at most log(vocabulary size), finite (NaN: not computed)",
                (entropy < -ROUNDING)
                | np.isposinf(entropy)
                | (entropy > np.log(highest) * (1 + ROUNDING)),
            ),
        ]
        if top.shape[1]:
            k = top.shape[1]
            rules.append(
                (
                    "top_logprobs",
                    "top-k logprobs are numbers <= 0",
                    not_logprobs(top, slack[:, None]).any(axis=1),
                )
            )
            rules.append(
                (
                    "top_logprobs",
                    "top-k logprobs are in descending order",
                    (np.diff(top, axis=1) > slack[:, None]).any(axis=1),
                )
            )
            first = top[:, 0]
            rules.append(
                (
                    "top_logprobs",
                    f"the first top-k logprob is the most likely token's: finite{floor}",
                    _below_floor(
                        first,
                        ROUNDING * np.maximum(1.0, np.where(np.isfinite(first), np.abs(first), 0)),
                        highest,
                    ),
                )
            )
            within = whole & (rank >= 1) & (rank <= k)
            at_rank = top[np.arange(len(top)), np.clip(np.nan_to_num(rank), 1, k).astype(int) - 1]
            # rank r <= k: r - 1 listed logprobs are greater (or tied), so the r-th is the token's
            rules.append(
                (
                    "rank",
                    "a rank agrees with the top-k logprobs (rank r <= k: the r-th "
                    "is the token's logprob; r > k: each is at least the token's)",
                    (within & (np.abs(at_rank - logprob) > slack))
                    | (~within & (rank > k) & (top[:, -1] < logprob - slack)),
                )
            )
            listed = (
                np.zeros(top.shape, dtype=bool)
                if token_ids is None or top_token_ids is None
                else np.asarray(top_token_ids).reshape(top.shape)
                == np.asarray(token_ids).reshape(-1, 1)
            )
            rules.append(
                (
                    "top_logprobs",
                    "a token listed among the top-k has its own logprob there",
                    (listed & (np.abs(top - logprob[:, None]) > slack[:, None])).any(axis=1),
                )
            )
            # the token's own probability counts once: listed, or ranked past the list; each of
            # the k listed logprobs may be off by its slack, so the sum by k of them
            own = np.where((rank > k) & ~listed.any(axis=1), np.nan_to_num(np.exp(logprob)), 0)
            mass = np.nansum(np.exp(top), axis=1) + own
            rules.append(
                (
                    "top_logprobs",
                    "the probabilities of the top-k (and of the token "
                    "when ranked past them) sum to at most 1",
                    mass > 1 + k * slack,
                )
            )
        if tail_logmass is not None:
            tail = np.asarray(tail_logmass, dtype=np.float64).reshape(-1)
            known = ~np.isnan(tail)
            rules.append(
                (
                    "tail_logmass",
                    "a tail mass is a probability: its log is <= 0 (NaN: not recorded)",
                    known & (tail > ROUNDING),
                )
            )
            whole = np.nansum(np.exp(top), axis=1) + np.exp(np.where(known, tail, 0))
            rules.append(
                (
                    "tail_logmass",
                    "the top-k probabilities and the tail mass outside "
                    f"them sum to 1 (within {TAIL_ROUNDING})",
                    known & (np.abs(whole - 1) > TAIL_ROUNDING + top.shape[1] * slack),
                )
            )
        if top_token_ids is not None and top.shape[1]:
            ids = np.asarray(top_token_ids, dtype=np.float64).reshape(top.shape)
            ordered = np.sort(ids, axis=1)  # NaN last
            below = "" if vocab_size is None else f" and < the vocabulary size {vocab_size}"
            rules.append(
                (
                    "top_token_ids",
                    f"top-k token ids are distinct integers >= 0{below}",
                    ~(np.isfinite(ids) & (ids == np.round(ids))).all(axis=1)
                    | (ordered[:, 0] < 0)
                    | (ordered[:, -1] >= highest)
                    | (np.diff(ordered, axis=1) == 0).any(axis=1),
                )
            )
    return rules


def _below_floor(logprob: np.ndarray, slack: np.ndarray, vocab_size: float) -> np.ndarray:
    """Where ``logprob`` is below what the most likely of ``vocab_size`` tokens has:
    ``-log(vocab_size)`` less ``slack``, or ``-inf`` (NaN is left to the other rules)."""
    return np.isneginf(logprob) | (logprob < -np.log(vocab_size) - slack)


def check_results(
    requests: Sequence[ReplayRequest],
    results: Sequence[TraceResult],
    *,
    top_k: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Raise :class:`ImpossibleResult` unless ``results`` are possible scores of ``requests``.

    One result per request, in order, with the request's prompt length, one step per trace
    token (its own tokens), top-k lists of ``top_k`` entries (``None``: not checked), and
    every step passing :func:`impossible`. The error names the trace, the step, the field
    and the value.
    """
    if len(results) != len(requests):
        first = requests[0].trace_id if requests else None
        raise ImpossibleResult(
            f"the engine returned {len(results)} results for "
            f"{len(requests)} traces (the first {first!r})",
            trace_id=first,
        )
    for request, result in zip(requests, results):
        _check_shape(request, result, top_k)
    if _all_possible(results, vocab_size):
        return
    for result in results:  # find and name the first impossible step
        _check_scores(result, vocab_size)


def _all_possible(results: Sequence[TraceResult], vocab_size: int | None) -> bool:
    """Whether every step of ``results`` passes :func:`impossible`, checked on all steps at
    once (its rules are per step; results of one top-k width, else ``False``)."""
    widths = {(np.shape(r.top_logprobs)[1:], np.shape(r.top_token_ids)[1:]) for r in results}
    if len(widths) != 1 or len(set(widths.pop())) != 1:
        return False
    joined = replace(
        results[0],
        **{
            field: np.concatenate([np.asarray(getattr(r, field)) for r in results])
            for field in (
                "logprob",
                "rank",
                "top_logprobs",
                "entropy",
                "token_ids",
                "top_token_ids",
            )
        },
        tail_logmass=_tails(results),
    )
    return not any(rows.any() for _, _, rows in _rules(joined, vocab_size))


def _rules(result: TraceResult, vocab_size: int | None) -> list[tuple[str, str, np.ndarray]]:
    """:func:`impossible`'s rules over the steps of ``result``."""
    return impossible(
        result.logprob,
        result.rank,
        result.top_logprobs,
        result.entropy,
        vocab_size=vocab_size,
        token_ids=result.token_ids,
        top_token_ids=result.top_token_ids,
        tail_logmass=result.tail_logmass,
    )


def _tails(results: Sequence[TraceResult]) -> np.ndarray | None:
    """The results' tail masses joined, NaN for a result without; None when none has one."""
    if all(r.tail_logmass is None for r in results):
        return None
    return np.concatenate(
        [
            np.full(len(r.logprob), np.nan)
            if r.tail_logmass is None
            else np.asarray(r.tail_logmass, dtype=np.float64)
            for r in results
        ]
    )


def _check_scores(result: TraceResult, vocab_size: int | None) -> None:
    """Raise at the first rule of :func:`impossible` that a step of ``result`` breaks."""
    rules = _rules(result, vocab_size)
    values: dict[str, np.ndarray | None] = {
        "logprob": result.logprob,
        "rank": result.rank,
        "top_logprobs": result.top_logprobs,
        "entropy": result.entropy,
        "top_token_ids": result.top_token_ids,
        "tail_logmass": result.tail_logmass,
    }
    for field, rule, rows in rules:
        if rows.any():
            step = int(np.argmax(rows))
            value = values[field]
            assert value is not None  # a field not recorded breaks no rule
            shown = f"{field} = {_show(value[step])}"
            if field == "rank":  # a rank is possible or not beside its logprob (and top-k)
                shown += f" with logprob {_show(result.logprob[step])}"
                if "top-k" in rule:
                    shown += f" and top_logprobs {_show(result.top_logprobs[step])}"
            if field == "tail_logmass":
                shown += f" with top_logprobs {_show(result.top_logprobs[step])}"
            raise ImpossibleResult(
                f"trace {result.trace_id!r}, step {step}: the engine "
                f"returned {shown}, which is impossible: {rule}",
                trace_id=result.trace_id,
                step=step,
                field=field,
            )


def _check_shape(request: ReplayRequest, result: TraceResult, top_k: int | None) -> None:
    """The request's prompt length, one step per trace token, the trace's own tokens,
    ``[T, top_k]`` top-k arrays."""
    steps = request.trace_len
    if result.trace_id != request.trace_id:
        raise ImpossibleResult(
            f"trace {request.trace_id!r}: the engine returned trace "
            f"{result.trace_id!r} in its place",
            trace_id=request.trace_id,
        )
    if result.prompt_len != request.prompt_len:
        raise ImpossibleResult(
            f"trace {request.trace_id!r}: the engine returned prompt_len "
            f"{result.prompt_len} for a prompt of {request.prompt_len} "
            "tokens (positions would be off)",
            trace_id=request.trace_id,
            field="prompt_len",
        )
    for field in (
        "token_ids",
        "logprob",
        "rank",
        "top_token_ids",
        "top_logprobs",
        "entropy",
        "tail_logmass",
    ):
        if getattr(result, field) is None:  # only tail_logmass may be absent
            continue
        got = len(getattr(result, field))
        if got != steps:
            raise ImpossibleResult(
                f"trace {request.trace_id!r}: the engine returned {got} "
                f"{field} for a trace of {steps} tokens",
                trace_id=request.trace_id,
                field=field,
            )
    if not np.array_equal(result.token_ids, request.trace_token_ids):
        step = int(np.argmax(np.asarray(result.token_ids) != request.trace_token_ids))
        raise ImpossibleResult(
            f"trace {request.trace_id!r}, step {step}: the engine scored "
            f"token {result.token_ids[step]} where the trace has "
            f"{request.trace_token_ids[step]}",
            trace_id=request.trace_id,
            step=step,
            field="token_ids",
        )
    for field in ("top_token_ids", "top_logprobs"):
        width = np.shape(getattr(result, field))[1:]
        if top_k is not None and width != (top_k,):
            raise ImpossibleResult(
                f"trace {request.trace_id!r}: the engine returned {field} "
                f"of shape {np.shape(getattr(result, field))} for top_k "
                f"{top_k}",
                trace_id=request.trace_id,
                field=field,
            )


def _show(value: object) -> str:
    """A value as a short readable text (arrays as lists)."""
    return repr(np.asarray(value).tolist())
