"""The modules of the static backend's model view that run the package's kernels.

The view (:mod:`~trace_replay.engines.builtin.backends.static`) shares every weight with the model
and replaces modules only in shallow copies, so the model itself is never modified:

* each ``nn.Linear`` becomes a :class:`KernelLinear`, whose product is
  :func:`~trace_replay.kernels.fp32_linear.fp32_linear` (float32, 3xTF32 on tensor cores)
  or :func:`~trace_replay.kernels.gemv.gemv` (half precision, one row);
* with the GEMV, a gated MLP (``down(act(gate(x)) * up(x))``, the MLP of every model type
  the backend runs) becomes a :class:`GatedMLP`: at one row gate, up and the activation
  are one launch (:func:`~trace_replay.kernels.gated_gemv.gated_gemv`);
* with the GEMV, the decoder layer's own RMSNorms become :class:`KernelRMSNorm`: at one
  row one opaque operator (:func:`~trace_replay.kernels.rms_norm.rms_norm`), which the
  compiler takes into the GEMVs that read it (:mod:`~trace_replay.engines.builtin.passes.norm_folds`).

:func:`kernel_layer` makes a decoder layer's view.
"""

from __future__ import annotations

import copy

import torch

from trace_replay.kernels.gated_gemv import gated_gemv
from trace_replay.kernels.gated_gemv import runs as gated_runs
from trace_replay.kernels.gemv import gemv
from trace_replay.kernels.gemv import runs as gemv_runs
from trace_replay.kernels.rms_norm import Norm, rms_norm

__all__ = ["GatedMLP", "KernelLinear", "KernelRMSNorm", "gated_activation", "kernel_layer",
           "kernel_modules", "shallow"]

# MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP",
              "Gemma3MLP")
# RMSNorm classes, by what their weight is offset by (Gemma's scale is ``1 + weight``)
RMS_NORMS = {"LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0,
             "Qwen3RMSNorm": 0.0, "GemmaRMSNorm": 1.0, "Gemma2RMSNorm": 1.0,
             "Gemma3RMSNorm": 1.0}
# activation classes (transformers' and torch's) by the kernel's name for their function
_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh",
                "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh"}


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


class GatedMLP(torch.nn.Module):
    """A gated MLP whose gate, up and activation run as one GEMV at one row; at more rows
    (or where the kernel does not run) the MLP's own computation on its kernel linears.

    Parameters
    ----------
    mlp
        The MLP (its linears may be :class:`KernelLinear`); shared, not copied.
    act
        The kernel's name for its activation (:func:`gated_activation`).
    """

    def __init__(self, mlp: torch.nn.Module, act: str) -> None:
        super().__init__()
        self.mlp, self.act = mlp, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        gate, up = mlp.gate_proj, mlp.up_proj
        if gated_runs(x, gate.weight):
            hidden = gated_gemv(x, gate.weight, up.weight, gate.bias, up.bias, self.act)
        else:
            hidden = mlp.act_fn(gate(x)) * up(x)
        return mlp.down_proj(hidden)


def gated_activation(module: torch.nn.Module) -> str | None:
    """The kernel's activation name when ``module`` is a gated MLP :class:`GatedMLP` can run
    (a class of :data:`GATED_MLPS` with linear gate/up/down, biases on both or neither of
    gate and up, an activation the kernel has); else None."""
    if type(module).__name__ not in GATED_MLPS:
        return None
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, (torch.nn.Linear, KernelLinear)) for m in linears):
        return None
    if (linears[0].bias is None) != (linears[1].bias is None):
        return None
    act = getattr(module, "act_fn", None)
    if isinstance(act, torch.nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else None
    return _ACTIVATIONS.get(type(act).__name__)


def kernel_modules(module: torch.nn.Module, product) -> torch.nn.Module:
    """``module``, or a shallow copy of it whose ``nn.Linear`` descendants are
    :class:`KernelLinear` of ``product`` and, where ``product`` is the GEMV, whose gated
    MLPs are :class:`GatedMLP` (copies along the way; the model is untouched)."""
    if isinstance(module, torch.nn.Linear):
        return KernelLinear(module, product)
    children = {name: kernel_modules(child, product) for name, child in module._modules.items()
                if child is not None}
    if all(children[name] is module._modules[name] for name in children):
        clone = module
    else:
        clone = shallow(module)
        clone._modules.update(children)
    act = gated_activation(module) if product is gemv else None
    return GatedMLP(clone, act) if act is not None else clone


class KernelRMSNorm(torch.nn.Module):
    """A decoder layer's RMSNorm (:data:`RMS_NORMS`, its epsilon ``eps``) that runs as one
    operator at one half-precision row (:func:`~trace_replay.kernels.rms_norm.rms_norm`,
    float32 throughout, rounded once), and as itself otherwise."""

    def __init__(self, norm: torch.nn.Module, eps: float) -> None:
        super().__init__()
        self.norm, self.eps = norm, eps
        self.offset = RMS_NORMS[type(norm).__name__]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.norm.weight
        if not gemv_runs(x, weight):
            return self.norm(x)
        out = rms_norm(x.reshape(-1, x.shape[-1]), Norm(weight, self.eps, self.offset))
        return out.reshape(x.shape)


def kernel_layer(layer: torch.nn.Module, product) -> torch.nn.Module:
    """A decoder layer's view: :func:`kernel_modules`, and with the GEMV its own RMSNorms
    (its direct children, not the per-head norms inside attention) as
    :class:`KernelRMSNorm`."""
    view = kernel_modules(layer, product)
    if product is not gemv:
        return view
    eps = {name: _norm_eps(child) for name, child in view._modules.items()}
    norms = {name: KernelRMSNorm(view._modules[name], value) for name, value in eps.items()
             if value is not None}
    if not norms:
        return view
    view = shallow(view) if view is layer else view
    view._modules.update(norms)
    return view


def _norm_eps(module: torch.nn.Module | None) -> float | None:
    """The epsilon of an RMSNorm of :data:`RMS_NORMS` with a weight (transformers names it
    ``variance_epsilon`` in Llama-like models, ``eps`` in Gemma's); else None."""
    if type(module).__name__ not in RMS_NORMS or not hasattr(module, "weight"):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return None if eps is None else float(eps)
