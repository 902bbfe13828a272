"""Tests for trace_replay.engines.builtin.passes.compiling: the package's compiled functions may hold more
graphs than dynamo's default, a higher limit set by the user stays, and dynamo's configuration
is never left changed; the layer passes together turn a one-row half-precision layer into the
fused kernels."""

import copy
import re
import subprocess
import sys

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._inductor.utils import run_and_get_code

from trace_replay.engines.builtin.backends.static_view import kernel_layer
from trace_replay.engines.builtin.passes import compiling
from trace_replay.engines.builtin.passes.compiling import compile_function, layer_passes
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.gemv import gemv


def _compiles(compiled, shapes: int) -> None:
    for n in range(1, shapes + 1):
        assert compiled(torch.ones(n)).sum().item() == 2 * n


def test_limit_is_raised_never_lowered(monkeypatch):
    """A compiled function holds RECOMPILES graphs under a lower dynamo limit, and the
    user's limit where that is higher (here RECOMPILES is 3, so the shapes stay few)."""
    monkeypatch.setattr(compiling, "RECOMPILES", 3)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = compile_function(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
        _compiles(compiled, 3)
        with pytest.raises(FailOnRecompileLimitHit):
            compiled(torch.ones(4))
    with torch._dynamo.config.patch(recompile_limit=5):
        _compiles(
            compile_function(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False), 5
        )


def test_a_fullgraph_function_compiles_past_eight_shapes():
    """Ten shapes of one ``fullgraph=True``, ``dynamic=False`` function: with dynamo's
    default this is a hard error at the ninth. Dynamo's configuration is left as it was."""
    before = torch._dynamo.config.get_config_copy()
    with torch._dynamo.config.patch(recompile_limit=8):
        _compiles(
            compile_function(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False), 10
        )
    assert torch._dynamo.config.get_config_copy() == before


def test_importing_the_engines_leaves_the_process_as_it_was():
    """Importing the package and its engine, kernel and model modules changes neither the
    environment nor dynamo's or inductor's configuration."""
    code = """if True:
        import importlib, os, torch, torch._dynamo, torch._inductor.config
        state = lambda: (dict(os.environ), torch._dynamo.config.get_config_copy(),
                         torch._inductor.config.get_config_copy())
        before = state()
        for name in ("trace_replay", "trace_replay.engines.builtin.engine",
                     "trace_replay.engines.builtin.backends.static", "trace_replay.kernels",
                     "trace_replay.engines.builtin.scoring", "trace_replay.models.load"):
            importlib.import_module(name)
        print(state() == before)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize(
    "config, ops",
    [
        ("LlamaConfig", {"gemv_normed", "gated_gemv_normed", "gemv_add"}),
        # Gemma-2 norms the attention and MLP outputs before the residual adds
        ("Gemma2Config", {"gemv_normed", "gated_gemv_normed", "gemv", "rms_norm"}),
    ],
)
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
        out = type(module).forward(module, h, position_embeddings=cos_sin, position_ids=position)
        return out[0] if isinstance(out, tuple) else out

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda h: run(view, h), fullgraph=True, dynamic=False, options=layer_passes()
    )
    with torch.no_grad():
        ours, code = run_and_get_code(compiled, x.bfloat16())
        want, model = run(exact, x), run(layer, x.bfloat16())
    assert set(re.findall(r"trace_replay\.(\w+)\.default\(", "\n".join(code))) == ops
    model_error = (model.float() - want).abs().max()
    assert (ours.float() - want).abs().max() <= 2 * model_error + 2**-7 * want.abs().max()
