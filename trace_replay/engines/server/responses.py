"""From a vLLM server's JSON answers to per-step arrays (logprob, rank, top-k).

Every logprob of an answer is checked by the rule of a possible one
(:func:`~trace_replay.engines.validate.not_logprobs`), the alternatives a result does not
keep too: one that is NaN or positive is an
:class:`~trace_replay.engines.validate.ImpossibleResult` naming the step and the value (the
engine adds the trace). A NaN among 20 alternatives made the ones beside it rank as if
it were not there, and the rank exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from trace_replay.engines.validate import LOGPROB_RULE, ImpossibleResult, not_logprobs
from trace_replay.traces.trace import VLLM_NEG_INF

__all__ = [
    "RANK_DEPTH",
    "answer_bytes",
    "completion_steps",
    "emitted_ids",
    "generate_steps",
    "model_card",
]

RANK_DEPTH = 20  # alternatives asked of /v1/completions to count ranks in (vLLM's max_logprobs)
# what one answer may take: a fixed part, the prompt's ids echoed, and per trace token its
# own entry and each alternative's (several times what vLLM sends: ~45 bytes an alternative)
ANSWER_BASE_BYTES = 1 << 20
ANSWER_PROMPT_TOKEN_BYTES = 64
ANSWER_STEP_BYTES = 1024
ANSWER_ALTERNATIVE_BYTES = 256
# (logprob [T], rank [T], top_token_ids [T, k], top_logprobs [T, k], rank is exact [T])
Steps = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def answer_bytes(prompt_len: int, trace_len: int, alternatives: int) -> int:
    """The most bytes the answer to one trace may take: 1 MiB, 64 per prompt token, and per
    trace token 1 KiB plus 256 per alternative asked for. A 1,000-token trace with 20
    alternatives may take ~7 MiB; a server sending more is refused
    (:class:`~trace_replay.engines.server.http_client.ServerError`) before the rest is read.
    """
    per_step = ANSWER_STEP_BYTES + ANSWER_ALTERNATIVE_BYTES * max(alternatives, 0)
    return ANSWER_BASE_BYTES + ANSWER_PROMPT_TOKEN_BYTES * prompt_len + per_step * trace_len


def model_card(answer: object) -> dict:
    """The first model a ``/v1/models`` answer lists, checked: ``data`` a non-empty list of
    objects, the first with a non-empty text ``id``, and ``max_model_len`` (an integer >= 1)
    and ``root`` (text) where given. Anything else is a ValueError naming the field."""
    if not isinstance(answer, dict):
        raise ValueError(f"a {type(answer).__name__}, not an object with a data list")
    cards = answer.get("data")
    if not isinstance(cards, list):
        raise ValueError(f"data {_shown(cards)}, not a list of models")
    if not cards:
        raise ValueError("data [], no model")
    card = cards[0]
    if not isinstance(card, dict):
        raise ValueError(f"data[0] {_shown(card)}, not an object")
    if not isinstance(card.get("id"), str) or not card["id"]:
        raise ValueError(f"data[0].id {_shown(card.get('id'))}, not a model name")
    length = card.get("max_model_len")
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 1
    ):
        raise ValueError(f"data[0].max_model_len {_shown(length)}, not an integer >= 1")
    if card.get("root") is not None and not isinstance(card["root"], str):
        raise ValueError(f"data[0].root {_shown(card['root'])}, not a path or name")
    return card


def _shown(value: object) -> str:
    """``value`` for an error: its repr, cut at 60 characters; "missing" for None."""
    text = "missing" if value is None else f"= {value!r}"
    return text if len(text) <= 60 else text[:57] + "..."


def emitted_ids(choice: dict) -> list[int]:
    """The ids a choice emitted: ``token_ids``, else its ``token_id:N`` logprob tokens."""
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    tokens = (choice.get("logprobs") or {}).get("tokens") or ()
    try:
        return [int(t.removeprefix("token_id:")) for t in tokens]
    except ValueError:
        text = next(t for t in tokens if not t.removeprefix("token_id:").lstrip("-").isdigit())
        raise ValueError(
            f"logprobs.tokens holds text ({text!r}), not token_id:N: the server "
            "ignored return_tokens_as_token_ids"
        ) from None


def _logprob(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"logprob {value!r} is not a number")
    return -math.inf if value <= VLLM_NEG_INF else float(value)


def _possible(value: float, step: int, what: str, field: str) -> float:
    """``value``, a logprob of step ``step``; an ImpossibleResult naming ``what`` it is
    when no logprob can be it (NaN, positive)."""
    if not_logprobs(value):
        raise ImpossibleResult(
            f"step {step}: the server answered {what} = {value!r}, which is "
            f"impossible: {LOGPROB_RULE}",
            trace_id=None,
            step=step,
            field=field,
        )
    return value


def _rank(value: object, step: int) -> int:
    """A server's rank as an int; a fraction, NaN or non-number is an error naming the step."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise ValueError(f"step {step}: rank {value!r} is not an integer")
    return int(value)


