"""The static backend's model view: shallow copies of the model whose modules read its cache
and run the package's kernels.

The view (:func:`model_view`, built by :mod:`~trace_replay.engines.builtin.backends.static`)
shares every weight with the model and replaces modules only in shallow copies, so the model
itself is never modified:

* its attention modules select
  :func:`~trace_replay.engines.builtin.backends.static_cache.grouped_attention` and each
  decoder layer reads its own slice of the backend's cache, compiled or not
  (:class:`LayerRunner`);
* each ``nn.Linear`` becomes a :class:`KernelLinear`, whose product is
  :func:`~trace_replay.kernels.fp32_linear.fp32_linear` (float32, 3xTF32 on tensor cores)
  or :func:`~trace_replay.kernels.gemv.gemv` (half precision, one row);
* with the GEMV, the batch-1 fusions unless turned off
  (:mod:`~trace_replay.engines.builtin.passes.batch1_fusions`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from trace_replay.engines.builtin.backends.static_cache import ATTENTION
from trace_replay.engines.builtin.passes import batch1_fusions
from trace_replay.kernels.gemv import gemv

__all__ = [
    "KernelLinear",
    "LayerRunner",
    "kernel_layer",
    "kernel_modules",
    "layer_forward",
    "model_view",
    "shallow",
]


def shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy sharing parameters and buffers, whose submodules can be replaced."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


class KernelLinear(torch.nn.Module):
    """An ``nn.Linear`` (sharing its weights) whose product is one of the package's kernels."""

    def __init__(self, linear: torch.nn.Linear, product) -> None:
        super().__init__()
        self.linear, self.product = linear, product

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.linear.weight, self.linear.bias)


def kernel_modules(module: torch.nn.Module, product) -> torch.nn.Module:
    """``module``, or a shallow copy of it whose ``nn.Linear`` descendants are
    :class:`KernelLinear` of ``product`` (copies along the way; the model is untouched)."""
    if isinstance(module, torch.nn.Linear):
        return KernelLinear(module, product)
    children = {
        name: kernel_modules(child, product)
        for name, child in module._modules.items()
        if child is not None
    }
    if all(children[name] is module._modules[name] for name in children):
        clone = module
    else:
        clone = shallow(module)
        clone._modules.update(children)
    return clone


def kernel_layer(layer: torch.nn.Module, product, *, fusions: bool = True) -> torch.nn.Module:
    """A decoder layer's view: :func:`kernel_modules`, and with the GEMV and ``fusions`` the
    batch-1 fusions (:mod:`~trace_replay.engines.builtin.passes.batch1_fusions`)."""
    view = kernel_modules(layer, product)
    if product is not gemv or not fusions:
        return view
    return batch1_fusions.fuse_layer(view if view is not layer else shallow(layer), layer)


def layer_forward(layer: torch.nn.Module, hidden_states, *args, **kwargs):
    """``layer``'s class forward (what the compiled layer compiles: one code object for all)."""
    return type(layer).forward(layer, hidden_states, *args, **kwargs)


class LayerRunner:
    """A decoder layer's ``forward`` in the view: its own slice of the cache, maybe compiled.

    ``backend`` (a :class:`~trace_replay.engines.builtin.backends.static.StaticCacheBackend`)
    is read at each call: its ``cache``, whether it is ``compiling`` and its
    ``compiled_layer``.
    """

    def __init__(self, layer: torch.nn.Module, index: int, backend: Any) -> None:
        self.layer, self.index, self.backend = layer, index, backend

    def __call__(self, hidden_states, *args, past_key_values=None, **kwargs):
        cache = self.backend.cache.layer(self.index)
        run = self.backend.compiled_layer if self.backend.compiling else layer_forward
        return run(self.layer, hidden_states, *args, past_key_values=cache, **kwargs)


def model_view(lm: torch.nn.Module, backend: Any) -> torch.nn.Module:
    """The view of ``lm`` that ``backend`` runs: per its ``tensor_cores``, ``product`` and
    ``batch1_fusions`` (see the module docstring)."""
    # transformers' modules, read and patched duck-typed (attention, layers, their forward)
    config: Any = copy.copy(lm.config)
    config._attn_implementation = ATTENTION
    view: Any = shallow(lm)
    decoder: Any = lm.model
    view.model = shallow(decoder)
    layers = []
    for index, original in enumerate(decoder.layers):
        layer: Any = shallow(original)
        layer.self_attn = shallow(layer.self_attn)
        layer.self_attn.config = config
        if backend.tensor_cores:
            layer.self_attn.float32_dots = "tf32x3"  # read by grouped_attention
        if backend.product is not None:
            layer = kernel_layer(layer, backend.product, fusions=backend.batch1_fusions)
        layer.forward = LayerRunner(layer, index, backend)
        layers.append(layer)
    view.model.layers = torch.nn.ModuleList(layers)
    if backend.product is not None and isinstance(lm.lm_head, torch.nn.Linear):
        view.lm_head = KernelLinear(lm.lm_head, backend.product)
    return view
