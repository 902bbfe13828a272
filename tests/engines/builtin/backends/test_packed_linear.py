"""The static backend's CPU product: oneDNN linears over weights packed once
(``engines/builtin/backends/packed_linear.py``)."""

from __future__ import annotations

import pytest
import torch

from trace_replay.engines.builtin.backends.packed_linear import (
    PackedLinears,
    packed_copy_fits,
    packed_linears_available,
)

pytestmark = pytest.mark.skipif(
    not packed_linears_available(torch.float32), reason="this torch has no oneDNN weight packing"
)


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_product_is_the_float64_linear_to_float32_rounding(rows):
    """Any number of rows and leading dims, with and without bias: the product is the float64
    ``x @ W.T + b`` within float32 rounding of a 256-term sum."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 256, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, rows, 256, generator=gen)
    product = PackedLinears()
    for b in (bias, None):
        expected = x.double() @ weight.double().T + (0 if b is None else b.double())
        out = product(x, weight, b)
        assert out.shape == (2, rows, 96) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, atol=5e-5, rtol=0)


def test_weights_edited_in_place_are_packed_again():
    """A weight changed in place after its first product is multiplied as it is now."""
    weight = torch.randn(32, 64)
    x = torch.randn(3, 64)
    product = PackedLinears()
    product(x, weight)
    with torch.no_grad():
        weight.mul_(-2.0)
    torch.testing.assert_close(product(x, weight), x @ weight.T, atol=1e-4, rtol=0)


def test_the_packed_copy_fits_in_half_the_available_memory(tiny_llama):
    """The packed copies (every linear weight once, tied ones once, and the grouped q/k/v
    and gate/up weights a second time) must take at most half the memory available: the
    machine's now for a tiny model, and not a byte more in the boundary cases."""
    weights = {m.weight for m in tiny_llama.modules() if isinstance(m, torch.nn.Linear)}
    grouped = {
        getattr(part, name).weight
        for layer in tiny_llama.model.layers
        for part, names in ((layer.self_attn, "qkv"), (layer.mlp, ("gate", "up")))
        for name in (f"{n}_proj" for n in names)
    }
    size = sum(w.numel() * w.element_size() for w in [*weights, *grouped])
    assert packed_copy_fits(tiny_llama)
    assert packed_copy_fits(tiny_llama, available=2 * size)
    assert not packed_copy_fits(tiny_llama, available=2 * size - 2)
