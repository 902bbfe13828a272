"""Tests for trace_replay.engines.builtin.scoring: the one rule every engine scores a token by."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_replay.engines.builtin.scoring import (
    chunked_argmax,
    collect_rows,
    greedy_tokens,
    score_tokens,
    score_with_top,
    scorer_for,
    tail_logmass,
    top_from_logprob,
)


@pytest.fixture(scope="module")
def logits():
    """Eight positions over a 50-token vocabulary, seeded, float32."""
    return torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_logprob_is_the_float64_log_softmax(logits):
    """logprob and entropy match a float64 computation of the same distribution."""
    token_ids = torch.arange(8) * 5
    scores = score_tokens(logits, token_ids, top_k=3)
    exact = torch.log_softmax(logits.double(), dim=-1)
    np.testing.assert_allclose(scores.logprob, exact[torch.arange(8), token_ids], atol=1e-5)
    entropy = -(exact.exp() * exact).sum(dim=-1)
    np.testing.assert_allclose(scores.entropy, entropy, atol=1e-4)


def test_rank_counts_strictly_greater_logprobs(logits):
    """rank is 1 + the number of tokens with a strictly greater logprob; 1 for the argmax."""
    token_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    scores = score_tokens(logits, token_ids, top_k=3)
    logprobs = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate(token_ids):
        expected = 1 + int((logprobs[row] > logprobs[row, token]).sum())
        assert scores.rank[row] == expected
    assert (score_tokens(logits, logits.argmax(-1), top_k=1).rank == 1).all()


def test_tied_tokens_share_the_best_rank():
    """Tokens with equal logits get the same rank, the best one of the tie."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]] * 3)
    scores = score_tokens(logits, torch.tensor([1, 2, 3]), top_k=2)
    assert scores.rank.tolist() == [2, 2, 4]


def test_top_k_is_sorted_and_holds_the_argmax(logits):
    """top_logprobs come sorted, descending; the first top id is the argmax; top_k=0 is empty."""
    scores = score_tokens(logits, torch.zeros(8, dtype=torch.long), top_k=5)
    assert scores.top_token_ids.shape == scores.top_logprobs.shape == (8, 5)
    assert (scores.top_logprobs.diff(dim=1) <= 0).all()
    assert torch.equal(scores.top_token_ids[:, 0], logits.argmax(-1))
    empty = score_tokens(logits, torch.zeros(8, dtype=torch.long), top_k=0)
    assert empty.top_token_ids.shape == empty.top_logprobs.shape == (8, 0)


def test_masked_vocabulary_keeps_entropy_finite():
    """Tokens with probability 0 (logit -inf) add nothing to the entropy: it stays finite."""
    logits = torch.tensor([[0.0, 0.0, -float("inf"), -float("inf")]])
    scores = score_tokens(logits, torch.tensor([0]), top_k=2)
    assert scores.entropy.item() == pytest.approx(np.log(2))
    assert scores.logprob.item() == pytest.approx(-np.log(2))


def test_low_precision_logits_are_scored_in_float32(logits):
    """bfloat16 logits are upcast before log-softmax (as vLLM's sampler does): float32 out."""
    scores = score_tokens(logits.bfloat16(), torch.arange(8), top_k=2)
    assert scores.logprob.dtype == scores.top_logprobs.dtype == torch.float32
    exact = torch.log_softmax(logits.bfloat16().double(), dim=-1)[torch.arange(8), torch.arange(8)]
    np.testing.assert_allclose(scores.logprob, exact, atol=1e-5)


def test_collect_rows_gives_host_arrays_in_result_dtypes(logits):
    """collect_rows returns numpy arrays: float64 logprobs, entropy and tail, int64 ids and
    ranks."""
    token_ids = torch.arange(8, dtype=torch.int32)
    host = collect_rows(score_tokens(logits, token_ids, top_k=2), token_ids)
    assert set(host) == {
        "token_ids",
        "logprob",
        "rank",
        "top_token_ids",
        "top_logprobs",
        "entropy",
        "tail_logmass",
    }
    assert host["token_ids"].dtype == host["rank"].dtype == np.int64
    assert all(
        host[k].dtype == np.float64 for k in ("logprob", "top_logprobs", "entropy", "tail_logmass")
    )
    assert host["token_ids"].tolist() == list(range(8))


def test_top_k_comes_from_the_logits_in_order(logits):
    """top_token_ids are the k largest logits, top_logprobs their logprobs, descending."""
    scores = score_tokens(logits, logits.argmax(-1), top_k=4)
    assert torch.equal(scores.top_token_ids, logits.topk(4, dim=-1).indices)
    logprobs = torch.log_softmax(logits, dim=-1)
    assert torch.equal(scores.top_logprobs, logprobs.gather(1, scores.top_token_ids))
    assert (scores.top_logprobs.diff(dim=1) <= 0).all()


