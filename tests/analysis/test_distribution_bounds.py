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


@pytest.fixture(scope="module")
def tiny_pair(make_tiny_lm, tokenizer):
    """Two prefill engines, float32, over the embedded vocabulary: a tiny random Llama
    (weights at init 0.3, so its distributions are far from uniform) and a copy with every
    weight moved by 2% of its spread (a trainer one update away from the rollout)."""
    import copy

    import trace_replay as tr

    model = make_tiny_lm(vocab_size=49152, max_position_embeddings=4096)
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in moved.parameters():
            weight.add_(torch.randn(weight.shape, generator=gen) * 0.02 * weight.std())
    engines = [tr.make_engine("prefill", model=m, batch_size=16) for m in (model, moved)]
    for engine in engines:
        engine.tokenizer = tokenizer
    yield engines
    for engine in engines:
        engine.close()


@pytest.mark.slow
def test_bounds_contain_the_exact_values_on_every_bundled_token(tiny_pair):
    """On every token of every bundled trace (both datasets, both sources), the bounds from
    the two engines' result frames contain the exact values of their paired replay. The pair
    is a tiny model and its moved copy, not the embedded model (whose bfloat16 pair runs on a
    subset in test_distributions.py): its tails are heavy (the mass outside the top-5 is
    never 0, so every tail term of the bounds is in play), its top-5 sets differ on some
    tokens, and its lower bounds are positive, so the check is not met by bounds of 0."""
    import trace_replay as tr
    from trace_replay.analysis.distributions import replay_pair

    a, b = tiny_pair
    traces = tr.datasets.load()
    exact = replay_pair(traces, a, b)
    runs = [tr.replay(traces, engine=e, progress=False) for e in (a, b)]
    bounds = distribution_bounds(*runs)
    both = exact.merge(bounds, on=["trace_id", "step"], validate="one_to_one")
    assert len(both) == len(exact) == len(bounds) == sum(len(r) for r in runs) / 2
    assert both["trace_id"].nunique() == len(traces)
    assert (np.exp(runs[0]["tail_logmass"]) > 0.1).all()
    assert (both["topk_overlap_y"] < 1).any() and (both["kl_ab_lower"] > 0).all()
    for name in METRICS:
        inside = (both[f"{name}_lower"] <= both[name]) & (both[name] <= both[f"{name}_upper"])
        assert inside.all(), (name, both.loc[~inside, [name, f"{name}_lower"]].head())
