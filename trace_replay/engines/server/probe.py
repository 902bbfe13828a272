"""The fixed probe a server engine scores: proof that the server forces traces and gives raw
logprobs, and the fingerprint of what it serves, which checkpoints key on.

The probe is two one-token traces of different tokens after the same four-token prompt, all
taken from :data:`PROBE_TEXT`; the engine sends them one at a time, so that on an idle server
each runs alone in its batch and scores the same bits every time.

The fingerprint digests the server's address and the probe's logprobs and top-k logprobs
rounded to :data:`FINGERPRINT_DECIMALS` decimals. Another model, other weights or another
dtype behind the same address and served name move those numbers by far more than 0.01 nats,
so a checkpoint started against one server is refused by another. Rounding is what lets a
server that moves its numbers a little between start-ups (another batch composition under
load: ~1e-6 in float32) keep its checkpoint; a number that happens to lie within that
movement of a rounding edge flips the digest, and the checkpoint is then refused as other
settings: a false refusal, never a false resume.

A server's weights can change while it serves (an RL rollout server loads each training
step's), so a replay reads the fingerprint again before it keeps rows
(:mod:`~trace_replay.runs.weights_watch`). One engine reads it through one
:class:`Fingerprints`, which gives the digest it gave before while every probe number stays
within :data:`STEADY_NATS` of the scores that first gave it: a number lying near a rounding
edge does not flip the digest mid-run. A change moving a probe number by more than 0.01 nats
always changes the digest; one of less than 0.005 never does.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trace_replay.engines.base import ReplayRequest, TraceResult

__all__ = [
    "FINGERPRINT_DECIMALS",
    "PROBE_TEXT",
    "STEADY_NATS",
    "Fingerprints",
    "fingerprint",
    "probe_requests",
]

PROBE_TEXT = "Replay checks the tokenizer: déjà vu, 3.14 ✓\n    return x"
FINGERPRINT_DECIMALS = 2  # 0.01 nats: far above float32 noise, far below another model's
STEADY_NATS = 0.005  # half a rounding step: an engine's digest stands while scores move less


def probe_requests(tokenizer: Any) -> list[ReplayRequest]:
    """The probe: the first two distinct tokens of :data:`PROBE_TEXT`, each a one-token trace
    after the text's first four tokens."""
    ids = list(tokenizer.encode(PROBE_TEXT))
    return [
        ReplayRequest(f"<server check {t}>", tuple(ids[:4]), (t,))
        for t in list(dict.fromkeys(ids))[:2]
    ]


def fingerprint(base_url: str, results: Sequence[TraceResult]) -> str:
    """A digest of ``base_url`` and the probe's scores (``results``, checked possible): each
    trace's token, logprob and top-k logprobs, rounded to :data:`FINGERPRINT_DECIMALS`."""

    def rounded(value: float) -> float | str:
        return str(value) if math.isinf(value) else round(float(value), FINGERPRINT_DECIMALS) + 0.0

    scores = [
        [int(r.token_ids[0]), rounded(r.logprob[0]), [rounded(v) for v in r.top_logprobs[0]]]
        for r in results
    ]
    text = json.dumps({"base_url": base_url, "probe": scores}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Fingerprints:
    """The fingerprints of the server at ``base_url`` as one engine reads them, run after run.

    Each call digests the probe's ``results`` (:func:`fingerprint`), but gives the digest it
    gave before while every probe number is within :data:`STEADY_NATS` of the scores that
    first gave that digest; those scores stay the reference while the digest does, so a slow
    drift cannot carry it along.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._first: tuple[np.ndarray, str] | None = None  # (scores, the digest they gave)

    def __call__(self, results: Sequence[TraceResult]) -> str:
        scores = _scores(results)
        if self._first is not None and _within(scores, self._first[0], STEADY_NATS):
            return self._first[1]
        digest = fingerprint(self.base_url, results)
        if self._first is None or digest != self._first[1]:
            self._first = (scores, digest)
        return digest


def _scores(results: Sequence[TraceResult]) -> np.ndarray:
    """The numbers :func:`fingerprint` digests, in one flat array."""
    return np.concatenate(
        [
            np.concatenate(
                [[r.token_ids[0], r.logprob[0]], np.asarray(r.top_logprobs[0], dtype=np.float64)]
            )
            for r in results
        ]
    ).astype(np.float64)


def _within(a: np.ndarray, b: np.ndarray, nats: float) -> bool:
    """Whether ``a`` and ``b`` are numbers of one shape each within ``nats`` of the other
    (an infinity equal to the same infinity only)."""
    if a.shape != b.shape:
        return False
    same = (a == b) | (np.abs(a - b) <= nats)
    return bool(same.all())
