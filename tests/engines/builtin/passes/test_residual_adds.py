"""Tests for trace_replay.engines.builtin.passes.residual_adds: a compiled residual add after a one-row GEMV
runs inside the GEMV's launch and gives the float32 sum rounded once; adds it cannot take
stay as they are."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from trace_replay.engines.builtin.passes.compiling import layer_passes
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.gemv import gemv


def operands(device, seed=0):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the GEMV runs only with Triton (TRITON_INTERPRET=1 on CPU)")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 96, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(64, 96, generator=gen) * 96**-0.5).to(device, torch.bfloat16)
    residual = torch.randn(1, 1, 64, generator=gen).to(device, torch.bfloat16)
    return x, weight, residual


def compiled_code(fn, *args):
    torch._dynamo.reset()  # each test's function compiles afresh
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=layer_passes())
    out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


@pytest.mark.parametrize("order, bias", [("residual first", False), ("product first", True)])
def test_an_add_after_the_gemv_is_folded_into_it(device, order, bias):
    """``r + gemv(x)`` (as a decoder layer writes it) and ``gemv(x) + r`` each compile to one
    ``gemv_add`` and no plain GEMV (with the projection's bias, if any); the result is the
    float32 sum rounded once: within one
    bfloat16 step of each value (2^-7 relative: Triton's interpreter may truncate where the
    GPU rounds to nearest) plus float32 accumulation."""
    x, weight, residual = operands(device)
    b = torch.linspace(-1, 1, 64).to(device, torch.bfloat16) if bias else None

    def layer(x, weight, residual):
        product = gemv(x, weight, b)
        return residual + product if order == "residual first" else product + residual

    out, code = compiled_code(layer, x, weight, residual)
    assert code.count("trace_replay.gemv_add.default(") == 1
    assert "trace_replay.gemv.default(" not in code
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()) + residual.float()
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert ((out.float() - want).abs() <= want.abs() * 2**-7 + 1e-4 * want.abs().max()).all()


def test_adds_it_cannot_take_stay(device):
    """The add stays where the product has another use, where the other operand broadcasts,
    or where it has another dtype; the results are the eager ones."""
    x, weight, residual = operands(device)

    def reused(x, weight, residual):
        product = gemv(x, weight)
        return residual + product, product * 2

    def broadcast(x, weight, residual):
        return gemv(x, weight) + residual[..., :1]

    def wider(x, weight, residual):
        return gemv(x, weight) + residual.float()

    for fn in (reused, broadcast, wider):
        out, code = compiled_code(fn, x, weight, residual)
        assert "gemv_add" not in code and "trace_replay.gemv.default(" in code, fn.__name__
        torch.testing.assert_close(out, fn(x, weight, residual), atol=2e-2, rtol=2e-2)
