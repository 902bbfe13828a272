"""Tests for trace_replay.engines.builtin.backends.static_view: the view's kernel modules share the
model's weights and leave its modules unchanged; on the CPU, linears that read the same input
run as one packed product, whose columns are what each member's own product computes, never a
product of another input or of old weights."""

import pytest
import torch

from trace_replay.engines.builtin.backends.packed_linear import (
    GROUP_ROWS,
    PackedLinears,
    grouped_bytes,
    linear_bytes,
    packed_linears_available,
)
from trace_replay.engines.builtin.backends.static import StaticCacheBackend
from trace_replay.engines.builtin.backends.static_view import (
    FusedRMSNorm,
    GroupMember,
    KernelLinear,
    group_linears,
    kernel_modules,
)
from trace_replay.engines.builtin.passes.batch1_fusions import GatedMLP
from trace_replay.kernels.fp32_linear import fp32_linear

packing = pytest.mark.skipif(
    not packed_linears_available(torch.float32), reason="this torch has no oneDNN weight packing"
)


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


MEMBERS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _grouped_layer(layer: torch.nn.Module, packed: PackedLinears) -> torch.nn.Module:
    return group_linears(kernel_modules(layer, packed), packed)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float32 rounding of the tiny models' sums (their weights are large)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, atol=2e-6 * scale, rtol=0)


