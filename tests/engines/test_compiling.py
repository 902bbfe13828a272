"""Tests for trace_replay.engines.builtin.passes.compiling: the package's compiled functions may hold more
graphs than dynamo's default, and a higher limit set by the user stays; the layer passes
together turn a one-row half-precision layer into the fused kernels."""

import copy
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from trace_replay.kernels._triton import use_triton
from trace_replay.engines.builtin.passes.compiling import RECOMPILES, allow_recompiles, layer_passes
from trace_replay.engines.builtin.passes.kernel_view import kernel_layer
from trace_replay.kernels.gemv import gemv


def test_limit_is_raised_never_lowered():
    with torch._dynamo.config.patch(recompile_limit=8):
        allow_recompiles()
        assert torch._dynamo.config.recompile_limit == RECOMPILES
    with torch._dynamo.config.patch(recompile_limit=1000):
        allow_recompiles()
        assert torch._dynamo.config.recompile_limit == 1000


def test_a_fullgraph_function_compiles_past_eight_shapes():
    """Ten shapes of one ``fullgraph=True``, ``dynamic=False`` function: with dynamo's
    default this is a hard error at the ninth."""
    with torch._dynamo.config.patch(recompile_limit=8):
        allow_recompiles()
        compiled = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True,
                                 dynamic=False)
        for n in range(1, 11):
            assert compiled(torch.ones(n)).sum().item() == 2 * n


@pytest.mark.parametrize("config, ops", [
    ("LlamaConfig", {"gemv_normed", "gated_gemv_normed", "gemv_add"}),
    # Gemma-2 norms the attention and MLP outputs before the residual adds
    ("Gemma2Config", {"gemv_normed", "gated_gemv_normed", "gemv", "rms_norm"}),
])
def test_a_one_row_layer_compiles_to_the_fused_kernels(make_tiny_lm, config, ops):
    """A bfloat16 decoder layer's view at one row, compiled with ``layer_passes``: the input
    norm runs inside the q/k/v launch, the MLP's norm inside the gated launch, and (Llama)
    the residual adds inside the o and down GEMVs; no other package operator is left. Its
    output is the float32 layer's within twice the model's own bfloat16 error plus a
    bfloat16 step of the largest value."""
    if not use_triton(torch.empty(0)):
        pytest.skip("the kernels run only with Triton (TRITON_INTERPRET=1 on CPU)")
    lm = make_tiny_lm(config, attn_implementation="eager")
    exact = copy.deepcopy(lm.model.layers[0])
    rotary = copy.deepcopy(lm.model.rotary_emb)
    layer = lm.to(torch.bfloat16).model.layers[0]
    view = kernel_layer(layer, gemv)
    x = torch.randn(1, 1, lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position = torch.tensor([[3]])

    def run(module, h):
        cos_sin = (rotary if h.dtype == torch.float32 else lm.model.rotary_emb)(h, position)
        out = type(module).forward(module, h, position_embeddings=cos_sin,
                                   position_ids=position)
        return out[0] if isinstance(out, tuple) else out

    torch._dynamo.reset()
    compiled = torch.compile(lambda h: run(view, h), fullgraph=True, dynamic=False,
                             options=layer_passes())
    with torch.no_grad():
        ours, code = run_and_get_code(compiled, x.bfloat16())
        want, model = run(exact, x), run(layer, x.bfloat16())
    assert set(re.findall(r"trace_replay\.(\w+)\.default\(", "\n".join(code))) == ops
    model_error = (model.float() - want).abs().max()
    assert (ours.float() - want).abs().max() <= 2 * model_error + 2**-7 * want.abs().max()
