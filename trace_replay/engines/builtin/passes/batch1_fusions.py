"""The batch-1 fusions of the static backend's half-precision view.

At one half-precision row (8B batch-1 decode) three fusions take launches out of each layer,
on top of the one-row GEMV: gate, up and the activation in one launch (:class:`GatedMLP`,
:func:`~trace_replay.kernels.gated_gemv.gated_gemv`); the layer's RMSNorms as one operator
(:class:`KernelRMSNorm`) that the compiler moves into the GEMVs reading it
(:class:`~trace_replay.engines.builtin.passes.norm_folds.FoldNorms`); a residual add after a
one-row GEMV inside the GEMV
(:class:`~trace_replay.engines.builtin.passes.residual_adds.FoldResidualAdds`). At more rows
nothing changes. Everything after the weight loads is float32, rounded once, so fused results
are closer to float32 than the model's own bf16 steps.

They are on unless the engine is built with ``batch1_fusions=False`` (the static backend's
``batch1_fusions``), which reaches the view (:func:`fuse_layer`, called by
:func:`~trace_replay.engines.builtin.backends.static_view.kernel_layer`) and the compiled layer
(:func:`passes`). On: 8B bf16 batch 1 at 4.20 ms/step, 4.34 without (H200,
benchmarks/RESULTS.md, "Batch-1 fusions").
"""

from __future__ import annotations

from typing import Any, cast

import torch

from trace_replay.kernels.gated_gemv import gated_gemv
from trace_replay.kernels.gated_gemv import runs as gated_runs
from trace_replay.kernels.gemv import runs as gemv_runs
from trace_replay.kernels.rms_norm import Norm, rms_norm

__all__ = ["GatedMLP", "KernelRMSNorm", "fuse_layer", "gated_activation", "passes"]

# MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
GATED_MLPS = (
    "LlamaMLP",
    "MistralMLP",
    "Qwen2MLP",
    "Qwen3MLP",
    "GemmaMLP",
    "Gemma2MLP",
    "Gemma3MLP",
)
# RMSNorm classes, by what their weight is offset by (Gemma's scale is ``1 + weight``)
RMS_NORMS = {
    "LlamaRMSNorm": 0.0,
    "MistralRMSNorm": 0.0,
    "Qwen2RMSNorm": 0.0,
    "Qwen3RMSNorm": 0.0,
    "GemmaRMSNorm": 1.0,
    "Gemma2RMSNorm": 1.0,
    "Gemma3RMSNorm": 1.0,
}
# activation classes (transformers' and torch's) by the kernel's name for their function
_ACTIVATIONS = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
}


class GatedMLP(torch.nn.Module):
    """A gated MLP whose gate, up and activation run as one GEMV at one row; at more rows
    (or where the kernel does not run) the MLP's own computation on its kernel linears.

    Parameters
    ----------
    mlp
        The MLP (its linears may be the view's kernel linears); shared, not copied.
    act
        The kernel's name for its activation (:func:`gated_activation`).
    """

    def __init__(self, mlp: torch.nn.Module, act: str) -> None:
        super().__init__()
        self.mlp, self.act = mlp, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp: Any = self.mlp  # a transformers MLP: gate_proj, up_proj, down_proj, act_fn
        gate, up = mlp.gate_proj, mlp.up_proj
        if gated_runs(x, gate.weight):
            hidden = gated_gemv(x, gate.weight, up.weight, gate.bias, up.bias, self.act)
        else:
            hidden = mlp.act_fn(gate(x)) * up(x)
        return mlp.down_proj(hidden)


def gated_activation(module: torch.nn.Module | None) -> str | None:
    """The kernel's activation name when ``module`` is a gated MLP :class:`GatedMLP` can run
    (a class of :data:`GATED_MLPS` with linear gate/up/down, biases on both or neither of
    gate and up, an activation the kernel has); else None."""
    if type(module).__name__ not in GATED_MLPS:
        return None
    gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    linear = torch.nn.Linear
    if not (isinstance(gate, linear) and isinstance(up, linear) and isinstance(down, linear)):
        return None
    if (gate.bias is None) != (up.bias is None):
        return None
    act = getattr(module, "act_fn", None)
    if isinstance(act, torch.nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else None
    return _ACTIVATIONS.get(type(act).__name__)


class KernelRMSNorm(torch.nn.Module):
    """A decoder layer's RMSNorm (:data:`RMS_NORMS`, its epsilon ``eps``) that runs as one
    operator at one half-precision row (:func:`~trace_replay.kernels.rms_norm.rms_norm`,
    float32 throughout, rounded once), and as itself otherwise."""

    def __init__(self, norm: torch.nn.Module, eps: float) -> None:
        super().__init__()
        self.norm, self.eps = norm, eps
        self.offset = RMS_NORMS[type(norm).__name__]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = cast(torch.Tensor, self.norm.weight)
        if not gemv_runs(x, weight):
            return self.norm(x)
        out = rms_norm(x.reshape(-1, x.shape[-1]), Norm(weight, self.eps, self.offset))
        return out.reshape(x.shape)


def _norm_eps(module: torch.nn.Module | None) -> float | None:
    """The epsilon of an RMSNorm of :data:`RMS_NORMS` with a weight (transformers names it
    ``variance_epsilon`` in Llama-like models, ``eps`` in Gemma's); else None."""
    if type(module).__name__ not in RMS_NORMS or not hasattr(module, "weight"):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return None if eps is None else float(eps)


def fuse_layer(view: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """``view`` (a shallow copy of decoder ``layer`` whose linears are the GEMV's) with its
    gated MLP as a :class:`GatedMLP` and its own RMSNorms (direct children, not the per-head
    norms inside attention) as :class:`KernelRMSNorm`; eligibility is read from ``layer``."""
    for name, child in layer._modules.items():
        own = view._modules[name]  # the view's copy of child (None where child is)
        act = gated_activation(child)
        if own is not None and act is not None:
            view._modules[name] = GatedMLP(own, act)
        elif own is not None and (eps := _norm_eps(child)) is not None:
            view._modules[name] = KernelRMSNorm(own, eps)
    return view


def passes(enabled: bool) -> tuple[list, object | None]:
    """The compiler passes of the fusions: (passes before inductor's post-grad passes, the
    pass after them); none when the fusions are off."""
    if not enabled:
        return [], None
    from trace_replay.engines.builtin.passes.norm_folds import FoldNorms  # these import inductor
    from trace_replay.engines.builtin.passes.residual_adds import FoldResidualAdds

    return [FoldNorms()], FoldResidualAdds()
