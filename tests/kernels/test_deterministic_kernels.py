"""Batch-invariant kernels: Triton against the torch reference, and row invariance of both."""

import math

import pytest
import torch

import trace_replay.kernels._triton
from trace_replay.kernels import fp32_linear
from trace_replay.kernels.deterministic_attention import (
    BLOCK_N,
    attention_rows_reference,
    attention_rows_triton,
)
from trace_replay.kernels.deterministic_linear import (
    INVARIANT_ROWS,
    block_plan,
    config_3xtf32,
    linear_rows_3xtf32,
    linear_rows_reference,
    linear_rows_triton,
)
from trace_replay.kernels.deterministic_rms_norm import (
    rms_norm_rows_reference,
    rms_norm_rows_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not trace_replay.kernels._triton.can_launch(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before the first import",
)


def _cache(batch=3, kv_heads=2, length=64, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    valid = torch.rand(batch, length, generator=g) < 0.8
    valid[:, 0] = True
    return k, v, valid


def _dense_attention(q, k, v, valid, cache_row, slot, scale):
    """Plain softmax attention in float64, one row at a time (the oracle)."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for r in range(q.shape[0]):
        b, s = int(cache_row[r]), int(slot[r])
        t = torch.arange(k.shape[2])
        allowed = (valid[b] & (t <= s)) | (t == s)
        keys = k[b].double().repeat_interleave(groups, 0)[:, allowed]
        values = v[b].double().repeat_interleave(groups, 0)[:, allowed]
        w = torch.softmax((keys @ q[r].double()[:, :, None]).squeeze(-1) * scale, dim=-1)
        out.append((w[:, None, :] @ values).squeeze(1))
    return torch.stack(out).float()


def test_block_plan_covers_rows_with_menu_sizes():
    """Whole blocks of the largest size, then the smallest size holding the rest."""
    assert block_plan(0, (8, 16)) == []
    assert block_plan(5, (4, 8, 16)) == [(0, 8)]
    assert block_plan(37, (4, 8, 16)) == [(0, 16), (16, 16), (32, 8)]
    assert block_plan(32, (16,)) == [(0, 16), (16, 16)]


def test_linear_reference_matches_f_linear():
    """The blocked reference computes x @ W.T (padding rows dropped)."""
    x, w = torch.randn(37, 24), torch.randn(10, 24)
    torch.testing.assert_close(linear_rows_reference(x, w, (4, 8, 16)), x @ w.T)


def test_linear_reference_row_invariant_at_fixed_shape():
    """With one block size, a row's bits do not depend on its neighbours or position."""
    w, row = torch.randn(40, 64), torch.randn(64)
    outs = []
    for rows, position in ((1, 0), (5, 4), (16, 9), (33, 32)):
        x = torch.randn(rows, 64)
        x[position] = row
        outs.append(linear_rows_reference(x, w, (16,))[position])
    assert all(torch.equal(o, outs[0]) for o in outs)


CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter has no bfloat16 dot"
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=CUDA_ONLY)])
def test_linear_triton_matches_reference(dtype):
    """The Triton kernel computes x @ W.T for ragged row, column and K counts."""
    x = torch.randn(70, 45, device=DEVICE).to(dtype)
    w = torch.randn(66, 45, device=DEVICE).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        linear_rows_triton(x, w).float(), (x.float() @ w.float().T), atol=tol * 10, rtol=tol
    )


