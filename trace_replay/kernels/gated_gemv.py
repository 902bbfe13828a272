"""A gated MLP's first half at one row: ``act(x Wg^T) * (x Wu^T)`` in one GEMV launch.

The MLP of Llama, Mistral, Qwen and Gemma is ``down(act(gate(x)) * up(x))``. At one row
(batch-1 decode) :mod:`~trace_replay.kernels.gemv` runs gate and up as one grouped launch,
and the activation and product then run as a kernel of their own: at Llama-3.1-8B's shape
that is 32 more launches per step, each reading and writing the 2 × 14,336 values. Here
each program reads the same rows of both weights (output column ``j`` needs row ``j`` of
each), keeps two float32 running products, and applies the activation and the product to
its own columns before it stores them: the weights are read once, as before, and the
activation costs no launch.

Activations (``ACTIVATIONS``): ``"silu"`` (``g·σ(g)``) and ``"gelu_tanh"`` (the tanh form
of GELU, Gemma's ``gelu_pytorch_tanh``), computed as ``g·σ(2·√(2/π)·(g + 0.044715·g³))``,
which is the same function (``(1 + tanh z) / 2 = σ(2z)``).

Rounding. Everything after the weight loads is float32, rounded once to the output dtype.
The model's own code rounds the gate and up products, the activation and the product to the
dtype one after another; so this is the float32 result more closely than the model's, and
agrees with it to the dtype's rounding, not bit for bit.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import torch
import torch.nn.functional as F

from trace_replay.kernels import gemv as _gemv
from trace_replay.kernels._triton import tl, triton
from trace_replay.kernels.gemv_input import norm_scale, row_step
from trace_replay.kernels.rms_norm import Norm

__all__ = ["ACTIVATIONS", "blocks", "gated_gemv", "gated_gemv_reference", "launch", "runs"]

ACTIVATIONS = ("silu", "gelu_tanh")
# 2·√(2/π): gelu_tanh(g) = g·σ(_GELU_SCALE·(g + 0.044715·g³))
_GELU_SCALE = 2 * (2 / torch.pi) ** 0.5


@triton.jit
def _gated_gemv_kernel(
    x_ptr,  # [M, K], last stride 1
    x_stride_m,
    gate_ptr,
    up_ptr,  # [N, K] each, last stride 1
    gate_stride_n,
    up_stride_n,
    gate_bias_ptr,
    up_bias_ptr,  # [N] each, or any pointer when not HAS_BIAS
    norm_ptr,  # [K], the weight of the RMSNorm applied to x first, or any pointer
    out_ptr,  # [M, N] contiguous, written
    cols,
    depth,
    eps,
    norm_offset,  # the RMSNorm's (read where NORMED)
    HAS_BIAS: tl.constexpr,
    NORMED: tl.constexpr,
    GELU_TANH: tl.constexpr,  # else SiLU
    GELU_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # depth % BLOCK_K == 0: no mask along K
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = offs_n < cols
    # columns past the end read the last row (in bounds, never stored): no mask
    rows_n = tl.minimum(offs_n, cols - 1).to(tl.int64)
    g_rows = gate_ptr + rows_n[:, None] * gate_stride_n
    u_rows = up_ptr + rows_n[:, None] * up_stride_n
    x_row = x_ptr + pid_m.to(tl.int64) * x_stride_m
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, depth, BLOCK_K):
        k = start + offs_k
        if EVEN_K:
            g = tl.load(g_rows + k[None, :], eviction_policy="evict_first")
            u = tl.load(u_rows + k[None, :], eviction_policy="evict_first")
        else:
            k_ok = (k < depth)[None, :]
            g = tl.load(g_rows + k[None, :], mask=k_ok, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_rows + k[None, :], mask=k_ok, other=0.0, eviction_policy="evict_first")
        x, xg = row_step(x_row, norm_ptr, k, depth, norm_offset, EVEN_K, NORMED)
        if NORMED:
            squares += x * x
        acc_g += g.to(tl.float32) * xg[None, :]
        acc_u += u.to(tl.float32) * xg[None, :]
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if NORMED:
        scale = norm_scale(squares, depth, eps)
        gate *= scale
        up *= scale
    if HAS_BIAS:
        gate += tl.load(gate_bias_ptr + rows_n).to(tl.float32)
        up += tl.load(up_bias_ptr + rows_n).to(tl.float32)
    if GELU_TANH:
        act = gate * tl.sigmoid(GELU_SCALE * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(
        out_ptr + pid_m.to(tl.int64) * cols + offs_n,
        (act * up).to(out_ptr.dtype.element_ty),
        mask=col_ok,
    )


def runs(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether :func:`gated_gemv` takes the kernel: where :func:`~trace_replay.kernels.gemv.runs`
    would for the gate weight (one half-precision row, Triton runnable)."""
    return _gemv.runs(x, gate)


