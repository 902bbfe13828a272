"""Tests for trace_replay.engines.builtin.passes.batch1_fusions: the batch-1 fusions apply to a gated MLP
and a layer's own norms with the GEMV only, are their float32 values to bfloat16 rounding at one
row and the model's own computation at more rows; ``fusions=False`` turns views and passes off."""

import copy

import pytest
import torch

from trace_replay.engines.builtin.backends.static_view import kernel_layer
from trace_replay.engines.builtin.passes.batch1_fusions import (
    GatedMLP,
    KernelRMSNorm,
    gated_activation,
)
from trace_replay.engines.builtin.passes.compiling import layer_passes
from trace_replay.kernels._triton import use_triton
from trace_replay.kernels.fp32_linear import fp32_linear
from trace_replay.kernels.gemv import gemv


def test_fusions_false_turns_the_fusions_off(make_tiny_lm):
    """With ``fusions=False`` a GEMV view has neither GatedMLP nor KernelRMSNorm (its norms
    and MLP are the model's own, on kernel linears) and the layer compiles with the linear
    groups only; by default both modules are there and the residual-add pass follows
    inductor's."""
    layer = make_tiny_lm("LlamaConfig").to(torch.bfloat16).model.layers[0]
    fused = {type(m).__name__ for m in kernel_layer(layer, gemv).modules()}
    assert {"GatedMLP", "KernelRMSNorm"} <= fused
    assert "post_grad_custom_post_pass" in layer_passes()
    plain = {type(m).__name__ for m in kernel_layer(layer, gemv, fusions=False).modules()}
    assert not {"GatedMLP", "KernelRMSNorm"} & plain and "KernelLinear" in plain
    assert "post_grad_custom_post_pass" not in layer_passes(fusions=False)


@pytest.mark.parametrize("config, act", [("LlamaConfig", "silu"), ("GemmaConfig", "gelu_tanh")])
def test_a_gated_mlp_at_one_row_is_one_launch(make_tiny_lm, monkeypatch, config, act):
    """With the GEMV, a Llama or Gemma MLP becomes a GatedMLP of the model's activation. At
    one bfloat16 row it runs one gated launch and the down GEMV, and is the float32 MLP of
    the same weights within a few bfloat16 roundings (the model's own bfloat16 MLP is no
    closer); at three rows it is the model's MLP exactly."""
    if not use_triton(torch.empty(0)):
        pytest.skip("the kernels run only with Triton (TRITON_INTERPRET=1 on CPU)")
    from trace_replay.kernels import gated_gemv as gated_module

    calls = []
    launch = gated_module.launch
    monkeypatch.setattr(
        gated_module, "launch", lambda *args, **kw: calls.append(args[-1]) or launch(*args, **kw)
    )
    lm = make_tiny_lm(config)
    exact = copy.deepcopy(lm.model.layers[0].mlp)  # float32
    layer = lm.to(torch.bfloat16).model.layers[0]
    view = kernel_layer(layer, gemv)
    assert isinstance(view.mlp, GatedMLP) and view.mlp.act == act
    assert view.mlp.mlp.gate_proj.weight is layer.mlp.gate_proj.weight
    assert type(layer.mlp).__name__.endswith("MLP")  # the model's own, unchanged
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, lm.config.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        ours = view.mlp(x)
        model = layer.mlp(x)
        want = exact(x.float())
        assert calls == [act]
        scale = want.abs().max()
        assert (ours.float() - want).abs().max() <= 2**-5 * scale
        model_error = (model.float() - want).abs().max()
        assert (ours.float() - want).abs().max() <= model_error + 2**-7 * scale
        many = torch.randn(3, 1, lm.config.hidden_size, generator=gen).bfloat16()
        assert torch.equal(view.mlp(many), layer.mlp(many))
    assert calls == [act]


def test_which_mlps_are_gated(make_tiny_lm):
    """A listed MLP class with an activation the kernel has is gated; another activation
    (ReLU, exact GELU) or a module of another class is not."""
    for hidden_act, want in [
        ("silu", "silu"),
        ("gelu_pytorch_tanh", "gelu_tanh"),
        ("relu", None),
        ("gelu", None),
    ]:
        lm = make_tiny_lm("LlamaConfig", hidden_act=hidden_act)
        assert gated_activation(lm.model.layers[0].mlp) == want, hidden_act
        assert isinstance(kernel_layer(lm.model.layers[0], gemv).mlp, GatedMLP) == (
            want is not None
        )
    lm = make_tiny_lm("LlamaConfig")
    assert gated_activation(lm.model.layers[0].self_attn) is None
    assert gated_activation(lm.model.layers[0]) is None


@pytest.mark.parametrize("config, offset", [("Qwen3Config", 0.0), ("Gemma2Config", 1.0)])
def test_a_layer_s_own_norms_run_as_one_operator_at_one_row(make_tiny_lm, config, offset):
    """With the GEMV, the layer's own RMSNorms (not Qwen3's per-head q/k norms) become
    KernelRMSNorm with the model's weight offset (Gemma: 1 + weight). At one bfloat16 row
    each is the float32 norm within a bfloat16 step; at three rows it is the model's norm
    exactly. The 3xTF32 view keeps the model's norms."""
    if not use_triton(torch.empty(0)):
        pytest.skip("the kernels run only with Triton (TRITON_INTERPRET=1 on CPU)")
    lm = make_tiny_lm(config, attn_implementation="eager")
    exact = copy.deepcopy(lm.model.layers[0])  # float32
    layer = lm.to(torch.bfloat16).model.layers[0]
    view = kernel_layer(layer, gemv)
    own = [name for name, m in layer.named_children() if type(m).__name__.endswith("RMSNorm")]
    assert own and all(isinstance(view._modules[name], KernelRMSNorm) for name in own)
    assert all(view._modules[name].offset == offset for name in own)
    assert not any(isinstance(m, KernelRMSNorm) for m in view.self_attn.modules())
    assert not any(isinstance(m, KernelRMSNorm) for m in kernel_layer(exact, fp32_linear).modules())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, lm.config.hidden_size, generator=gen).bfloat16()
    many = torch.randn(3, 1, lm.config.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        for name in own:
            want = exact._modules[name](x.float())
            got = view._modules[name](x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-5).all()
            assert torch.equal(view._modules[name](many), layer._modules[name](many))
