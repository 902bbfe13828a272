"""Deterministic mode's fused epilogues (trace_replay.kernels.deterministic_epilogues) and the
grouped 3xTF32 partials they read: each kernel gives its torch reference's numbers, adds a
linear's partials exactly as sum_parts does, and computes a row from that row alone."""

import pytest
import torch

import trace_replay.kernels._triton
from trace_replay.kernels import fp32_linear
from trace_replay.kernels.deterministic_epilogues import (
    residual_norm_reference,
    residual_norm_triton,
    rotary_cache_reference,
    rotary_cache_triton,
    silu_mul_reference,
    silu_mul_triton,
    sum_parts,
)
from trace_replay.kernels.deterministic_linear import (
    INVARIANT_ROWS,
    group_config_3xtf32,
    linear_parts_3xtf32,
    linear_rows_3xtf32,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not trace_replay.kernels._triton.can_launch(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before the first import",
)
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            DEVICE != "cuda", reason="bfloat16 runs on the GPU in deterministic mode"
        ),
    ),
]

HEADS, KV_HEADS, DIM = 4, 2, 16


def _parts(split: int, rows: int, cols: int, dtype: torch.dtype, seed: int = 0):
    """[split, rows, cols] partials (float32 from the GEMM; a single part holds the dtype)."""
    generator = torch.Generator().manual_seed(seed)
    parts = torch.randn(split, rows, cols, generator=generator)
    return (parts if split > 1 else parts.to(dtype)).to(DEVICE)


def _rotary_inputs(rows: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = (HEADS + 2 * KV_HEADS) * DIM
    bias = torch.randn(width, generator=generator).to(DEVICE)
    angles = torch.arange(40)[:, None] * torch.rand(DIM // 2, generator=generator)[None]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    positions = torch.randint(0, 40, (rows,), generator=generator).to(DEVICE)
    cache_row = torch.randint(0, 3, (rows,), generator=generator).to(DEVICE)
    slot = torch.randperm(64, generator=generator)[:rows].to(DEVICE)  # no two rows share one
    return bias, cos, sin, positions, cache_row, slot


def _cache(dtype):
    return (
        torch.zeros(4, KV_HEADS, 64, DIM, dtype=dtype, device=DEVICE),
        torch.zeros(4, KV_HEADS, 64, DIM, dtype=dtype, device=DEVICE),
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 3])
def test_rotary_cache_is_the_reference(split, dtype):
    """q with rotary, and k (rotary) and v in the cache at each row's (cache row, slot),
    as the torch reference computes them; v, the partials' plain sum, bitwise; nothing else
    in the cache touched."""
    rows = 9
    parts = _parts(split, rows, (HEADS + 2 * KV_HEADS) * DIM, dtype)
    bias, cos, sin, positions, cache_row, slot = _rotary_inputs(rows, dtype)
    bias = bias if split > 1 else None
    k, v = _cache(dtype)
    k_ref, v_ref = _cache(dtype)
    q = rotary_cache_triton(parts, bias, cos, sin, positions, k, v, cache_row, slot, HEADS, dtype)
    q_ref = rotary_cache_reference(
        parts, bias, cos, sin, positions, k_ref, v_ref, cache_row, slot, HEADS, dtype
    )
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(q, q_ref, **tolerance)
    torch.testing.assert_close(k, k_ref, **tolerance)
    assert torch.equal(v, v_ref)
    written = torch.zeros(4, 64, dtype=torch.bool, device=DEVICE)
    written[cache_row, slot] = True
    assert not k.transpose(1, 2)[~written].any() and not v.transpose(1, 2)[~written].any()


@needs_triton
def test_rotary_cache_refuses_a_projection_of_other_heads():
    """Partials whose width is not (H + 2 H_kv) D are refused with the numbers."""
    parts = _parts(1, 2, 5 * DIM, torch.float32)
    bias, cos, sin, positions, cache_row, slot = _rotary_inputs(2, torch.float32)
    k, v = _cache(torch.float32)
    with pytest.raises(ValueError, match="parts have 80 columns; 4 \\+ 2 x 2 heads of 16 need 128"):
        rotary_cache_triton(
            parts, None, cos, sin, positions, k, v, cache_row, slot, HEADS, torch.float32
        )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 4])