def _listed(values: list, name: str, steps: int | None) -> list:
    """``values``, one per step: a list of another length is an error saying both counts."""
    if not isinstance(values, list):
        raise ValueError(f"{name} is {type(values).__name__}, not a list")
    if steps is not None and len(values) != steps:
        raise ValueError(
            f"{name} lists {len(values)} step{'s' * (len(values) != 1)} where "
            f"{steps} were expected (one per trace token)"
        )
    return values


def generate_steps(content: list[dict], top_k: int, steps: int | None = None) -> Steps:
    """Per-step arrays from /inference/v1/generate logprobs, which carry exact ranks.

    ``steps``: how many entries ``content`` must hold (the trace's length; ``None``: any).
    """
    steps = len(_listed(content, "logprobs.content", steps))
    logprob, rank = np.empty(steps), np.empty(steps, dtype=np.int64)
    top_ids = np.zeros((steps, top_k), dtype=np.int64)
    top_lps = np.full((steps, top_k), np.nan)
    for step, entry in enumerate(content):
        logprob[step] = _possible(_logprob(entry["logprob"]), step, "logprob", "logprob")
        rank[step] = _rank(entry["rank"], step)
        ordered = sorted(
            (
                _rank(alt["rank"], step),
                alt["token_id"],
                _possible(
                    _logprob(alt["logprob"]),
                    step,
                    f"alternative {alt['token_id']!r} logprob",
                    "top_logprobs",
                ),
            )
            for alt in entry["top_logprobs"]
            if alt.get("rank") is not None
        )
        for j, (_, token_id, value) in enumerate(ordered[:top_k]):
            top_ids[step, j], top_lps[step, j] = token_id, value
    return logprob, rank, top_ids, top_lps, np.ones(steps, dtype=bool)


def completion_steps(
    logprobs: dict, top_k: int, steps: int | None = None, *, token_ids: Sequence[int]
) -> Steps:
    """Per-step arrays from /v1/completions logprobs (``token_id:N`` keys, no ranks).

    Each step's map holds the server's ``n`` best alternatives (``n`` as asked, or fewer from a
    server that caps it) and the emitted token ``token_ids[step]``, added when it is not among
    them. Rank is 1 + the listed alternatives with a strictly greater logprob. It is exact
    when another listed token is at most as likely as the emitted one: that token is among the
    best ``n``, so every token more likely than the emitted one is listed too. Otherwise the
    emitted token may lie past the listed ones, and its rank is the lower bound
    ``1 + listed``, flagged inexact whatever was asked for. The top-k list is the best listed
    tokens, the emitted one among them only where its rank is exact; a step listing fewer than
    ``max(top_k, 1)`` such tokens is an error naming it. ``steps``: how many entries each list
    must hold (``None``: as many as ``token_logprobs``).
    """
    steps = len(_listed(logprobs["token_logprobs"], "logprobs.token_logprobs", steps))
    _listed(logprobs["top_logprobs"], "logprobs.top_logprobs", steps)
    _listed(list(token_ids), "the emitted token ids", steps)
    logprob = np.array([_logprob(v) for v in logprobs["token_logprobs"]], dtype=np.float64)
    rank = np.empty(steps, dtype=np.int64)
    exact = np.empty(steps, dtype=bool)
    top_ids = np.zeros((steps, top_k), dtype=np.int64)
    top_lps = np.full((steps, top_k), np.nan)
    for step, alternatives in enumerate(logprobs["top_logprobs"]):
        _possible(logprob[step], step, "logprob", "logprob")
        listed = sorted(
            (
                -_possible(_logprob(v), step, f"alternative {key!r} logprob", "top_logprobs"),
                int(key.removeprefix("token_id:")),
            )
            for key, v in alternatives.items()
        )
        others = [(neg, token) for neg, token in listed if token != token_ids[step]]
        greater = sum(-neg > logprob[step] for neg, _ in others)
        rank[step], exact[step] = 1 + greater, greater < len(others)
        known = listed if exact[step] else others  # the best tokens, in order
        if len(known) < max(top_k, 1):
            raise ValueError(
                f"step {step}: the server listed {len(others)} alternatives to the "
                f"emitted token, too few to rank it among the top {max(top_k, 1)} "
                "(is it started with --max-logprobs 20?)"
            )
        for j, (neg, token_id) in enumerate(known[:top_k]):
            top_ids[step, j], top_lps[step, j] = token_id, -neg
    return logprob, rank, top_ids, top_lps, exact
