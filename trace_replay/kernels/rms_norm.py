"""RMSNorm at a few rows in one launch, in float32 throughout and rounded once.

``norm(x) = x · rsqrt(mean(x²) + eps) · (g + offset)``: ``offset`` 0 for Llama, Mistral and
Qwen (``weight * normed``), 1 for Gemma (``normed * (1 + weight)``). The model's own code
rounds the normed row to the dtype before the weight multiplies it (Llama) or after
(Gemma); here the float32 value is rounded once, so results agree with the model's to the
dtype's rounding.

The static backend's view runs the decoder layer's norms through :func:`rms_norm` at one
row, as one opaque operator (``torch.ops.trace_replay.rms_norm``): where every use of its
output is a one-row GEMV, the compiler pass of :mod:`~trace_replay.engines.builtin.passes.norm_folds` takes
the norm into those GEMVs (:class:`Norm` describes it to them) and this kernel never runs.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from typing import NamedTuple

import torch

from trace_replay.kernels._triton import tl, triton, use_triton

__all__ = ["Norm", "rms_norm", "rms_norm_reference"]


class Norm(NamedTuple):
    """An RMSNorm as the one-row GEMVs take it into their launch."""

    weight: torch.Tensor  # [K]
    eps: float
    offset: float = 0.0  # 1.0 for Gemma's ``1 + weight``


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [M, K], last stride 1
    x_stride_m,
    weight_ptr,  # [K]
    out_ptr,  # [M, K] contiguous, written
    depth,
    eps,
    offset,
    BLOCK: tl.constexpr,  # a power of two >= depth
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    ok = k < depth
    x = tl.load(x_ptr + row * x_stride_m + k, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(weight_ptr + k, mask=ok, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / depth + eps)
    tl.store(
        out_ptr + row * depth + k, (x * scale * (g + offset)).to(out_ptr.dtype.element_ty), mask=ok
    )


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """RMSNorm of ``x`` ``[M, K]``: the kernel where Triton runs (one opaque operator inside
    ``torch.compile``), else :func:`rms_norm_reference`."""
    if not use_triton(x, norm.weight):
        return rms_norm_reference(x, norm)
    return torch.ops.trace_replay.rms_norm(x, norm.weight, norm.eps, norm.offset)


def rms_norm_reference(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Pure-torch :func:`rms_norm`, float32 throughout, rounded once to x's dtype."""
    xf = x.float()
    scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (xf * scale * (norm.weight.float() + norm.offset)).to(x.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        weight,
        out,
        x.shape[1],
        eps,
        offset,
        BLOCK=triton.next_power_of_2(x.shape[1]),
        num_warps=4,
    )
    return out


@torch.library.custom_op("trace_replay::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _launch(x, weight, eps, offset)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
