"""The fixed probe of a server engine and the fingerprint checkpoints key on
(trace_replay.engines.server.probe)."""

from __future__ import annotations

import math

import numpy as np

from trace_replay.engines.base import TraceResult
from trace_replay.engines.server.probe import PROBE_TEXT, fingerprint, probe_requests

URL = "http://127.0.0.1:8000/v1"


def scored(token: int, logprob: float, top: list[float]) -> TraceResult:
    """A probe trace's result: one step scoring ``token``."""
    return TraceResult(
        trace_id=f"<server check {token}>",
        prompt_len=4,
        token_ids=np.array([token]),
        logprob=np.array([logprob]),
        rank=np.array([2]),
        top_token_ids=np.array([[900, token]]),
        top_logprobs=np.array([top]),
        entropy=np.array([np.nan]),
    )


PROBE = [scored(5, -1.25, [-0.5, -1.25]), scored(6, -3.0, [-0.25, -1.5])]


def test_the_probe_is_two_one_token_traces_of_the_probe_text(tokenizer):
    """Two one-token traces of different tokens, after the same four-token prompt, all from
    PROBE_TEXT's tokens."""
    ids = tokenizer.encode(PROBE_TEXT)
    probes = probe_requests(tokenizer)
    assert [p.prompt_token_ids for p in probes] == [tuple(ids[:4])] * 2
    assert [p.trace_token_ids for p in probes] == [(ids[0],), (ids[1],)] and ids[0] != ids[1]


def test_the_fingerprint_covers_the_address_and_the_scores():
    """Another address, or scores 0.05 nats apart, give another fingerprint; so do other
    top-k logprobs, and scoring other tokens."""
    base = fingerprint(URL, PROBE)
    assert len(base) == 32
    assert fingerprint("http://127.0.0.1:8001/v1", PROBE) != base
    assert fingerprint(URL, [scored(5, -1.30, [-0.5, -1.30]), PROBE[1]]) != base
    assert fingerprint(URL, [PROBE[0], scored(6, -3.0, [-0.3, -1.5])]) != base
    assert fingerprint(URL, [scored(7, -1.25, [-0.5, -1.25]), PROBE[1]]) != base


def test_the_fingerprint_is_rounded_to_a_hundredth():
    """Scores moved by less than their rounding edge (1e-6, as a float32 server's numbers
    move with batch composition; 1e-3 here, away from an edge) keep the fingerprint; -inf
    is digested as itself, and -0.0 as 0.0."""
    moved = [scored(5, -1.25 + 1e-6, [-0.5 - 1e-3, -1.25 + 1e-6]), PROBE[1]]
    assert fingerprint(URL, moved) == fingerprint(URL, PROBE)
    floor = [scored(5, -math.inf, [-0.0, -math.inf]), PROBE[1]]
    zero = [scored(5, -math.inf, [0.0, -math.inf]), PROBE[1]]
    assert fingerprint(URL, floor) == fingerprint(URL, zero) != fingerprint(URL, PROBE)
