"""What the one-row GEMV kernels share: a step of their input row, normed or not.

:mod:`~trace_replay.kernels.gemv` and :mod:`~trace_replay.kernels.gated_gemv` can take the
RMSNorm that precedes a projection into the launch (the compiler pass of
:mod:`~trace_replay.engines.builtin.passes.norm_folds`). ``norm(x)·W^T = rsqrt(mean(x²) + eps) ·
(x ∘ (g + offset))·W^T``: the scale is one number per row, so each program multiplies its
input steps by the norm's weight ``g`` (plus ``offset``: 1 for Gemma's ``1 + g``), sums
``x²`` on the way, and scales its dot products once at the end (:func:`norm_scale`).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from trace_replay.kernels._triton import tl, triton

__all__ = ["norm_scale", "row_step"]


@triton.jit
def row_step(
    x_row,  # the row's first element
    norm_ptr,  # [K], the norm's weight, or any pointer when not NORMED
    k,  # [BLOCK_K] columns of this step
    depth,
    norm_offset,
    EVEN_K: tl.constexpr,
    NORMED: tl.constexpr,
):
    """Return ``(x, xg)`` at columns ``k`` in float32: the row, and what multiplies the
    weights (``x·(g + norm_offset)`` where ``NORMED``, else ``x``); 0 past ``depth``."""
    if EVEN_K:
        x = tl.load(x_row + k).to(tl.float32)
    else:
        x = tl.load(x_row + k, mask=k < depth, other=0.0).to(tl.float32)
    xg = x
    if NORMED:
        if EVEN_K:
            g = tl.load(norm_ptr + k).to(tl.float32)
        else:
            g = tl.load(norm_ptr + k, mask=k < depth, other=0.0).to(tl.float32)
        xg = x * (g + norm_offset)
    return x, xg


@triton.jit
def norm_scale(squares, depth, eps):
    """``rsqrt(mean(x²) + eps)`` from the per-lane sums of ``x²`` (``[BLOCK_K]``)."""
    return tl.rsqrt(tl.sum(squares, axis=0) / depth + eps)
