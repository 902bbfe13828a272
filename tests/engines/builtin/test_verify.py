"""The verify loop (trace_replay.engines.builtin.verify) on a tiny random Llama: k drafts per forward
commit exactly the trace, scored as teacher forcing scores it, whether the drafts are the
trace itself or prompt-lookup n-grams (some rejected)."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.builtin.backends.hf import HFBackend
from trace_replay.engines.builtin.decode import SlotTable, replay_forwards
from trace_replay.engines.builtin.scoring import score_tokens, wave_results
from trace_replay.engines.builtin.verify import VerifySteps, verify_steps

K = 3
TOP_K = 3


def verify(lm, wave, method: str):
    """``verify_steps`` over ``wave`` in one batch: (result, forwards reported by on_forward)."""
    backend, slots = HFBackend(lm, 0), SlotTable(len(wave), torch.device("cpu"))
    reported = []
    with torch.inference_mode():
        idx_mapping = slots.admit(wave)
        logits = backend.prefill([r.prompt_token_ids for r in wave], max(r.trace_len for r in wave))
        result = verify_steps(
            backend,
            slots,
            idx_mapping,
            logits,
            wave,
            method=method,
            k=K,
            top_k=TOP_K,
            on_forward=reported.append,
        )
    return result, reported


@pytest.fixture(scope="module")
def runs(tiny_llama, tiny_requests):
    """{method: (VerifyResult, on_forward calls)} for every tiny request in one wave."""
    return {method: verify(tiny_llama, tiny_requests, method) for method in ("trace", "ngram")}


@pytest.mark.parametrize("method", ["trace", "ngram"])
def test_commits_the_trace_scored_as_teacher_forcing(
    runs, method, tiny_requests, assert_results_match
):
    """Whatever the drafts, each row commits exactly its trace, with the logprob, rank and
    top-k of a float64 teacher-forced forward over that trace alone."""
    result, _ = runs[method]
    results = wave_results(tiny_requests, result.steps, result.counts)
    for one, request in zip(results, tiny_requests):
        assert one.token_ids.tolist() == list(request.trace_token_ids)
    assert_results_match(results)


def test_trace_drafts_are_all_accepted(runs, tiny_requests):
    """Trace drafts: after the plain first step every forward commits k + 1 tokens of each
    row's trace (what is left of it at the end, nothing once it is done), so the wave takes
    1 + ceil((T - 1) / (k + 1)) forwards for its longest T; every draft inside a trace is
    accepted."""
    result, reported = runs["trace"]
    longest = max(r.trace_len for r in tiny_requests)
    forwards = 1 + -(-(longest - 1) // (K + 1))
    assert len(result.steps) == forwards and reported == list(range(forwards))
    left = torch.tensor([r.trace_len - 1 for r in tiny_requests])
    expected = [torch.ones_like(left)] + [
        (left - f * (K + 1)).clamp(0, K + 1) for f in range(forwards - 1)
    ]
    assert torch.equal(result.counts.long(), torch.stack(expected))
    chunks = [-(-(r.trace_len - 1) // (K + 1)) for r in tiny_requests]
    # each chunk of up to k + 1 committed tokens holds one fewer draft
    assert result.drafted == sum(r.trace_len - 1 - c for r, c in zip(tiny_requests, chunks))
    assert result.accepted == result.drafted


def test_ngram_drafts_accept_what_the_trace_repeats(runs, tiny_requests):
    """N-gram drafts: a row commits 1 to k + 1 tokens per forward until its trace is done,
    then none; the trace that repeats its prompt gets drafts accepted, never more than were
    drafted; the loop stops when the longest trace is done."""
    result, reported = runs["ngram"]
    counts = result.counts.long()
    lengths = torch.tensor([r.trace_len for r in tiny_requests])
    assert torch.equal(counts.sum(0), lengths)
    forwards_per_row = (counts > 0).sum(0)
    assert torch.equal(counts > 0, torch.arange(len(counts))[:, None] < forwards_per_row)
    assert (counts <= K + 1).all() and forwards_per_row.max() == len(counts)
    repeat = [r.trace_id for r in tiny_requests].index("repeat")
    assert (counts[:, repeat] > 1).any()
    # every token past the first a forward commits is an accepted draft
    assert result.accepted == (counts[1:] - 1).clamp(min=0).sum() > 0
    assert result.accepted <= result.drafted
    assert reported == list(range(len(result.steps)))


def test_verify_steps_run_in_the_replay_loop(tiny_llama, tiny_requests):
    """Verify is a step runner of the one replay loop: replay_forwards returns the forwards
    it ran (prefill included), one backend forward and one scored step each."""
    wave = tiny_requests
    backend, slots = HFBackend(tiny_llama, 0), SlotTable(len(wave), torch.device("cpu"))
    with torch.inference_mode():
        idx_mapping = slots.admit(wave)
        logits = backend.prefill([r.prompt_token_ids for r in wave], max(r.trace_len for r in wave))
        runner = VerifySteps(
            backend, slots, idx_mapping, wave, method="ngram", k=K, top_k=TOP_K, score=score_tokens
        )
        forwards = replay_forwards(backend, runner, logits)
    assert forwards == backend.forwards == len(runner.result().steps) > 1
