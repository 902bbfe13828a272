"""LlamaRMSNorm whose result for a row depends on that row alone.

``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` with float32 statistics, as
transformers' LlamaRMSNorm computes it.

* **Triton** (CUDA): one program per row; the sum of squares is one ``tl.sum`` over the
  whole (padded) row, the same reduction for every row whatever the row count.
* **Reference** (the CPU path): torch ops over blocks of a fixed number of rows
  (zero-padded), so every call has one shape and reduces each row alike.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import torch

from trace_replay.kernels._triton import tl, triton

__all__ = ["rms_norm_rows_reference", "rms_norm_rows_triton"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, H], float, input rows
    w_ptr,  # [H], float, the norm's weight
    out_ptr,  # [R, H], float, written
    H,
    stride_x,
    stride_o,
    eps,
    BLOCK_H: tl.constexpr,  # power of two >= H
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / H
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm_rows_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[R, H]`` by the Triton kernel, one program per row."""
    x = x.contiguous()
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.result_type(weight, x), device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            weight,
            out,
            hidden,
            x.stride(0),
            out.stride(0),
            float(eps),
            BLOCK_H=triton.next_power_of_2(hidden),
        )
    return out


def rms_norm_rows_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int = 8
) -> torch.Tensor:
    """RMSNorm of ``x`` ``[R, H]`` in torch ops, ``rows`` rows per call (zero-padded)."""
    count = x.shape[0]
    pad = -count % rows
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
    out = []
    for start in range(0, count + pad, rows):
        block = x[start : start + rows]
        b32 = block.float()
        b32 = b32 * torch.rsqrt(b32.pow(2).mean(-1, keepdim=True) + eps)
        out.append(weight * b32.to(block.dtype))
    return (torch.cat(out) if len(out) > 1 else out[0])[:count]