def gated_gemv(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """``act(F.linear(x, gate, gate_bias)) * F.linear(x, up, up_bias)``, by the kernel where
    :func:`runs` says so (one opaque operator inside ``torch.compile``:
    ``torch.ops.trace_replay.gated_gemv``).

    Parameters
    ----------
    x
        ``[..., K]``.
    gate, up
        ``[N, K]`` each, x's dtype.
    gate_bias, up_bias
        ``[N]`` each, or both None.
    act
        One of :data:`ACTIVATIONS`.

    Returns
    -------
    torch.Tensor
        ``[..., N]``, x's dtype.
    """
    _check(gate, up, gate_bias, up_bias, act)
    if not runs(x, gate):
        return gated_gemv_reference(x, gate, up, gate_bias, up_bias, act)
    out = torch.ops.trace_replay.gated_gemv(
        x.reshape(-1, x.shape[-1]), gate, up, gate_bias, up_bias, act
    )
    return out.reshape(*x.shape[:-1], gate.shape[0])


def gated_gemv_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """Pure-torch :func:`gated_gemv`, in the operands' dtype as the model's code computes it."""
    _check(gate, up, gate_bias, up_bias, act)
    g = F.linear(x, gate, gate_bias)
    g = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return g * F.linear(x, up, up_bias)


def _check(gate, up, gate_bias, up_bias, act) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r}; choose one of {', '.join(ACTIVATIONS)}")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("gate_bias and up_bias: both or neither")


def blocks(cols: int, depth: int, normed: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, warps)``: each program reads ``BLOCK_N`` rows of each weight, so
    ``BLOCK_N`` is half the grouped GEMV's for the same bytes per program
    (:func:`~trace_replay.kernels.gemv.blocks` of the two weights side by side). With the
    norm in the launch (``normed``) the 8B sweep's best was (2, 256, 1): 59.0 µs, against
    61 and more at the blocks without it."""
    if normed:
        return 2, 256, 1
    block_n, block_k, warps = _gemv.blocks(2 * cols, depth)
    return max(block_n // 2, 1), block_k, warps


def launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    act: str = "silu",
    *,
    norm: Norm | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The kernel on ``x`` ``[M, K]`` (or on its RMSNorm, where ``norm`` is given: taken into
    the launch): ``[M, N]``. ``config`` overrides :func:`blocks`
    (``benchmarks/bench_gemv.py --sweep``)."""
    _check(gate, up, gate_bias, up_bias, act)
    rows, depth = x.shape
    cols = gate.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    has_bias = gate_bias is not None
    biases = (gate_bias.contiguous(), up_bias.contiguous()) if has_bias else (x, x)
    block_n, block_k, warps = config or blocks(cols, depth, norm is not None)
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    _gated_gemv_kernel[(rows, triton.cdiv(cols, block_n))](
        x,
        x.stride(0),
        gate,
        up,
        gate.stride(0),
        up.stride(0),
        *biases,
        x if norm is None else norm.weight,
        out,
        cols,
        depth,
        *(norm[1:] if norm else (0.0, 0.0)),
        HAS_BIAS=has_bias,
        NORMED=norm is not None,
        GELU_TANH=act == "gelu_tanh",
        GELU_SCALE=_GELU_SCALE,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=depth % block_k == 0,
        num_warps=warps,
    )
    return out


@torch.library.custom_op("trace_replay::gated_gemv", mutates_args=())
def _gated_gemv_op(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    act: str,
) -> torch.Tensor:
    return launch(x, gate, up, gate_bias, up_bias, act)


@_gated_gemv_op.register_fake
def _(x, gate, up, gate_bias, up_bias, act):
    return x.new_empty((x.shape[0], gate.shape[0]))


@torch.library.custom_op("trace_replay::gated_gemv_normed", mutates_args=())
def _gated_gemv_normed_op(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    act: str,
    norm_weight: torch.Tensor,
    eps: float,
    norm_offset: float,
) -> torch.Tensor:
    return launch(x, gate, up, gate_bias, up_bias, act, norm=Norm(norm_weight, eps, norm_offset))


@_gated_gemv_normed_op.register_fake
def _(x, gate, up, gate_bias, up_bias, act, norm_weight, eps, norm_offset):
    return x.new_empty((x.shape[0], gate.shape[0]))
