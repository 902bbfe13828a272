"""trace_replay.analysis.distribution_bounds: bounds from top-k, token logprob and tail mass
always contain the exact divergences of the full distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_replay.analysis.distribution_bounds import bound_arrays, distribution_bounds
from trace_replay.analysis.distributions import METRICS, step_divergences


def stored(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """What a replay keeps of float32 logits: top-k ids and logprobs, the token's, the tail."""
    from trace_replay.engines.builtin.scoring import score_tokens

    s = score_tokens(logits, tokens, k)
    listed = (s.top_token_ids == tokens[:, None]).any(dim=1)
    ids = torch.cat([s.top_token_ids, torch.where(listed, -1, tokens)[:, None]], dim=1)
    lps = torch.cat([s.top_logprobs, s.logprob[:, None]], dim=1)
    return ids.numpy(), lps.double().numpy(), s.tail_logmass.double().numpy()


def pairs(kind: str, n: int = 200, vocab: int = 64, seed: int = 0):
    """``n`` pairs of logits rows: 'close' (small noise), 'far' (independent), 'peaked'
    (one side concentrated where the other is not), 'mixed' (noise of every scale)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, vocab, generator=g) * 3
    if kind == "close":
        b = a + 1e-3 * torch.randn(n, vocab, generator=g)
    elif kind == "far":
        b = torch.randn(n, vocab, generator=g) * 3
    elif kind == "peaked":
        b = a.clone()
        b[:, 0] += 15
        a[:, 1] += 15
    else:
        b = a + torch.logspace(-6, 1, n)[:, None] * torch.randn(n, vocab, generator=g)
    return a, b, torch.randint(0, vocab, (n,), generator=g)


@pytest.mark.parametrize("kind", ["close", "far", "peaked", "mixed"])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_bounds_contain_the_exact_values(kind, k):
    """For every row, lower <= exact (float64, full logits) <= upper, for every metric."""
    a, b, tokens = pairs(kind)
    exact = step_divergences(a, b, tokens, max(k, 1)).numpy()
    bounds = bound_arrays(*stored(a, tokens, k), *stored(b, tokens, k))
    for j, name in enumerate(METRICS):
        lower, upper = bounds[name]
        value = exact[:, 2 + j]
        assert (lower <= value).all() and (value <= upper).all(), name
        assert (lower <= upper).all()


def test_identical_runs_have_a_lower_bound_of_zero_and_close_upper_bounds():
    """Two equal runs: every lower bound is 0, and TV's upper bound is the tail's mass."""
    a, _, tokens = pairs("close", n=20)
    ids, lps, tail = stored(a, tokens, 5)
    bounds = bound_arrays(ids, lps, tail, ids, lps, tail)
    for name in METRICS:
        assert np.all(bounds[name][0] == 0.0), name
    p_tail = np.exp(tail) - np.where(ids[:, -1] >= 0, np.exp(lps[:, -1]), 0)
    np.testing.assert_allclose(bounds["tv"][1], p_tail, rtol=1e-4, atol=3e-5)


def test_disjoint_top_tokens_give_a_large_lower_bound():
    """When a's likeliest token is one b gives almost nothing, the lower bounds of TV and KL
    are large (the bounds say something, not only [0, inf])."""
    a, b, tokens = pairs("peaked", n=10)
    exact = step_divergences(a, b, tokens, 5).numpy()
    bounds = bound_arrays(*stored(a, tokens, 5), *stored(b, tokens, 5))
    assert (bounds["tv"][0] > 0.95 * exact[:, 4]).all() and (exact[:, 4] > 0.7).all()
    assert (bounds["kl_ab"][0] > 4).all()  # exp(-4): b gives a's likeliest token < 2%


def test_frames_without_a_tail_are_refused(replay_pair):
    """Frames written before tail_logmass existed have no column: refused, naming it."""
    a, b = replay_pair
    with pytest.raises(ValueError, match="tail_logmass"):
        distribution_bounds(a.drop(columns="tail_logmass", errors="ignore"), b)
