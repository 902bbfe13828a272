"""Tests for trace_replay.kernels.top_k: the k largest logits of each row, in two passes.

The Triton kernels run under ``TRITON_INTERPRET=1`` (set in conftest) on CPU tensors and are
checked against the pure-torch reference, whose stable sort sends ties to the lower index.
"""

from __future__ import annotations

import pytest
import torch

from trace_replay.kernels.top_k import MAX_TOP_K, top_k_indices, top_k_indices_reference


def logits(rows: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("rows, vocab, k, dtype", [
    (3, 5000, 5, torch.float32),  # two chunks, the second one partial
    (2, 9000, 1, torch.bfloat16),  # three chunks, argmax only
    (1, 8, 8, torch.float32),  # k = vocab: every index once
    (2, 4096, MAX_TOP_K, torch.float16),  # one full chunk, the largest k
])
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
