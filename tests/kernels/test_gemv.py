"""Tests for trace_replay.kernels.gemv: the one-row half-precision linear is F.linear up to
the output dtype's rounding, for single weights and groups, and hands other shapes to
F.linear."""

import pytest
import torch
import torch.nn.functional as F

from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.gemv import MAX_ROWS, blocks, gemv, launch, runs
from trace_replay.kernels.rms_norm import Norm, rms_norm_reference


def operands(device, depth, cols, dtype=torch.bfloat16, bias=True, rows=1, seed=0):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the kernel runs only with Triton (TRITON_INTERPRET=1 on CPU)")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(device, dtype)
    weights = [(torch.randn(n, depth, generator=gen) * depth**-0.5).to(device, dtype) for n in cols]
    biases = [torch.randn(n, generator=gen).to(device, dtype) for n in cols] if bias else None
    return x, weights, biases


def assert_rounded_product(out, x, weights, biases):
    """``out`` is the float32 product of the same half-precision operands (``x`` may be
    float32 already), rounded once to the output dtype: within 2^-7 of each value (a
    rounding is at most 2^-8 relative, plus float32 accumulation) and 1e-3 of the
    largest."""
    want = torch.cat(
        [
            F.linear(x.float(), w.float(), None if biases is None else b.float())
            for w, b in zip(weights, biases or [None] * len(weights))
        ],
        dim=1,
    )
    assert out.dtype == weights[0].dtype and out.shape == want.shape
    slack = want.abs() * 2**-7 + 1e-3 * want.abs().max()
    assert ((out.float() - want).abs() <= slack).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "depth, cols, bias",
    [
        (1024, 64, False),  # K a whole number of blocks: the unmasked loop
        (200, 37, True),  # neither K nor N a multiple of a block
    ],
)
def test_one_weight_is_the_rounded_product(device, dtype, depth, cols, bias):
    x, weights, biases = operands(device, depth, [cols], dtype, bias)
    assert_rounded_product(launch(x, weights, biases), x, weights, biases)


@pytest.mark.parametrize("cols", [(48, 16, 16), (40, 24), (6, 9, 4)])
def test_a_group_puts_each_product_in_its_columns(device, cols):
    """Two or three weights in one launch: each member's product with its bias lies in its
    own columns, also where the tile narrows so that members start on one (6 + 9 + 4)."""
    x, weights, biases = operands(device, 300, cols)
    assert_rounded_product(launch(x, weights, biases), x, weights, biases)
    assert_rounded_product(launch(x, weights, None), x, weights, None)


def test_several_rows_and_configs(device):
    """The kernel itself takes any number of rows and block configuration."""
    x, weights, biases = operands(device, 256, [40], rows=3)
    for config in [(4, 64, 2), (8, 128, 4), (16, 32, 1)]:
        assert_rounded_product(launch(x, weights, biases, config=config), x, weights, biases)
    with pytest.raises(ValueError, match="BLOCK_N"):
        launch(x, [weights[0][:6], weights[0][:6]], config=(4, 64, 2))


def test_gemv_takes_the_kernel_at_one_row_only(device):
    """``gemv`` runs the kernel for one half-precision row (any leading shape) and is
    ``F.linear`` itself for more rows or float32."""
    x, weights, biases = operands(device, 96, [24])
    one = x.reshape(1, 1, 96)
    assert runs(one, weights[0]) and MAX_ROWS == 1
    out = gemv(one, weights[0], biases[0])
    assert out.shape == (1, 1, 24)
    assert_rounded_product(out.reshape(1, 24), x, weights, biases)
    many = torch.cat([x, x, x]).reshape(3, 1, 96)
    assert not runs(many, weights[0])
    assert torch.equal(gemv(many, weights[0], biases[0]), F.linear(many, weights[0], biases[0]))
    wide = x.float()
    assert not runs(wide, weights[0].float())


def test_blocks_divide_the_depth_where_they_can():
    """``BLOCK_K`` is the largest of 1,024, 512, 256 that divides K (no masked step)."""
    assert blocks(4096, 4096)[1] == 1024
    assert blocks(4096, 3584)[1] == 512  # Qwen2.5-7B's hidden size
    assert blocks(4096, 576)[1] == 1024  # no such divisor: masked
    assert blocks(28672, 4096) == (8, 256, 2)  # a wide output


@pytest.mark.parametrize("depth", [1024, 200])  # the unmasked and the masked loop
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_normed_launch_is_the_product_of_the_float32_norm(device, depth, offset):
    """With ``norm`` the launch multiplies the RMSNorm of x (Llama's weight, Gemma's
    1 + weight), computed in float32 inside the kernel, and rounds once; ``residual`` is
    added before that rounding."""
    x, weights, biases = operands(device, depth, [16, 8])
    gen = torch.Generator().manual_seed(1)
    g = (1 + 0.3 * torch.randn(depth, generator=gen)).to(device, x.dtype)
    norm = Norm(g, 1e-5, offset)
    normed = rms_norm_reference(x.float(), Norm(g.float(), 1e-5, offset))
    assert_rounded_product(launch(x, weights, biases, norm=norm), normed, weights, biases)
    residual = torch.randn(1, 24, generator=gen).to(device, x.dtype)
    want = (
        torch.cat([F.linear(normed, w.float(), b.float()) for w, b in zip(weights, biases)], dim=1)
        + residual.float()
    )
    out = launch(x, weights, biases, norm=norm, residual=residual)
    assert ((out.float() - want).abs() <= want.abs() * 2**-7 + 1e-3 * want.abs().max()).all()
    with pytest.raises(ValueError, match="residual"):
        launch(x, weights, biases, residual=residual[:, :8])
