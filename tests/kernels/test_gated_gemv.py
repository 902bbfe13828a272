"""Tests for trace_replay.kernels.gated_gemv: the one-row gated product
``act(x Wg^T) * (x Wu^T)`` is its float32 value rounded once, for both activations, with and
without biases, and hands other shapes to the pure-torch form."""

import pytest
import torch
import torch.nn.functional as F

from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.gated_gemv import blocks, gated_gemv, gated_gemv_reference, launch, runs
from trace_replay.kernels.gemv import blocks as gemv_blocks
from trace_replay.kernels.rms_norm import Norm, rms_norm_reference


def operands(device, depth, cols, dtype=torch.bfloat16, bias=False, rows=1, seed=0):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the kernel runs only with Triton (TRITON_INTERPRET=1 on CPU)")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(device, dtype)
    gate, up = (
        (torch.randn(cols, depth, generator=gen) * 2 * depth**-0.5).to(device, dtype)
        for _ in range(2)
    )
    biases = (
        [torch.randn(cols, generator=gen).to(device, dtype) for _ in range(2)]
        if bias
        else [None, None]
    )
    return x, gate, up, biases


def float32_value(x, gate, up, biases, act):
    """The gated product of the same operands, in float32 throughout."""
    g = F.linear(x.float(), gate.float(), None if biases[0] is None else biases[0].float())
    u = F.linear(x.float(), up.float(), None if biases[1] is None else biases[1].float())
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def assert_rounded(out, want, dtype):
    """Within one rounding to ``dtype`` of each value (2^-8 relative for bfloat16) plus
    float32 accumulation (1e-4 of the largest value)."""
    assert out.dtype == dtype and out.shape == want.shape
    slack = want.abs() * 2 * torch.finfo(dtype).eps + 1e-4 * want.abs().max()
    assert ((out.float() - want).abs() <= slack).all(), (out.float() - want).abs().max()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "depth, cols, bias",
    [
        (1024, 64, False),  # K a whole number of blocks: the unmasked loop
        (200, 37, True),  # neither K nor N a multiple of a block
    ],
)
def test_one_row_is_the_rounded_float32_value(device, act, dtype, depth, cols, bias):
    x, gate, up, biases = operands(device, depth, cols, dtype, bias)
    out = launch(x, gate, up, *biases, act)
    assert_rounded(out, float32_value(x, gate, up, biases, act), dtype)


def test_the_model_s_rounding_is_within_the_dtype_of_the_kernel(device):
    """The model's own bfloat16 computation (three roundings) and the kernel's (one) agree
    to a few bfloat16 roundings; the kernel is the closer to float32."""
    x, gate, up, biases = operands(device, 512, 96)
    want = float32_value(x, gate, up, biases, "silu")
    ours = launch(x, gate, up, act="silu").float()
    model = gated_gemv_reference(x, gate, up, act="silu").float()
    assert ((ours - model).abs() <= want.abs() * 2**-6 + 1e-3 * want.abs().max()).all()
    assert (ours - want).abs().sum() <= (model - want).abs().sum()


def test_several_rows_and_configs(device):
    """The kernel itself takes any number of rows and block configuration."""
    x, gate, up, biases = operands(device, 256, 40, rows=3, bias=True)
    want = float32_value(x, gate, up, biases, "gelu_tanh")
    for config in [(2, 64, 2), (8, 128, 4), (16, 32, 1)]:
        assert_rounded(
            launch(x, gate, up, *biases, "gelu_tanh", config=config), want, torch.bfloat16
        )


def test_gated_gemv_takes_the_kernel_at_one_row_only(device):
    """One half-precision row (any leading shape) runs the kernel; more rows or float32 are
    the pure-torch form itself."""
    x, gate, up, biases = operands(device, 96, 24)
    one = x.reshape(1, 1, 96)
    assert runs(one, gate)
    out = gated_gemv(one, gate, up, act="silu")
    assert out.shape == (1, 1, 24)
    assert_rounded(out.reshape(1, 24), float32_value(x, gate, up, biases, "silu"), x.dtype)
    many = torch.cat([x, x]).reshape(2, 1, 96)
    assert not runs(many, gate)
    assert torch.equal(gated_gemv(many, gate, up), gated_gemv_reference(many, gate, up))


def test_bad_arguments_are_refused():
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="act="):
        gated_gemv_reference(torch.zeros(1, 8), w, w, act="relu")
    with pytest.raises(ValueError, match="differ in shape"):
        gated_gemv_reference(torch.zeros(1, 8), w, torch.zeros(5, 8))
    with pytest.raises(ValueError, match="both or neither"):
        gated_gemv_reference(torch.zeros(1, 8), w, w, torch.zeros(4))


def test_blocks_read_as_many_bytes_per_program_as_the_grouped_gemv():
    """A program reads ``BLOCK_N`` rows of each of two weights: twice ``BLOCK_N`` rows in
    all, as many as the grouped GEMV's tile over both; with the norm inside, the swept
    (2, 256, 1)."""
    for cols, depth in [(14336, 4096), (18944, 3584), (1536, 576)]:
        block_n, block_k, warps = blocks(cols, depth)
        assert (2 * block_n, block_k, warps) == gemv_blocks(2 * cols, depth)
        assert blocks(cols, depth, normed=True) == (2, 256, 1)


# σ(z) of a very negative z: exp(-z) is inf in the interpreter's numpy, and 1 / inf the
# exact 0 the GPU gives too
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("depth", [1024, 200])  # the unmasked and the masked loop
@pytest.mark.parametrize("act, offset", [("silu", 0.0), ("gelu_tanh", 1.0)])
def test_a_normed_launch_gates_the_float32_norm(device, depth, act, offset):
    """With ``norm`` the kernel norms x in float32 itself (Llama's weight, Gemma's
    1 + weight) before both products; the result is the float32 value rounded once."""
    x, gate, up, biases = operands(device, depth, 24, bias=True)
    g = 1 + 0.3 * torch.randn(depth, generator=torch.Generator().manual_seed(1))
    g = g.to(device, x.dtype)
    normed = rms_norm_reference(x.float(), Norm(g.float(), 1e-5, offset))
    out = launch(x, gate, up, *biases, act, norm=Norm(g, 1e-5, offset))
    assert_rounded(out, float32_value(normed, gate, up, biases, act), x.dtype)