def test_residual_norm_is_the_reference(split, dtype):
    """x + out bitwise as the reference adds it (additions only), and its RMSNorm within
    rounding; a width that is not a power of two (the padded lanes must not count)."""
    rows, width = 7, 48
    parts = _parts(split, rows, width, dtype)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, width, generator=generator).to(DEVICE, dtype)
    weight = torch.rand(width, generator=generator).to(DEVICE, dtype) + 0.5
    bias = torch.randn(width, generator=generator).to(DEVICE) if split > 1 else None
    new, normed = residual_norm_triton(parts, bias, x, weight, 1e-5)
    new_ref, normed_ref = residual_norm_reference(parts, bias, x, weight, 1e-5)
    assert torch.equal(new, new_ref)
    torch.testing.assert_close(
        normed, normed_ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {})
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_reference(dtype):
    """silu(gate) * up of a gate/up projection's partials (gate's columns first), over more
    than one program of columns."""
    parts = _parts(2, 5, 2 * 1100, dtype)
    got, want = silu_mul_triton(parts, None, dtype), silu_mul_reference(parts, None, dtype)
    torch.testing.assert_close(
        got, want, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {})
    )


@needs_triton
def test_epilogues_compute_a_row_from_its_own_row():
    """A row's results are the same bits alone and among 40 other rows at another place:
    one program per row (or per block of a row), nothing shaped by the number of rows."""
    dtype, width = torch.float32, (HEADS + 2 * KV_HEADS) * DIM
    crowd = _parts(3, 41, width, dtype, seed=5)
    bias, cos, sin, positions, cache_row, slot = _rotary_inputs(41, dtype)
    x = torch.randn(41, width, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    weight = torch.linspace(0.5, 1.5, width, device=DEVICE)

    def run(rows: slice):
        parts = crowd[:, rows].contiguous()
        k, v = _cache(dtype)
        q = rotary_cache_triton(
            parts, bias, cos, sin, positions[rows], k, v, cache_row[rows], slot[rows], HEADS, dtype
        )
        b, s = int(cache_row[17]), int(slot[17])
        return (
            q,
            k[b, :, s],
            v[b, :, s],
            *residual_norm_triton(parts, bias, x[rows], weight, 1e-6),
            silu_mul_triton(parts, None, dtype),
        )

    many, one = run(slice(None)), run(slice(17, 18))
    for index in (0, 3, 4, 5):  # q, x + out, its norm, silu * up: row 17 of many, 0 of one
        assert torch.equal(many[index][17], one[index][0])
    assert torch.equal(many[1], one[1]) and torch.equal(many[2], one[2])  # its k and v


def test_sum_parts_adds_in_order_then_the_bias():
    """Partial 0, then 1, ..., then the bias, in float32, rounded to the dtype once."""
    parts = torch.tensor([[[1e8]], [[1.0]], [[-1e8]]])
    assert sum_parts(parts, None, torch.float32).item() == 0.0  # (1e8 + 1) - 1e8 in float32
    assert sum_parts(parts[:1], torch.tensor([0.5]), torch.bfloat16).dtype == torch.bfloat16


def test_group_config_is_fixed_by_shapes():
    """The grouped launch's configuration comes from the weights' shapes alone (the
    decode-sized row count), its tile width dividing each member's first column; weights
    that no width separates have none."""
    config = group_config_3xtf32([576, 192, 192], 576)
    split = fp32_linear.blocks(INVARIANT_ROWS, 960, 576)[5]
    assert config == fp32_linear.group_blocks(INVARIANT_ROWS, [576, 192, 192], 576, split)
    assert 576 % config[1] == 0 and 768 % config[1] == 0
    assert group_config_3xtf32([20, 12], 64) is None


@needs_triton
def test_grouped_parts_are_each_members_product():
    """Grouped partials summed are each weight's product (float32 accurate), side by side;
    refused for other dtypes and for members no tile width separates."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(11, 96, generator=generator).to(DEVICE)
    weights = [torch.randn(n, 96, generator=generator).to(DEVICE) for n in (64, 32, 32)]
    got = sum_parts(linear_parts_3xtf32(x, weights), None, torch.float32)
    want = torch.cat([linear_rows_3xtf32(x, w) for w in weights], dim=1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        linear_parts_3xtf32(x.bfloat16(), [w.bfloat16() for w in weights])
    odd = [torch.randn(n, 64).to(DEVICE) for n in (20, 12)]
    with pytest.raises(ValueError, match="no tile width puts every member of \\[20, 12\\]"):
        linear_parts_3xtf32(x[:, :64].contiguous(), odd)