def test_cpu_scorer_is_score_tokens():
    """CPU engines score with the eager function itself (no compile at start-up)."""
    assert scorer_for("cpu") is score_tokens
    assert scorer_for("cpu", rows="dynamic") is score_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_from_logprob_agrees_with_score_tokens(logits, dtype):
    """Top-k logprobs taken from the scored token's (the CUDA scorer's way) are
    log-softmax's within float32 rounding, and the scored token's own exactly."""
    x = logits.to(dtype)
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    tokens[:4] = x[:4].float().argmax(dim=1)  # four rows score their top-1 token
    top_ids = x.float().topk(5, dim=1).indices
    want = score_tokens(x, tokens, 5)
    got = top_from_logprob(score_with_top, x, tokens, top_ids)
    assert torch.equal(got.top_token_ids, top_ids) and got.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=4e-6, rtol=0)
    assert torch.equal(got.top_logprobs[:4, 0], got.logprob[:4])
    for field in ("logprob", "rank", "entropy"):
        assert torch.equal(getattr(got, field), getattr(want, field))
    torch.testing.assert_close(got.tail_logmass, want.tail_logmass, atol=4e-6, rtol=0)


@pytest.mark.parametrize("top_k", [0, 1, 5, 50])
def test_tail_is_the_mass_outside_the_top_k(logits, top_k):
    """The tail mass is the float64 mass of the tokens outside the top-k (0 when the top-k
    holds the whole vocabulary), and top-k plus tail sum to 1."""
    scores = score_tokens(logits, torch.arange(8), top_k)
    p = torch.softmax(logits.double(), dim=-1)
    outside = p.sum(dim=1) - p.gather(1, scores.top_token_ids).sum(dim=1)
    np.testing.assert_allclose(
        scores.tail_logmass.exp().double(), outside.clamp(min=0), rtol=1e-5, atol=1e-12
    )
    whole = scores.top_logprobs.double().exp().sum(dim=1) + scores.tail_logmass.double().exp()
    np.testing.assert_allclose(whole, 1.0, atol=1e-6)


def test_tiny_tail_keeps_its_digits():
    """A tail of ~1e-12 (far below float32's 1 - sum(top) resolution) is recorded to a few
    digits: logsumexp of the rest, not a difference from 1."""
    logits = torch.tensor([[30.0, 2.0, 1.0, 0.0]])
    want = torch.logsumexp(logits.double()[:, 1:], 1) - torch.logsumexp(logits.double(), 1)
    got = tail_logmass(torch.log_softmax(logits, dim=-1), torch.tensor([[0]]))
    np.testing.assert_allclose(got.double(), want, rtol=1e-5)
    assert want.exp().item() < 1e-11


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["static", "dynamic"])
def test_cuda_scorer_agrees_with_score_tokens(dtype, rows):
    """The CUDA scorer (top-k kernel + compiled reductions, one graph per row count or one
    for all) gives score_tokens' numbers."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(37, 49152, generator=gen, device="cuda") * 3).to(dtype)
    tokens = torch.randint(0, 49152, (37,), generator=gen, device="cuda")
    want, got = score_tokens(x, tokens, 5), scorer_for("cuda", rows=rows)(x, tokens, 5)
    torch.testing.assert_close(got.logprob, want.logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.tail_logmass, want.tail_logmass, atol=1e-5, rtol=0)
    assert (got.rank - want.rank).abs().max() <= 1  # only near-ties may move by rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_is_argmax(device, dtype):
    """The two-pass argmax gives argmax's index, ties (first wins, across and within chunks),
    NaN (counted largest) and -inf included; ``greedy_tokens`` is argmax on every device."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1024, generator=gen).round(decimals=1)  # many exact ties
    logits[1, 300] = logits[1, 700] = 9.0  # equal maxima in different chunks
    logits[2, 5] = logits[2, 6] = 9.0  # in one chunk
    logits[3, 800] = float("nan")
    logits[3, 900] = float("nan")
    logits[4] = float("-inf")
    logits[5, 1023] = 50.0  # the last index
    logits = logits.to(device, dtype)
    want = logits.argmax(dim=-1)
    for chunks in (2, 16, 64):
        assert torch.equal(chunked_argmax(logits, chunks), want)
    assert torch.equal(greedy_tokens(logits), want)
    wide = torch.randn(3, 128256, generator=gen).to(device, dtype)  # Llama-3's vocabulary
    assert torch.equal(greedy_tokens(wide), wide.argmax(dim=-1))


def test_fused_tail_matches_tail_logmass_even_below_float32_range():
    """score_tokens' tail (the entropy pass's exp, top-k zeroed, summed) is tail_logmass's
    within float32 rounding, rows whose rest mass is subnormal in float32 included (they
    fall back to logsumexp, so ~1e-43 is not recorded as mass 0)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * 4
    logits[2] = 0.0
    logits[2, 7] = 110.0  # rest ~ 5e3 * exp(-110): far below float32's smallest normal
    logits[4, :3] = 200.0  # a top-3 holding all the mass but ~1e-84
    tokens = torch.tensor([0, 1, 7, 3, 0, 5])
    got = score_tokens(logits, tokens, 3).tail_logmass
    want = tail_logmass(torch.log_softmax(logits, dim=-1), logits.topk(3, dim=-1).indices)
    torch.testing.assert_close(got, want, atol=4e-6, rtol=1e-6)
    assert torch.isfinite(got).all() and got[2] < -100 and got[4] < -180
