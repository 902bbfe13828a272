"""Tests for trace_replay.engines.builtin.backends.static_view: the view's kernel modules share the
model's weights and leave its modules unchanged."""

import torch

from trace_replay.engines.builtin.backends.static_view import KernelLinear, kernel_modules
from trace_replay.engines.builtin.passes.batch1_fusions import GatedMLP
from trace_replay.kernels.fp32_linear import fp32_linear


def test_kernel_linears_share_weights_and_leave_the_model(make_tiny_lm):
    """A float32 view's linear layers are the 3xTF32 kernel's, sharing the model's weights
    (the model's own modules unchanged); a layer computes what the model's layer computes."""
    lm = make_tiny_lm("Qwen2Config")  # q/k/v with a bias
    layer = lm.model.layers[0]
    view = kernel_modules(layer, fp32_linear)
    linears = [m for m in view.modules() if isinstance(m, torch.nn.Linear)]
    wrapped = [m for m in view.modules() if isinstance(m, KernelLinear)]
    assert len(wrapped) == len(linears) == 7  # each wraps one original Linear
    assert not any(isinstance(m, GatedMLP) for m in view.modules())  # the GEMV's only
    assert view.self_attn.q_proj.weight is layer.self_attn.q_proj.weight
    assert view.self_attn.q_proj.bias is layer.self_attn.q_proj.bias
    assert isinstance(layer.self_attn.q_proj, torch.nn.Linear)  # the model's own, unchanged
    assert kernel_modules(lm.model.norm, fp32_linear) is lm.model.norm  # nothing to replace
    x = torch.randn(2, 3, lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    scale = layer.mlp(x).abs().max().item()  # the tiny models' weights are large
    torch.testing.assert_close(view.mlp(x), layer.mlp(x), atol=2e-6 * scale, rtol=0)
    keys = layer.self_attn.k_proj(x)
    torch.testing.assert_close(
        view.self_attn.k_proj(x), keys, atol=2e-6 * keys.abs().max().item(), rtol=0
    )
