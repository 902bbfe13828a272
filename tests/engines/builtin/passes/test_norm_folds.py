"""Tests for trace_replay.engines.builtin.passes.norm_folds: a compiled RMSNorm that only feeds one-row GEMVs
runs inside them (no launch of its own), and the result is the float32 norm-and-product
rounded once; a norm with another use stays."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from trace_replay.engines.builtin.passes.compiling import layer_passes
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.gated_gemv import gated_gemv
from trace_replay.kernels.gemv import gemv
from trace_replay.kernels.rms_norm import Norm, rms_norm, rms_norm_reference

DEPTH = 96


def operands(device, cols=(48, 16, 16), seed=0):
    if not use_triton(torch.empty(0, device=device)):
        pytest.skip("the kernels run only with Triton (TRITON_INTERPRET=1 on CPU)")
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(1, DEPTH, generator=gen)).to(device, torch.bfloat16)
    weights = [
        (torch.randn(n, DEPTH, generator=gen) * DEPTH**-0.5).to(device, torch.bfloat16)
        for n in cols
    ]
    g = (1 + 0.3 * torch.randn(DEPTH, generator=gen)).to(device, torch.bfloat16)
    return x, weights, g


def compiled_code(fn, *args):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=layer_passes())
    out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


def float32_norm(x, g, offset):
    return rms_norm_reference(x.float(), Norm(g.float(), 1e-6, offset))


def assert_rounded(out, want):
    """Within one bfloat16 step of each value (the interpreter may truncate) plus float32
    accumulation."""
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert ((out.float() - want).abs() <= want.abs() * 2**-7 + 1e-4 * want.abs().max()).all()


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_a_norm_feeding_projections_runs_inside_their_launch(device, offset):
    """Norm → q/k/v (Llama's weight, Gemma's 1 + weight): one ``gemv_normed`` launch for the
    three, no norm launch; each output is the float32 norm and product rounded once."""
    x, weights, g = operands(device)

    def attention_input(x, weights, g):
        h = rms_norm(x, Norm(g, 1e-6, offset))
        return tuple(gemv(h, w) for w in weights)

    out, code = compiled_code(attention_input, x, weights, g)
    assert code.count("trace_replay.gemv_normed.default(") == 1
    assert "trace_replay.rms_norm.default(" not in code
    assert "trace_replay.gemv_group.default(" not in code
    normed = float32_norm(x, g, offset)
    for got, w in zip(out, weights):
        assert_rounded(got, F.linear(normed, w.float()))


def test_a_norm_feeding_the_gated_mlp_runs_inside_it(device):
    x, (gate, up), g = operands(device, cols=(40, 40))

    def mlp_input(x, gate, up, g):
        return gated_gemv(rms_norm(x, Norm(g, 1e-6)), gate, up, act="silu")

    out, code = compiled_code(mlp_input, x, gate, up, g)
    assert code.count("trace_replay.gated_gemv_normed.default(") == 1
    assert "trace_replay.rms_norm.default(" not in code
    normed = float32_norm(x, g, 0.0)
    assert_rounded(out, F.silu(F.linear(normed, gate.float())) * F.linear(normed, up.float()))


def test_a_norm_with_another_use_stays(device):
    """Where the normed row is also added to something, the norm runs as its own launch
    and the GEMV reads its output; the results are the eager ones."""
    x, weights, g = operands(device, cols=(DEPTH,))

    def norm_twice_used(x, weight, g):
        h = rms_norm(x, Norm(g, 1e-6))
        return gemv(h, weight) + h

    out, code = compiled_code(norm_twice_used, x, weights[0], g)
    assert "trace_replay.rms_norm.default(" in code and "_normed" not in code
    torch.testing.assert_close(out, norm_twice_used(x, weights[0], g), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_the_norm_kernel_is_the_float32_norm_rounded_once(device, offset):
    x, _, g = operands(device)
    rows = torch.cat([x, 0.01 * x, -x])  # scale-free: each row normed on its own
    assert_rounded(rms_norm(rows, Norm(g, 1e-6, offset)), float32_norm(rows, g, offset))
