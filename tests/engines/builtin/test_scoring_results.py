"""Tests for trace_replay.engines.builtin.scoring (results): which scored positions become each trace's steps."""

from __future__ import annotations

import numpy as np
import torch

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.builtin.scoring import score_tokens, split_results, wave_results

GEN = torch.Generator().manual_seed(0)


def forward(tokens: list[list[int]]):
    """One forward's (scores, tokens) for rows of equal width, flattened row-major as the
    decode loops store them; logits are seeded noise, scored by the real rule."""
    flat = torch.tensor(tokens).flatten()
    logits = torch.randn(len(flat), 128, generator=GEN)
    return score_tokens(logits, flat, top_k=2), flat


def test_step_by_step_rows_read_one_token_per_forward():
    """With one token per row per forward, row b's steps are column b of the forwards, cut at
    its trace length (a row that finished early ran on with the batch)."""
    wave = [ReplayRequest("a", (1, 2), (10, 11, 12)), ReplayRequest("b", (1,), (20,))]
    steps = [forward([[10], [20]]), forward([[11], [0]]), forward([[12], [0]])]
    results = wave_results(wave, steps, torch.ones((3, 2), dtype=torch.int32))
    assert [r.trace_id for r in results] == ["a", "b"]
    assert results[0].token_ids.tolist() == [10, 11, 12]
    assert results[1].token_ids.tolist() == [20]
    assert results[0].prompt_len == 2 and results[1].prompt_len == 1
    first_scores = steps[0][0]
    assert results[1].logprob[0] == first_scores.logprob[1].item()


def test_verified_rows_keep_their_committed_prefix_of_each_forward():
    """A forward scoring q positions per row contributes only the first counts[f, b] of row b's
    (the accepted drafts and the corrected token), in order."""
    wave = [ReplayRequest("a", (1,), (10, 11, 12, 13)), ReplayRequest("b", (1,), (20, 21, 22))]
    steps = [
        forward([[10], [20]]),  # prefill: one position per row
        forward([[11, 12, 99], [21, 98, 97]]),  # a accepts 2, b accepts 1
        forward([[13, 96, 95], [22, 94, 93]]),
    ]  # each commits its last token
    counts = torch.tensor([[1, 1], [2, 1], [1, 1]], dtype=torch.int32)
    results = wave_results(wave, steps, counts)
    assert results[0].token_ids.tolist() == [10, 11, 12, 13]
    assert results[1].token_ids.tolist() == [20, 21, 22]
    second = steps[1][0]
    # row b's second step is the first position of its segment in forward 1 (flat index 3)
    assert results[1].logprob[1] == second.logprob[3].item()
    assert results[1].top_token_ids[1].tolist() == second.top_token_ids[3].tolist()


def test_split_results_gives_each_request_its_rows():
    """split_results takes rows[i] of every host array for request i, in request order."""
    host = {
        "token_ids": np.array([5, 6, 7]),
        "logprob": np.array([-1.0, -2.0, -3.0]),
        "rank": np.array([1, 2, 3]),
        "top_token_ids": np.zeros((3, 0)),
        "top_logprobs": np.zeros((3, 0)),
        "entropy": np.array([0.1, 0.2, 0.3]),
    }
    requests = [ReplayRequest("x", (1,), (7,)), ReplayRequest("y", (1, 2), (5, 6))]
    x, y = split_results(requests, host, [np.array([2]), np.array([0, 1])])
    assert (x.trace_id, x.prompt_len, x.token_ids.tolist()) == ("x", 1, [7])
    assert (y.trace_id, y.prompt_len, y.logprob.tolist()) == ("y", 2, [-1.0, -2.0])
