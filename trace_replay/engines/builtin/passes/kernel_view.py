"""The modules of the static backend's model view that run the package's kernels.

The view (:mod:`~trace_replay.engines.builtin.backends.static`) shares every weight with the model
and replaces modules only in shallow copies, so the model itself is never modified:

* each ``nn.Linear`` becomes a :class:`KernelLinear`, whose product is
  :func:`~trace_replay.kernels.fp32_linear.fp32_linear` (float32, 3xTF32 on tensor cores)
  or :func:`~trace_replay.kernels.gemv.gemv` (half precision, one row);
* with the GEMV, the batch-1 fusions unless turned off
  (:mod:`~trace_replay.engines.builtin.passes.batch1`).

:func:`kernel_layer` makes a decoder layer's view.
"""

from __future__ import annotations

import copy

import torch

from trace_replay.engines.builtin.passes import batch1
from trace_replay.kernels.gemv import gemv

__all__ = ["KernelLinear", "kernel_layer", "kernel_modules", "shallow"]


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
    children = {name: kernel_modules(child, product) for name, child in module._modules.items()
                if child is not None}
    if all(children[name] is module._modules[name] for name in children):
        clone = module
    else:
        clone = shallow(module)
        clone._modules.update(children)
    return clone


def kernel_layer(layer: torch.nn.Module, product, *, fusions: bool = True) -> torch.nn.Module:
    """A decoder layer's view: :func:`kernel_modules`, and with the GEMV and ``fusions`` the
    batch-1 fusions (:mod:`~trace_replay.engines.builtin.passes.batch1`)."""
    view = kernel_modules(layer, product)
    if product is not gemv or not fusions:
        return view
    return batch1.fuse_layer(view if view is not layer else shallow(layer), layer)
