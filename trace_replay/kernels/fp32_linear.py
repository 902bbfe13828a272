"""Float32 linear layers on tensor cores, as accurate as float32: the 3xTF32 split.

A float32 GEMM without tensor cores ran at ~10% of the H200's float32 peak at the small row
counts of decode (64 rows × 576 columns: cuBLAS's SIMT and split-K kernels), and was 70% of
a float32 SmolLM2 replay step. TF32 tensor cores keep only 10 mantissa bits of each input
(3e-4 relative error per output there, against 2e-7 to 1e-6 for float32): errors of the
size a float32 replay is there to measure against. The 3xTF32 split keeps both speed and
accuracy: each input is ``big + small``, ``big`` its TF32 rounding and ``small`` the
(TF32-rounded) rest, and ``x @ w`` is taken as ``big·big + big·small + small·big`` on
tensor cores, accumulated in float32; what is lost (``small·small`` and the rounding of
``small``) is ~2^-22 relative. Triton does the split inside ``tl.dot``
(``input_precision="tf32x3"``).

The result is not cuBLAS's float32 result bit for bit (no two GEMM kernels agree in the last
bits: their reduction orders differ), but it is as close to the float64 product:
``benchmarks/bench_fp32_linear.py`` measures both, ``tests/test_fp32_linear.py`` holds the
kernel to float32 rounding.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch
import torch.nn.functional as F

from trace_replay._triton import tl, triton, use_triton

__all__ = ["blocks", "fp32_linear", "fp32_linear_reference", "launch"]


@triton.jit
def _fp32_linear_kernel(
    x_ptr,  # [M, K] float32, last stride 1
    x_stride_m,
    weight_ptr,  # [N, K] float32, last stride 1
    weight_stride_n,
    bias_ptr,  # [N] float32, or any pointer when not HAS_BIAS
    out_ptr,  # [M, N] float32, contiguous, written
    rows, cols, depth,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # of the float32 dots: "tf32x3" (the launcher's)
):
    # N tiles vary fastest: programs running together share the x tile and stream weights
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = offs_m < rows, offs_n < cols
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride_m
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * weight_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, depth, BLOCK_K):
        k = start + offs_k
        k_ok = k < depth
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * cols + offs_n[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32, on tensor cores with the 3xTF32 split.

    Runs the Triton kernel when :func:`~trace_replay._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``), else :func:`fp32_linear_reference`. Inside
    ``torch.compile`` it is one opaque operator (``torch.ops.trace_replay.fp32_linear``).

    Parameters
    ----------
    x
        ``[..., K]`` float32.
    weight
        ``[N, K]`` float32.
    bias
        ``[N]`` float32 or None.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` float32, within float32 rounding of the float64 product (what the
        split leaves out is ~2^-22 relative).

    Examples
    --------
    >>> x, weight = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0], [0.5, 0.25]])
    >>> fp32_linear(x, weight, torch.tensor([0.0, 1.0])).tolist()
    [[11.0, 2.0]]
    """
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"fp32_linear takes float32 (got {x.dtype} and {weight.dtype})")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight takes {weight.shape[1]}")
    if not use_triton(x, weight, bias):
        return fp32_linear_reference(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.trace_replay.fp32_linear(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp32_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch :func:`fp32_linear`: ``F.linear`` (float32 multiplies on the CPU)."""
    return F.linear(x, weight, bias)


@torch.library.custom_op("trace_replay::fp32_linear", mutates_args=())
def _fp32_linear_op(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return launch(x, weight, bias)


@_fp32_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def blocks(rows: int, cols: int, depth: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` for ``[rows, depth] @ [depth, cols]``.

    From ``benchmarks/bench_fp32_linear.py --sweep`` on an H200 (SmolLM2-135M's layers at
    64, 576 and 1,024 rows): small outputs are latency-bound, so 16-row tiles and 64-deep
    steps (more programs, fewer serial steps); at 49,152 columns (lm_head) the three
    tensor-core products per step make it compute-bound, so larger tiles.
    """
    wide = cols >= 16384
    block_m = 64 if rows > 64 or wide else 16
    if wide:
        block_n = 128 if rows > 64 else 64
    else:
        block_n = 64 if rows > 64 and cols >= 1536 and depth < 1024 else 32
    # deep and few rows (the down projection at decode): fewer serial steps, 14.9 -> 13.8 µs
    block_k = 32 if wide else 128 if depth >= 1024 and block_m == 16 else 64
    return block_m, block_n, block_k, 4, 3


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Run the kernel on ``x`` ``[M, K]`` (no fallback); ``config`` overrides :func:`blocks`
    (``benchmarks/bench_fp32_linear.py --sweep``)."""
    rows, depth = x.shape
    cols = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    block_m, block_n, block_k, warps, stages = config or blocks(rows, cols, depth)
    grid = (triton.cdiv(cols, block_n), triton.cdiv(rows, block_m))
    _fp32_linear_kernel[grid](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else x, out,
        rows, cols, depth,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="tf32x3", num_warps=warps, num_stages=stages,
    )
    return out
