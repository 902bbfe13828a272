"""Linear layers at one row: a GEMV that streams the weights at HBM speed.

A decode step at batch 1 multiplies one row by every weight of the model: it reads each
weight once and does two flops per weight, so its time is the weights' bytes over the
memory bandwidth. On an H200 cuBLAS's bfloat16 GEMVs (with their split-K reductions) ran a
Llama-3.1-8B-shaped step's linears at ~3.4 TB/s, where a plain read of 2 GiB reaches 4.26
(``benchmarks/bench_gemv.py``). This kernel is the plain form of the product, built to keep
enough loads in flight: each program owns ``BLOCK_N`` output columns, walks all of K in
``BLOCK_K`` steps, keeps a ``[BLOCK_N, BLOCK_K]`` float32 running product and reduces it
over K once at the end. No split-K: at the column counts of a 7-8B model (>= 1,024) narrow
tiles give every SM several programs, whose concurrent loads hide the memory latency.

Groups, as in :mod:`~trace_replay.kernels.fp32_linear`: two or three weights that multiply
the same ``x`` (q/k/v, gate/up) run as one launch, their outputs side by side, each tile
inside one member (``BLOCK_N`` divides every member's first column), the kernel picking the
tile's weight and bias pointers from its column. One launch for the three small q/k/v
products instead of three is most of the gain there: 15 µs against cuBLAS's 29 at the 8B
shape.

What a compiled layer folds into a launch (each a compiler pass, not the model's code):
the residual add that follows a projection (``residual``: ``trace_replay::gemv_add``,
:mod:`~trace_replay.engines.builtin.passes.residual_adds`) and the RMSNorm before it (``norm``:
``trace_replay::gemv_normed``, :mod:`~trace_replay.engines.builtin.passes.norm_folds`; every program norms
the row itself, :mod:`~trace_replay.kernels.gemv_input`). Each saves a launch of its own:
at the 8B shape those cost ~1-2 µs each, 64-96 per step.

Rows. The kernel runs one program per (row, column tile), rows fastest, so a second row
re-reads the weight tile from L2; at 4 rows that was half cuBLAS's speed, so :func:`gemv`
takes the kernel at one row only (:data:`MAX_ROWS`) and leaves more rows to cuBLAS.

Accumulation is float32 over the bfloat16/float16 products, the bias is added in float32
and the sum rounded once to the output dtype: what cuBLAS does, but not its reduction
order, so results agree with ``F.linear`` to the dtype's rounding, not bit for bit.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trace_replay.kernels._triton import tl, triton, use_triton
from trace_replay.kernels.gemv_input import norm_scale, row_step
from trace_replay.kernels.grouped_members import members, tile_member
from trace_replay.kernels.rms_norm import Norm

__all__ = ["MAX_ROWS", "blocks", "gemv", "gemv_reference", "launch", "runs"]

# most rows :func:`gemv` runs the kernel at (module docstring)
MAX_ROWS = 1
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], last stride 1
    x_stride_m,
    weight_ptr,
    weight1_ptr,
    weight2_ptr,  # [N_i, K] each, last stride 1
    weight_stride_n,  # every member's
    bias_ptr,
    bias1_ptr,
    bias2_ptr,  # [N_i] each, or any pointer when not HAS_BIAS
    residual_ptr,  # [M, N] contiguous, added to the output, or any pointer when not HAS_RESIDUAL
    norm_ptr,  # [K], the weight of the RMSNorm applied to x first, or any pointer
    out_ptr,  # [M, N] contiguous (N: all members side by side), written
    cols,
    depth,
    first1,
    first2,  # output columns where the second and third members start
    eps,
    norm_offset,  # the RMSNorm's (read where NORMED)
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORMED: tl.constexpr,
    MEMBERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # depth % BLOCK_K == 0: no mask along K
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = offs_n < cols
    w_base, b_base, first = tile_member(
        pid_n * BLOCK_N,
        weight_ptr,
        weight1_ptr,
        weight2_ptr,
        bias_ptr,
        bias1_ptr,
        bias2_ptr,
        first1,
        first2,
        MEMBERS,
    )
    # columns past the end read the member's last row (in bounds, never stored): no mask
    rows_n = tl.minimum(offs_n, cols - 1) - first
    w_rows = w_base + rows_n.to(tl.int64)[:, None] * weight_stride_n
    x_row = x_ptr + pid_m.to(tl.int64) * x_stride_m
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, depth, BLOCK_K):
        k = start + offs_k
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(
                w_rows + k[None, :],
                mask=(k < depth)[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
        x, xg = row_step(x_row, norm_ptr, k, depth, norm_offset, EVEN_K, NORMED)
        if NORMED:
            squares += x * x
        acc += w.to(tl.float32) * xg[None, :]
    out = tl.sum(acc, axis=1)
    if NORMED:
        out *= norm_scale(squares, depth, eps)
    if HAS_BIAS:
        out += tl.load(b_base + rows_n).to(tl.float32)
    at = pid_m.to(tl.int64) * cols + offs_n
    if HAS_RESIDUAL:
        out += tl.load(residual_ptr + at, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes the kernel for these operands: few rows, half precision,
    the kernel runnable (:func:`~trace_replay.kernels._triton.use_triton`)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        1 <= rows <= MAX_ROWS
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and use_triton(x, weight)
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the kernel where :func:`runs` says so.

    Inside ``torch.compile`` the kernel is one opaque operator
    (``torch.ops.trace_replay.gemv``), which :mod:`~trace_replay.engines.builtin.passes.linear_groups`
    groups with the others that read the same input.

    Parameters
    ----------
    x
        ``[..., K]``.
    weight
        ``[N, K]``, x's dtype.
    bias
        ``[N]`` or None.

    Returns
    -------
    torch.Tensor
        ``[..., N]``, x's dtype.
    """
    if not runs(x, weight):
        return gemv_reference(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.trace_replay.gemv(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch :func:`gemv`: ``F.linear``."""
    return F.linear(x, weight, bias)


def blocks(cols: int, depth: int, normed: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, warps)`` for an output of ``cols`` columns over ``depth``.

    From ``benchmarks/bench_gemv.py --sweep`` on an H200 at Llama-3.1-8B's shapes (one
    row, bfloat16): (4, 1024, 2 warps) is within 1 µs of the best on every layer (q/k/v
    15.1 µs, o 11.1, gate/up 58.0, down 31.5, lm_head 241.3: 3.3-4.35 TB/s); the wide
    outputs (gate/up, lm_head) take (8, 256, 2), 0.4-0.7 µs better there. ``BLOCK_K``
    falls to the largest power of two from 1,024 down to 256 that divides ``depth``, so
    that no step is masked (Qwen2.5-7B's 3,584 = 7 × 512); other depths keep 1,024 and
    mask the last step. A launch that norms its input (``normed``) repeats the norm's work
    in every program, so narrow outputs take wider tiles there: (8, 512, 2), 15.4 µs for
    the 8B q/k/v with the norm against 16.2-17.3 for the other good blocks.
    """
    if cols >= 16384:  # gate/up, lm_head: (8, 256, 2) 57.3 and 240.9 µs
        return 8, 256, 2
    block_k = next((k for k in (1024, 512, 256) if depth % k == 0), 1024)
    if normed:  # each program norms its row: wider tiles share that work (q/k/v 15.4 µs)
        return 8, min(block_k, 512), 2
    return 4, block_k, 2


def launch(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm: Norm | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` (or its RMSNorm, where ``norm`` is given: taken into the launch) times
    one to three weights side by side: ``[M, N_0 (+ N_1 (+ N_2))]``, each member's product
    (plus its bias) in its own columns, plus ``residual`` (``[M, N]``) where given, before
    the one rounding. The blocks are :func:`blocks`' with ``BLOCK_N``
    halved until it divides every member's first column; ``config`` overrides them
    (``benchmarks/bench_gemv.py --sweep``)."""
    rows, depth = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    group = members(x, weights, biases)
    if residual is not None:
        if residual.shape != (rows, group.cols) or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype}: expected "
                f"{(rows, group.cols)} {x.dtype}"
            )
        residual = residual.contiguous()
    if config is None:  # narrowed until every member starts on a tile of its own
        block_n, block_k, warps = blocks(group.cols, depth, norm is not None)
        while any(start % block_n for start in group.starts):
            block_n //= 2
    else:
        block_n, block_k, warps = config
        if any(start % block_n for start in group.starts):
            raise ValueError(f"BLOCK_N {block_n} does not divide the members' first columns")
    out = torch.empty((rows, group.cols), dtype=x.dtype, device=x.device)
    _gemv_kernel[(rows, triton.cdiv(group.cols, block_n))](
        x,
        x.stride(0),
        *group.args,
        x if residual is None else residual,
        x if norm is None else norm.weight,
        out,
        group.cols,
        depth,
        *group.firsts,
        *(norm[1:] if norm else (0.0, 0.0)),
        HAS_BIAS=biases is not None,
        HAS_RESIDUAL=residual is not None,
        NORMED=norm is not None,
        MEMBERS=len(weights),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=depth % block_k == 0,
        num_warps=warps,
    )
    return out


@torch.library.custom_op("trace_replay::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return launch(x, [weight], None if bias is None else [bias])


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("trace_replay::gemv_add", mutates_args=())
def _gemv_add_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    return launch(x, [weight], None if bias is None else [bias], residual=residual)


@_gemv_add_op.register_fake
def _(x, weight, bias, residual):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("trace_replay::gemv_normed", mutates_args=())
def _gemv_normed_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    norm_weight: torch.Tensor,
    eps: float,
    norm_offset: float,
) -> torch.Tensor:
    return launch(x, weights, biases or None, norm=Norm(norm_weight, eps, norm_offset))


@_gemv_normed_op.register_fake
def _(x, weights, biases, norm_weight, eps, norm_offset):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))


@torch.library.custom_op("trace_replay::gemv_group", mutates_args=())
def _gemv_group_op(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]
) -> torch.Tensor:
    return launch(x, weights, biases or None)


@_gemv_group_op.register_fake
def _(x, weights, biases):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))
