"""Tests for trace_replay.kernels.fp32_linear: float32 linear layers on tensor cores (3xTF32)
are as close to the float64 product as float32 FMAs, in the static backend too."""

import pytest
import torch

from trace_replay._triton import use_triton
from trace_replay.kernels.fp32_linear import blocks, fp32_linear, launch


def error_from_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> float:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.parametrize("rows, depth, cols, bias", [
    (64, 576, 192, False),  # SmolLM2's k/v at a decode step of 64 rows
    (9, 100, 70, True),  # nothing a multiple of a block; Qwen2's q/k/v carry a bias
    (1, 40, 33, True),  # one row
])
def test_kernel_is_as_close_to_float64_as_float32(device, rows, depth, cols, bias):
    """The 3xTF32 kernel's largest error from the float64 product, relative to the largest
    output, is below 1e-6 — float32 rounding (cuBLAS's float32 on an H200: 2e-7 to 1.2e-6
    at SmolLM2's shapes); plain TF32 gives ~3e-4."""
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("without Triton the reference runs")
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, depth, generator=gen).to(device)
    weight = (torch.randn(cols, depth, generator=gen) * depth**-0.5).to(device)
    b = torch.randn(cols, generator=gen).to(device) if bias else None
    out = fp32_linear(x, weight, b)
    assert out.shape == (rows, cols) and out.dtype == torch.float32
    assert error_from_float64(out, x, weight, b) < 1e-6


def test_leading_dimensions_and_strides():
    """``[..., K]`` inputs keep their leading shape; a transposed (non-contiguous) weight
    and a sliced input give what F.linear gives."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 50, generator=gen)[..., :40]
    weight = torch.randn(40, 24, generator=gen).T
    out = fp32_linear(x, weight)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [(16, 32, 64, 4, 3), (64, 128, 32, 4, 2)])
def test_every_block_configuration_computes_the_same_product(config):
    """The launcher's block choice changes speed, not the product (within rounding)."""
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(70, 130, generator=gen), torch.randn(150, 130, generator=gen)
    torch.testing.assert_close(launch(x, weight, config=config),
                               torch.nn.functional.linear(x, weight), atol=2e-5, rtol=0)
    assert blocks(64, 576, 576)[0] == 16 and blocks(64, 49152, 576)[0] == 64


def test_other_dtypes_and_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="float32"):
        fp32_linear(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="features"):
        fp32_linear(torch.zeros(2, 4), torch.zeros(3, 5))


def test_compiled_call_is_one_operator():
    """Inside ``torch.compile(fullgraph=True)`` the kernel is one operator: no graph break."""
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = torch.randn(4, 32, generator=gen), torch.randn(8, 32, generator=gen), None
    compiled = torch.compile(fp32_linear, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, weight, bias), fp32_linear(x, weight, bias))
