"""Tests for trace_replay.kernels.top_k: the k largest logits of each row, chunk maxima first.

The Triton kernels run under ``TRITON_INTERPRET=1`` (set in conftest) on CPU tensors and are
checked against the pure-torch reference, whose stable sort sends ties to the lower index.
"""

from __future__ import annotations

import pytest
import torch

from trace_replay.kernels.top_k import (
    MAX_TOP_K,
    top_k_indices,
    top_k_indices_reference,
    top_k_scores,
)


def logits(rows: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize(
    "rows, vocab, k, dtype",
    [
        (3, 5000, 5, torch.float32),  # two chunks, the second one partial
        (2, 9000, 1, torch.bfloat16),  # three chunks, argmax only
        (1, 8, 8, torch.float32),  # k = vocab: every index once
        (2, 4096, MAX_TOP_K, torch.float16),  # the largest k: 32 of 16 chunks' entries
    ],
)
def test_kernel_matches_the_reference(rows, vocab, k, dtype, device):
    """Same indices as a stable descending sort, largest first, for every chunk layout."""
    x = logits(rows, vocab, dtype).to(device)
    got = top_k_indices(x, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got.cpu(), top_k_indices_reference(x.cpu(), k))


def test_ties_go_to_the_lower_index_across_chunks():
    """Equal maxima in different chunks: the lower index first, each index once."""
    x = torch.zeros(1, 9000)
    x[0, [8000, 10, 4500]] = 1.0
    assert top_k_indices(x, 4).tolist() == [[10, 4500, 8000, 0]]


def test_nan_ranks_below_every_number():
    """NaN and -inf rank lowest, level with each other; each still comes out once, by index."""
    x = torch.tensor([[float("nan"), 1.0, float("-inf"), 1.0, float("inf")]])
    assert top_k_indices(x, 5).tolist() == [[4, 1, 3, 0, 2]]
    assert top_k_indices_reference(x, 5).tolist() == [[4, 1, 3, 0, 2]]


@pytest.mark.parametrize("k", [0, MAX_TOP_K + 1, 9])
def test_k_out_of_range_is_refused(k):
    """k must be within 1..min(vocab, MAX_TOP_K)."""
    with pytest.raises(ValueError, match="k must be in"):
        top_k_indices(logits(1, 8), k)


def test_rows_must_be_contiguous():
    """A transposed view (last stride != 1) is refused rather than read wrongly."""
    with pytest.raises(ValueError, match="contiguous"):
        top_k_indices(logits(64, 4).t(), 2)


def test_a_mostly_masked_row_gives_distinct_indices():
    """Fewer finite logits than k (a masked vocabulary): the finite ones first, then the
    lowest-indexed masked ones, no index twice — across chunk boundaries too."""
    x = torch.full((1, 9000), float("-inf"))
    x[0, [6000, 3]] = torch.tensor([0.5, 2.0])
    assert top_k_indices(x, 5).tolist() == [[3, 6000, 0, 1, 2]]
    assert torch.equal(top_k_indices(x, 5), top_k_indices_reference(x, 5))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunk, group", [(16, 1), (16, 4), (32, 2)])
def test_heavy_ties_across_many_chunks(seed, chunk, group):
    """Logits of four values only, so chunk maxima tie everywhere: still the reference's
    order (value, then index), for groups that do and do not divide the chunks."""
    x = torch.randint(0, 4, (3, 215), generator=torch.Generator().manual_seed(seed)).float()
    for k in (1, 5, 16):
        assert torch.equal(
            top_k_indices(x, k, chunk=chunk, group=group), top_k_indices_reference(x, k)
        )


def test_the_top_k_all_in_one_chunk():
    """The k largest share one chunk, whose neighbours hold the next ones."""
    x = torch.zeros(1, 512)
    x[0, 100:105] = torch.tensor([5.0, 9.0, 7.0, 8.0, 6.0])
    x[0, 96] = 4.0
    assert top_k_indices(x, 6, chunk=16).tolist() == [[101, 103, 102, 104, 100, 96]]


def test_more_picks_than_chunks():
    """k larger than the number of chunks: every chunk is looked at, nothing twice."""
    x = logits(2, 40)
    assert torch.equal(top_k_indices(x, 7, chunk=16), top_k_indices_reference(x, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_follow_the_token_logprob_rule(dtype, device):
    """top_k_scores: the same ids, and logprob + (top logit - token logit) in float32 —
    the same operations in the same order, so the same float32 numbers."""
    x = logits(5, 3000, dtype, seed=3).to(device)
    tokens = torch.tensor([0, 17, 2999, 5, 1234], device=device)
    logprob = torch.log_softmax(x.float(), -1).gather(1, tokens[:, None])[:, 0]
    ids, top = top_k_scores(x, 5, tokens, logprob)
    assert torch.equal(ids, top_k_indices_reference(x, 5).to(device))
    token_logit = x.gather(1, tokens[:, None]).float()
    assert torch.equal(top, logprob[:, None] + (x.gather(1, ids).float() - token_logit))


def test_scores_keep_nan():
    """A NaN logit among the picks gives a NaN logprob, not a number."""
    x = torch.tensor([[float("nan"), 1.0, 0.5]])
    ids, top = top_k_scores(x, 3, torch.tensor([1]), torch.tensor([-0.5]))
    assert ids.tolist() == [[1, 2, 0]]
    assert top[0, :2].tolist() == [-0.5, -1.0] and top[0, 2].isnan()