@needs_triton
def test_linear_triton_row_invariant():
    """A row's bits do not depend on the number of rows, its neighbours or its position.

    Bitwise on CUDA, where the kernel fixes each element's arithmetic. Triton's interpreter
    runs ``tl.dot`` as a numpy matmul of the whole tile, and numpy's BLAS may round a row by
    where it sits in the tile (OpenBLAS's Haswell kernels do): there the kernel cannot
    promise bits, so the rows agree to float32 rounding of a 40-term dot product (torch's
    float32 tolerances; 1e-6 failed once on a Haswell-kernel run)."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(50, 40, generator=generator).to(DEVICE)
    row = torch.randn(40, generator=generator).to(DEVICE)
    outs = []
    for rows, position in ((1, 0), (3, 2), (64, 10), (130, 129)):
        x = torch.randn(rows, 40, generator=generator).to(DEVICE)
        x[position] = row
        outs.append(linear_rows_triton(x, w)[position])
    for out in outs[1:]:
        if DEVICE == "cuda":
            assert torch.equal(out, outs[0])
        else:
            torch.testing.assert_close(out, outs[0])


@needs_triton
@pytest.mark.parametrize("cols, depth", [(50, 200), (576, 96)])
def test_linear_3xtf32_is_float32_accurate(cols, depth):
    """The fixed-configuration 3xTF32 GEMM computes x @ W.T to float32 rounding of the
    float64 product, at a split of K (50 columns) and ragged row counts."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(70, depth, generator=generator).to(DEVICE)
    w = torch.randn(cols, depth, generator=generator).to(DEVICE)
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(linear_rows_3xtf32(x, w), want, atol=1e-4, rtol=1e-5)


def test_linear_3xtf32_config_ignores_the_row_count():
    """One configuration per weight shape: fp32_linear's at the decode-sized row count,
    whatever a call's rows (fp32_linear.blocks itself picks by rows; this must not)."""
    for cols, depth in ((192, 576), (576, 576), (1536, 576), (49152, 576)):
        config = config_3xtf32(cols, depth)
        assert config == fp32_linear.blocks(INVARIANT_ROWS, cols, depth)
    assert config_3xtf32(192, 576)[5] > 1  # a split K: its sum order must not move either


def test_linear_3xtf32_takes_float32_only():
    """bfloat16 or float16 inputs are refused by name (the split is float32's)."""
    with pytest.raises(ValueError, match="float32"):
        linear_rows_3xtf32(
            torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
        )


@needs_triton
@pytest.mark.parametrize("cols, depth", [(50, 96), (200, 64)])
def test_linear_3xtf32_row_invariant(cols, depth):
    """A row's bits do not depend on the number of rows (1 to 700: a decode step to a
    prefill), its neighbours or its place in a tile, with K split in two ranges (K 96: two
    64-wide steps) or not (K 64: one step).

    Bitwise on CUDA, where a tensor-core product treats every row of a tile alike; in
    Triton's interpreter ``tl.dot`` is numpy's BLAS, which may round a row by its place
    (see test_linear_triton_row_invariant), so there the rows agree to float32 rounding."""
    assert fp32_linear.split_depth(
        depth, config_3xtf32(cols, depth)[2], config_3xtf32(cols, depth)[5]
    )[0] == (2 if depth > 64 else 1)
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(cols, depth, generator=generator).to(DEVICE)
    row = torch.randn(depth, generator=generator).to(DEVICE)
    outs = []
    for rows, position in ((1, 0), (3, 2), (64, 10), (130, 129), (700, 333)):
        x = torch.randn(rows, depth, generator=generator).to(DEVICE)
        x[position] = row
        outs.append(linear_rows_3xtf32(x, w)[position])
    for out in outs[1:]:
        if DEVICE == "cuda":
            assert torch.equal(out, outs[0])
        else:
            torch.testing.assert_close(out, outs[0])


@pytest.mark.parametrize("rows_per_call", [1, 4])
def test_attention_reference_matches_softmax_attention(rows_per_call):
    """Blocked online softmax = plain masked softmax attention (GQA, dropped slots)."""
    k, v, valid = _cache()
    q = torch.randn(7, 4, 16)
    cache_row = torch.tensor([0, 1, 2, 0, 1, 2, 1])
    slot = torch.tensor([0, 5, 63, 40, 33, 31, 32])
    scale = 1 / math.sqrt(16)
    got = attention_rows_reference(q, k, v, valid, cache_row, slot, scale, rows_per_call)
    torch.testing.assert_close(
        got, _dense_attention(q, k, v, valid, cache_row, slot, scale), atol=1e-5, rtol=1e-5
    )