@packing
@pytest.mark.parametrize("config", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "GemmaConfig"])
def test_group_members_equal_their_own_products(make_tiny_lm, config):
    """In every supported family (Qwen2's q/k/v with a bias) q/k/v and gate/up are grouped,
    each member's output equals its own linear's to float32 rounding, the layer's output
    equals the model's layer's, and the model's modules are untouched."""
    lm = make_tiny_lm(config)
    layer = lm.model.layers[0]
    view = _grouped_layer(layer, PackedLinears())
    x = torch.randn(2, 3, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for parent, names in MEMBERS.items():
            for name in names:
                member = getattr(getattr(view, parent), name)
                assert isinstance(member, GroupMember)
                assert isinstance(getattr(getattr(layer, parent), name), torch.nn.Linear)
            outputs = [getattr(getattr(view, parent), name)(x) for name in names]
            for name, output in zip(names, outputs):
                _close(output, getattr(getattr(layer, parent), name)(x))
        _close(view.mlp(x), layer.mlp(x))
    assert not any(isinstance(m, (KernelLinear, GroupMember)) for m in lm.modules())


@packing
def test_an_edited_member_weight_is_seen_by_the_next_step(make_tiny_lm):
    """A member's weight or bias changed in place after the group was packed: the next
    decode step of the backend multiplies the edited weights (its logits equal a fresh
    backend's over the edited model)."""
    lm = make_tiny_lm("Qwen2Config")
    backend = StaticCacheBackend(lm, pad_id=0)
    prompts, token, position = [[5, 6, 7], [9, 3]], torch.tensor([[4], [8]]), [[3], [2]]
    backend.prefill(prompts, 4)
    backend.decode(token, torch.tensor(position))
    attn, mlp = lm.model.layers[1].self_attn, lm.model.layers[0].mlp
    with torch.no_grad():
        attn.v_proj.weight.mul_(-1.5)
        attn.k_proj.bias.add_(0.25)
        mlp.up_proj.weight[:, :8] = 0.0
    backend.prefill(prompts, 4)
    edited = backend.decode(token, torch.tensor(position))
    fresh = StaticCacheBackend(lm, pad_id=0)
    fresh.prefill(prompts, 4)
    _close(edited, fresh.decode(token, torch.tensor(position)))


@packing
def test_a_member_never_reads_another_input(tiny_llama):
    """A member called with another tensor, or with the same tensor changed in place (in
    inference mode, which keeps no version counter), or a second time, gets the product of
    the input it was given."""
    layer = tiny_llama.model.layers[0]
    view = _grouped_layer(layer, PackedLinears())
    attn, own = view.self_attn, layer.self_attn
    gen = torch.Generator().manual_seed(2)
    x, other = (torch.randn(1, 2, tiny_llama.config.hidden_size, generator=gen) for _ in "xy")
    with torch.inference_mode():
        attn.q_proj(x)
        _close(attn.k_proj(other), own.k_proj(other))
        attn.q_proj(x)
        x.mul_(-2.0)
        _close(attn.k_proj(x), own.k_proj(x))
        _close(attn.k_proj(x), own.k_proj(x))  # read twice
        _close(attn.v_proj(x), own.v_proj(x))


@packing
def test_unrecognized_groups_stay_separate_products():
    """Children that are not a whole group of one input width and bias presence (a missing
    member, another width, a bias on some members only) stay separate products."""
    packed = PackedLinears()

    def module(**linears: torch.nn.Linear) -> torch.nn.Module:
        parent = torch.nn.Module()
        for name, linear in linears.items():
            setattr(parent, name, linear)
        return group_linears(kernel_modules(parent, packed), packed)

    def linear(width: int, bias: bool = False) -> torch.nn.Linear:
        return torch.nn.Linear(width, 4, bias=bias)

    cases = [
        module(q_proj=linear(8), k_proj=linear(8)),
        module(gate_proj=linear(8), up_proj=linear(6)),
        module(q_proj=linear(8, True), k_proj=linear(8, True), v_proj=linear(8)),
    ]
    for case in cases:
        assert all(type(m) is KernelLinear for m in case.children())
    grouped = module(gate_proj=linear(8), up_proj=linear(8), down_proj=linear(4))
    kinds = {name: type(m) for name, m in grouped.named_children()}
    assert kinds == {"gate_proj": GroupMember, "up_proj": GroupMember, "down_proj": KernelLinear}


@packing
def test_the_packed_copies_are_what_packed_copy_fits_counts(make_tiny_lm):
    """A short prompt and a step pack every linear weight once (a group's copy replaces its
    members' own); a prompt longer than GROUP_ROWS rows adds the members' own copies: the
    packed bytes then reach ``packed_copy_fits``'s count, linear bytes plus grouped bytes."""
    lm = make_tiny_lm("LlamaConfig")
    backend = StaticCacheBackend(lm, pad_id=0)
    backend.prefill([[5, 6, 7]], 2)
    backend.decode(torch.tensor([[4]]), torch.tensor([[3]]))
    assert backend.product.nbytes == linear_bytes(lm)
    backend.prefill([list(range(3, 3 + GROUP_ROWS + 1))], 2)
    assert backend.product.nbytes == linear_bytes(lm) + grouped_bytes(lm) > linear_bytes(lm)


@packing
def test_a_long_input_runs_each_members_own_product(tiny_llama):
    """Above GROUP_ROWS rows a member's output is its own product (equal to its linear's)
    and the group's product is not computed."""
    layer = tiny_llama.model.layers[0]
    packed = PackedLinears()
    view = _grouped_layer(layer, packed)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, GROUP_ROWS + 1, tiny_llama.config.hidden_size, generator=gen)
    with torch.inference_mode():
        for name in MEMBERS["self_attn"]:
            _close(getattr(view.self_attn, name)(x), getattr(layer.self_attn, name)(x))
    assert view.self_attn.q_proj.group._output is None
    own = sum(getattr(layer.self_attn, n).weight.numel() * 4 for n in MEMBERS["self_attn"])
    assert packed.nbytes == own


@packing
def test_cpu_view_norms_are_one_operator_equal_to_the_models(make_tiny_lm):
    """The CPU view's RMSNorms without weight offset (Llama's, Qwen3's per-head ones too)
    are ``F.rms_norm`` and equal the model's to float32 rounding; Gemma's (``1 + weight``)
    stay the model's own modules."""
    gen = torch.Generator().manual_seed(3)
    for config, fused in (("Qwen3Config", True), ("GemmaConfig", False)):
        lm = make_tiny_lm(config)
        view = StaticCacheBackend(lm, pad_id=0).view
        layer, own = view.model.layers[0], lm.model.layers[0]
        assert isinstance(view.model.norm, FusedRMSNorm) == fused
        assert isinstance(layer.input_layernorm, FusedRMSNorm) == fused
        if fused:
            assert isinstance(layer.self_attn.k_norm, FusedRMSNorm)
            x = 3 * torch.randn(2, 3, lm.config.hidden_size, generator=gen)
            _close(layer.post_attention_layernorm(x), own.post_attention_layernorm(x))
            heads = torch.randn(2, 3, 4, lm.config.head_dim, generator=gen)
            _close(layer.self_attn.q_norm(heads), own.self_attn.q_norm(heads))
        assert not any(isinstance(m, FusedRMSNorm) for m in lm.modules())
