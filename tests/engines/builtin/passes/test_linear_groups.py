"""Tests for trace_replay.engines.builtin.passes.linear_groups: the compiled graph runs the 3xTF32 linears
(and the one-row GEMVs) that read one input in one launch, and gives what the separate
calls give."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from trace_replay.engines.builtin.passes.linear_groups import GroupLinears
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.fp32_linear import fp32_linear
from trace_replay.kernels.gemv import gemv

# a q/k/v-like trio at 5 rows of one token, K = 200: blocks() splits each 4 ways; 48 + 16 + 16 columns
COLS = (48, 16, 16)


def layer_inputs(device, cols=COLS, bias=True, seed=0):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the 3xTF32 operator runs only with Triton (TRITON_INTERPRET=1 on CPU)")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 1, 200, generator=gen).to(device)  # [rows, tokens, hidden]: reshaped
    weights = [(torch.randn(n, 200, generator=gen) * 200**-0.5).to(device) for n in cols]
    biases = (
        [torch.randn(n, generator=gen).to(device) for n in cols] if bias else [None] * len(cols)
    )
    return x, weights, biases


def projections(x, weights, biases):
    """What an attention block does: one normed input, several projections of it."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return tuple(fp32_linear(h, w, b) for w, b in zip(weights, biases))


def compiled_code(fn, *args):
    compiled = torch.compile(
        fn, fullgraph=True, dynamic=False, options={"post_grad_custom_pre_pass": GroupLinears()}
    )
    out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


def launches(code: str) -> tuple[int, int]:
    """(group launches, single launches) in inductor's generated code."""
    return (
        code.count("trace_replay.fp32_linear_group_partials.default("),
        code.count("trace_replay.fp32_linear_partials.default("),
    )


@pytest.mark.parametrize("bias", [True, False])
def test_projections_of_one_input_are_one_launch(device, bias):
    """Three projections of one input (split 4 each, with or without biases) become one
    grouped launch and no single one; each output is the eager call's within float32
    rounding (1e-6 of the largest output)."""
    x, weights, biases = layer_inputs(device, bias=bias)
    out, code = compiled_code(projections, x, weights, biases)
    assert launches(code) == (1, 0)
    for got, want in zip(out, projections(x, weights, biases)):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_more_than_three_make_a_group_and_a_single(device):
    """Four projections of one input: a group of the first three, the fourth alone."""
    x, weights, biases = layer_inputs(device, cols=(32, 16, 16, 32), bias=False)
    out, code = compiled_code(projections, x, weights, biases)
    assert launches(code) == (1, 1)
    torch.testing.assert_close(out, projections(x, weights, biases), atol=1e-5, rtol=0)


def test_different_inputs_or_bias_presence_are_not_grouped(device):
    """Calls on different inputs stay apart; so do calls of one input where one has a
    bias and the other has none (the group adds all biases or none)."""
    x, weights, biases = layer_inputs(device, cols=(32, 32), bias=True)

    def two_inputs(x, weights, biases):
        return fp32_linear(x, weights[0], biases[0]), fp32_linear(x + 1, weights[1], biases[1])

    def mixed_bias(x, weights, biases):
        return fp32_linear(x, weights[0], biases[0]), fp32_linear(x, weights[1])

    for fn in (two_inputs, mixed_bias):
        out, code = compiled_code(fn, x, weights, biases)
        assert launches(code) == (0, 2)
        torch.testing.assert_close(out, fn(x, weights, biases), atol=1e-5, rtol=0)


def test_members_that_fit_no_tile_are_not_grouped(device):
    """Members whose first columns no BLOCK_N of 16 or more divides (40 + 24 columns) stay
    single launches: a tile would straddle two weights."""
    x, weights, biases = layer_inputs(device, cols=(40, 24), bias=False)
    out, code = compiled_code(projections, x, weights, biases)
    assert launches(code) == (0, 2)
    torch.testing.assert_close(out, projections(x, weights, biases), atol=1e-5, rtol=0)


def test_one_row_half_precision_projections_are_one_gemv_launch(device):
    """At one bfloat16 row the GEMV calls of one input group the same way: q/k/v-like
    projections with biases are one ``gemv_group`` launch, each output the single call's
    within bfloat16 rounding."""
    x, weights, biases = layer_inputs(device)
    x, weights, biases = (
        x[:1].bfloat16(),
        [w.bfloat16() for w in weights],
        [b.bfloat16() for b in biases],
    )

    def half_projections(x, weights, biases):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return tuple(gemv(h, w, b) for w, b in zip(weights, biases))

    out, code = compiled_code(half_projections, x, weights, biases)
    assert (
        code.count("trace_replay.gemv_group.default("),
        code.count("trace_replay.gemv.default("),
    ) == (1, 0)
    for got, want in zip(out, half_projections(x, weights, biases)):
        assert got.shape == want.shape == (1, 1, want.shape[-1])
        torch.testing.assert_close(
            got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=0
        )