def test_attention_reference_row_invariant():
    """A query's bits do not depend on the rows beside it or the longest one among them."""
    k, v, valid = _cache(length=128)
    q0 = torch.randn(1, 4, 16)
    alone = attention_rows_reference(
        q0, k, v, valid, torch.tensor([1]), torch.tensor([20]), 0.25, 4
    )
    q = torch.cat([torch.randn(2, 4, 16), q0, torch.randn(3, 4, 16)])
    crowd = attention_rows_reference(
        q,
        k,
        v,
        valid,
        torch.tensor([0, 2, 1, 1, 0, 2]),
        torch.tensor([127, 90, 20, 100, 3, 64]),
        0.25,
        4,
    )
    assert torch.equal(crowd[2], alone[0])


def test_attention_reference_needs_whole_key_blocks():
    """The cache length must be a multiple of the key block."""
    k, v, valid = _cache(length=BLOCK_N + 1)
    with pytest.raises(ValueError, match="multiple"):
        attention_rows_reference(
            torch.randn(1, 4, 16), k, v, valid, torch.tensor([0]), torch.tensor([0]), 1.0
        )


@needs_triton
@pytest.mark.parametrize("dim", [16, 24])
def test_attention_triton_matches_reference(dim):
    """The Triton kernel computes plain attention (GQA, dropped slots, any slot, any dim)."""
    k, v, valid = (t.to(DEVICE) for t in _cache(kv_heads=3, length=96, dim=dim))
    q = torch.randn(5, 9, dim, device=DEVICE)  # 3 query heads per kv head (padded to 4)
    cache_row = torch.tensor([0, 1, 2, 2, 0], device=DEVICE)
    slot = torch.tensor([0, 31, 32, 95, 50], device=DEVICE)
    got = attention_rows_triton(q, k, v, valid, cache_row, slot, 0.25)
    want = _dense_attention(
        q.cpu(), k.cpu(), v.cpu(), valid.cpu(), cache_row.cpu(), slot.cpu(), 0.25
    )
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_attention_triton_row_invariant():
    """A query's bits do not depend on the other rows or on the cache length."""
    k, v, valid = (t.to(DEVICE) for t in _cache(length=64))
    q0 = torch.randn(1, 4, 16, device=DEVICE)
    one = torch.tensor([1], device=DEVICE)
    alone = attention_rows_triton(q0, k, v, valid, one, one * 40, 0.25)
    longer = [torch.cat([t, torch.randn_like(t)], dim=2) for t in (k, v)]
    wide_valid = torch.cat([valid, torch.ones_like(valid)], dim=1)
    q = torch.cat([torch.randn(3, 4, 16, device=DEVICE), q0])
    crowd = attention_rows_triton(
        q,
        *longer,
        wide_valid,
        torch.tensor([0, 2, 2, 1], device=DEVICE),
        torch.tensor([127, 3, 64, 40], device=DEVICE),
        0.25,
    )
    assert torch.equal(crowd[3], alone[0])


def _hf_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_reference_matches_llama_formula():
    """The blocked reference is LlamaRMSNorm, padding rows dropped."""
    x, w = torch.randn(11, 40), torch.rand(40)
    torch.testing.assert_close(rms_norm_rows_reference(x, w, 1e-5, 4), _hf_rms_norm(x, w, 1e-5))


@needs_triton
def test_rms_norm_triton_matches_and_is_row_invariant():
    """The Triton norm computes LlamaRMSNorm; a row's bits ignore the other rows."""
    w, row = torch.rand(40, device=DEVICE), torch.randn(40, device=DEVICE)
    outs = []
    for rows, position in ((1, 0), (7, 3), (130, 129)):
        x = torch.randn(rows, 40, device=DEVICE)
        x[position] = row
        got = rms_norm_rows_triton(x, w, 1e-5)
        torch.testing.assert_close(got, _hf_rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
        outs.append(got[position])
    assert all(torch.equal(o, outs[0]) for o in outs)
