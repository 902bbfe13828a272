"""Tiled row-invariant attention (trace_replay.kernels.deterministic_tiled_attention): plain
attention's numbers, and a query's bits whatever tile it is computed in."""

import math

import pytest
import torch

import trace_replay.kernels._triton
from trace_replay.kernels.deterministic_attention import attention_rows_reference
from trace_replay.kernels.deterministic_tiled_attention import (
    BLOCK_Q,
    attention_tiles_triton,
    tile_bounds,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not trace_replay.kernels._triton.can_launch(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before the first import",
)


def prefill_layout(lengths, kv_heads=3, heads=9, dim=64, length=96, seed=0):
    """A prefill's rows: sequence b's tokens at slots 0..len-1 of cache row b, in order;
    some slots dropped from context (as rejected drafts are)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    valid = torch.rand(batch, length, generator=g) < 0.85
    rows = sum(lengths)
    q = torch.randn(rows, heads, dim, generator=g)
    cache_row = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])
    slot = torch.cat([torch.arange(n) for n in lengths])
    return [t.to(DEVICE) for t in (q, k, v, valid, cache_row, slot)]


def tiles_of(bounds):
    return torch.tensor(bounds, device=DEVICE)


def test_tile_bounds_cut_each_run():
    """Runs are cut at BLOCK_Q rows and never share a tile; empty runs make no tile."""
    assert tile_bounds([BLOCK_Q + 3, 1, 0, 2 * BLOCK_Q]) == [
        0,
        BLOCK_Q,
        BLOCK_Q + 3,
        BLOCK_Q + 4,
        2 * BLOCK_Q + 4,
        3 * BLOCK_Q + 4,
    ]


@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (32, 4, 4)])
def test_prefill_tiles_compute_attention(dim, heads, kv_heads):
    """Tiles of a prefill give the blocked reference's attention (GQA and not, dropped
    slots, sequences across key blocks and tiles)."""
    lengths = [40, 7, 1, 70]
    q, k, v, valid, cache_row, slot = prefill_layout(lengths, kv_heads, heads, dim)
    scale = 1 / math.sqrt(dim)
    got = attention_tiles_triton(
        q, k, v, valid, cache_row, slot, scale, tiles_of(tile_bounds(lengths))
    )
    want = attention_rows_reference(*(t.cpu() for t in (q, k, v, valid, cache_row, slot)), scale, 8)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_a_query_keeps_its_bits_in_any_tile():
    """A query's output is the same alone in its tile (a decode step's form) as inside a
    prefill's tile at any place, beside shorter and longer queries of its sequence.

    Bitwise on CUDA, where a tensor-core product and a row reduction treat every row of a
    tile alike; in Triton's interpreter ``tl.dot`` is numpy's BLAS, which may round a row
    by its place in the matrix, so there the outputs agree to float32 rounding."""
    lengths = [70, 23]
    q, k, v, valid, cache_row, slot = prefill_layout(lengths)
    alone = attention_tiles_triton(
        q, k, v, valid, cache_row, slot, 0.125, torch.arange(q.shape[0] + 1, device=DEVICE)
    )
    tiled = attention_tiles_triton(
        q, k, v, valid, cache_row, slot, 0.125, tiles_of(tile_bounds(lengths))
    )
    odd = attention_tiles_triton(
        q, k, v, valid, cache_row, slot, 0.125, tiles_of([0, 5, 21, 37, 53, 69, 70, 85, 93])
    )
    for other in (tiled, odd):
        if DEVICE == "cuda":
            assert torch.equal(other, alone)
        else:
            torch.testing.assert_close(other, alone, atol=1e-6, rtol=1e-6)
