"""Float32 linear layers on tensor cores, as accurate as float32: the 3xTF32 split.

Each float32 input is ``big + small`` (``big`` its TF32 rounding, ``small`` the TF32-rounded
rest) and ``x @ w`` is ``big·big + big·small + small·big`` on tensor cores, accumulated in
float32 (Triton's ``tl.dot(..., input_precision="tf32x3")``). What is left out
(``small·small`` and the rounding of ``small``) is ~2^-22 relative, so the result is as close
to the float64 product as float32 FMAs are; plain TF32 (10 mantissa bits) is not. It is not
cuBLAS's float32 result bit for bit: the two reduce in different orders.

Split-K: at ``SPLIT > 1`` K is cut into ``SPLIT`` contiguous ranges of whole ``BLOCK_K``
steps, one program per (output tile, range), each writing its partial tile to a float32
workspace ``[SPLIT, M, N]``; a second, elementwise kernel adds the partials in the fixed
order ``0, 1, …, SPLIT - 1`` and then the bias. No atomics: the same inputs give the same
bits on every run; results at different splits agree to float32 rounding, not bit for bit.
At ``SPLIT == 1`` the kernel adds the bias and writes the output itself. Inside
``torch.compile`` the sum is torch ops in the same order (:func:`sum_partials`: the same
bits), which the compiler fuses into the kernel that reads the output.

Groups: two or three weights that multiply the same ``x`` (a layer's q/k/v, its gate/up)
share one launch (:func:`launch_group_partials`): their outputs side by side, each tile inside
one member. :mod:`trace_replay.engines.builtin.passes.linear_groups` makes the groups.

The split stays inside ``tl.dot``: each K step's three products start from zero and are added
to the accumulator after, since small products added into a large accumulator lose their low
bits (a tensor core reads a float32 operand's TF32 *truncation*).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trace_replay.kernels._triton import tl, triton, use_triton
from trace_replay.kernels.grouped_members import members, tile_member

__all__ = [
    "blocks",
    "fp32_linear",
    "fp32_linear_reference",
    "group_blocks",
    "launch",
    "launch_group_partials",
    "launch_partials",
    "split_depth",
    "sum_partials",
]

# elements per program of the partial-sum kernel (an elementwise pass: any size works)
_SUM_BLOCK = 1024
# programs split-K aims at: two waves on an H200's 132 SMs (see blocks)
_PROGRAMS = 264


@triton.jit
def _fp32_linear_kernel(
    x_ptr,  # [M, K] float32, last stride 1
    x_stride_m,
    weight_ptr,  # [N, K] float32, last stride 1 (of the first member, when MEMBERS > 1)
    weight1_ptr,
    weight2_ptr,  # the second and third members' (read when MEMBERS > 1, > 2)
    weight_stride_n,  # every member's
    bias_ptr,
    bias1_ptr,
    bias2_ptr,  # [N_i] float32 each, or any pointer when not HAS_BIAS
    out_ptr,  # [M, N] float32, contiguous, written; at SPLIT > 1 the [SPLIT, M, N] partials
    rows,
    cols,
    depth,  # cols: of the whole output (all members side by side)
    first1,
    first2,  # output columns where the second and third members start
    k_per_split,  # a multiple of BLOCK_K (unused at SPLIT == 1)
    HAS_BIAS: tl.constexpr,
    MEMBERS: tl.constexpr,  # weights side by side in one output (see launch_group_partials)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,  # programs along K per output tile (grid axis 2)
    PRECISION: tl.constexpr,  # of the float32 dots: "tf32x3" (the launcher's)
):
    # N tiles vary fastest: programs running together share the x tile and stream weights
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = offs_m < rows, offs_n < cols
    # a tile lies inside one member (the launcher aligns members to BLOCK_N): its weight
    # rows are the tile's columns less the member's first column
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
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride_m
    w_rows = w_base + (offs_n - first).to(tl.int64)[:, None] * weight_stride_n
    if SPLIT == 1:  # resolved at compile time: the one-pass kernel, all of K
        k_start, k_end = 0, depth
    else:  # this program's range; it starts on a BLOCK_K boundary, so `k < depth` masks it
        pid_s = tl.program_id(2)
        k_start = pid_s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, depth)
        out_ptr += pid_s.to(tl.int64) * rows * cols  # its own [M, N] slice of the partials
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        k = start + offs_k
        k_ok = k < depth
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:  # the launcher sets it only at SPLIT == 1: the sum adds the bias otherwise
        acc += tl.load(b_base + (offs_n - first), mask=col_ok, other=0.0)[None, :]
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * cols + offs_n[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _sum_partials_kernel(
    partials_ptr,  # [SPLIT, size] float32, contiguous
    bias_ptr,  # [cols] float32, or any pointer when not HAS_BIAS
    out_ptr,  # [size] float32 (an [M, N] output, flattened), written
    size,
    cols,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Each output element is one lane's running sum, partial 0 first, then 1, ..., then the
    # bias: a fixed order of float32 additions, hence the same bits on every run and device.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    ptrs = partials_ptr + offs
    acc = tl.load(ptrs, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLIT):
        ptrs += size  # the next split's slice (a pointer step: no SPLIT * size product)
        acc += tl.load(ptrs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % cols, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc, mask=ok)


def fp32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32, on tensor cores with the 3xTF32 split.

    Runs the Triton kernel when :func:`~trace_replay.kernels._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``), else :func:`fp32_linear_reference`. Inside
    ``torch.compile`` it is one opaque operator (``torch.ops.trace_replay.fp32_linear_partials``)
    followed, at a split above 1, by the partial sum in torch ops, which the compiler fuses
    into the output's consumer (module docstring); eagerly the sum is the second kernel.
    Both add the same numbers in the same order.

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
    if torch.compiler.is_compiling():
        partials = torch.ops.trace_replay.fp32_linear_partials(flat, weight, bias)
        out = partials[0] if partials.shape[0] == 1 else sum_partials(partials, bias)
    else:
        out = launch(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp32_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch :func:`fp32_linear`: ``F.linear`` (float32 multiplies on the CPU)."""
    return F.linear(x, weight, bias)


def sum_partials(partials: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``partials`` ``[SPLIT, M, N]`` summed in torch ops in the order of
    ``_sum_partials_kernel``: partial 0, then 1, ..., then the bias; so the same bits.

    Examples
    --------
    >>> sum_partials(torch.tensor([[[1.0]], [[2.0]], [[4.0]]]), torch.tensor([0.5])).tolist()
    [[7.5]]
    """
    out = partials[0]
    for partial in partials[1:]:
        out = out + partial
    return out if bias is None else out + bias


@torch.library.custom_op("trace_replay::fp32_linear_partials", mutates_args=())
def _fp32_linear_partials_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return launch_partials(x, weight, bias)


@_fp32_linear_partials_op.register_fake
def _(x, weight, bias):
    rows, depth = x.shape
    _, _, block_k, _, _, split = blocks(rows, weight.shape[0], depth)
    return x.new_empty((split_depth(depth, block_k, split)[0], rows, weight.shape[0]))


@torch.library.custom_op("trace_replay::fp32_linear_group_partials", mutates_args=())
def _fp32_linear_group_partials_op(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], split: int
) -> torch.Tensor:
    # biases: one per weight, or empty for none (what engines.linear_groups inserts)
    return launch_group_partials(x, weights, biases or None, split)


@_fp32_linear_group_partials_op.register_fake
def _(x, weights, biases, split):
    return x.new_empty((split, x.shape[0], sum(w.shape[0] for w in weights)))


def blocks(rows: int, cols: int, depth: int) -> tuple[int, int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split)`` for ``[rows, depth] @ [depth, cols]``.

    Tuned with ``benchmarks/bench_fp32_linear.py --sweep``. Small outputs are
    latency-bound (few output tiles, each walking all of K), so split-K cuts K until about
    two waves of programs run (:data:`_PROGRAMS`), up to 5 ranges (6 when K >= 1,024); an
    output of 16,384 columns or more (lm_head) is compute-bound: larger tiles, no split.
    Rows above 576 (a prefill) take the 576-row tiles; the split drops to 1 as tiles multiply.
    """
    if cols >= 16384:  # lm_head
        return 64, 128 if rows > 64 else 64, 32, 4, 3, 1
    if rows <= 64:
        block_m, block_n = (16 if cols < 512 else 64), 32
    else:
        block_m, block_n = 64, (32 if cols < 512 else 64)
    tiles = -(-rows // block_m) * -(-cols // block_n)  # ceiling divisions: no Triton needed
    split = max(1, min(6 if depth >= 1024 else 5, _PROGRAMS // tiles))
    return block_m, block_n, 64, 4, 3, split


def split_depth(depth: int, block_k: int, split: int) -> tuple[int, int]:
    """``(split, depth per split)`` that :func:`launch` runs for a requested ``split``.

    K is cut into ``split`` contiguous ranges of whole ``block_k`` steps, as even as they
    go: ``ceil(steps / split)`` steps each, the last range shorter. The split is then
    clamped so that no range is empty (an empty one would cost a program and a workspace
    slice for a tile of zeros): 3 steps at a requested split of 4 run as 3 splits of one
    step; 5 steps at 4 as 3 splits of 2, 2 and 1 steps. A split of 1 is all of K.

    Examples
    --------
    >>> split_depth(40, 16, 2), split_depth(40, 16, 4), split_depth(100, 16, 4)
    ((2, 32), (3, 16), (4, 32))
    >>> split_depth(16, 16, 4)
    (1, 16)
    """
    if split < 1:
        raise ValueError(f"split must be at least 1 (got {split})")
    steps = max(-(-depth // block_k), 1)  # ceiling divisions (no Triton needed here)
    per_split = -(-steps // split)
    return -(-steps // per_split), per_split * block_k


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Run the kernel on ``x`` ``[M, K]`` (no fallback); ``config`` overrides :func:`blocks`
    (``benchmarks/bench_fp32_linear.py --sweep``).

    ``config`` is ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split)``, or the first five
    (split 1). The split runs as :func:`split_depth` clamps it; one that clamps to 1 (K of
    one step) is the one-pass kernel. At a split above 1 the partials
    (:func:`launch_partials`) are summed by a second kernel.
    """
    partials = launch_partials(x, weight, bias, config=config)
    split, rows, cols = partials.shape
    if split == 1:
        return partials[0]
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    _sum_partials_kernel[(triton.cdiv(rows * cols, _SUM_BLOCK),)](
        partials,
        bias if bias is not None else partials,
        out,
        rows * cols,
        cols,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
    )
    return out


def launch_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The kernel's ``[split, M, N]`` float32 output for ``x`` ``[M, K]``: at split 1 the
    product with the bias added, above 1 each range of K's partial product, without the
    bias (:func:`sum_partials` or the sum kernel adds it). ``config`` as for :func:`launch`.
    """
    rows, depth = x.shape
    if config is None:
        config = blocks(rows, weight.shape[0], depth)
    return _launch((weight,), None if bias is None else (bias,), x, config)


def group_blocks(
    rows: int, cols: Sequence[int], depth: int, split: int
) -> tuple[int, int, int, int, int, int] | None:
    """Blocks for weights of ``cols`` output columns each, side by side in one launch at
    ``split``: :func:`blocks` of the whole output, its ``BLOCK_N`` narrowed (to 32, then
    16) until every member starts on a tile; None when none does (no grouping then)."""
    block_m, block_n, block_k, warps, stages, _ = blocks(rows, sum(cols), depth)
    starts = list(itertools.accumulate(cols))[:-1]
    for width in (block_n, 32, 16):
        if width <= block_n and all(start % width == 0 for start in starts):
            return block_m, width, block_k, warps, stages, split
    return None


def launch_group_partials(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None,
    split: int,
    *,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Two or three linear layers that read the same ``x`` in one launch (q/k/v, gate/up):
    ``[split, M, N_0 + N_1 (+ N_2)]``, each member's partials (or, at split 1, output with
    its bias) in its own columns, computed as :func:`launch_partials` computes them; the
    blocks from :func:`group_blocks` at ``x``'s rows (which must not be None), or
    ``config``, whose ``BLOCK_N`` must divide the members' first columns (and whose split
    then replaces ``split``)."""
    rows, depth = x.shape
    if config is None:
        config = group_blocks(rows, [w.shape[0] for w in weights], depth, split)
    if config is None:
        raise ValueError("no BLOCK_N puts every member of this group on a tile of its own")
    return _launch(tuple(weights), None if biases is None else tuple(biases), x, config)


def _launch(
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor, ...] | None,
    x: torch.Tensor,
    config: tuple[int, ...],
) -> torch.Tensor:
    if len(config) not in (5, 6):
        raise ValueError(
            f"config is (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, split]), got {config}"
        )
    rows, depth = x.shape
    block_m, block_n, block_k, warps, stages = config[:5]
    split, k_per_split = split_depth(depth, block_k, config[5] if len(config) == 6 else 1)
    x = x if x.stride(-1) == 1 else x.contiguous()
    group = members(x, weights, biases)
    if any(start % block_n for start in group.starts):
        raise ValueError(f"BLOCK_N {block_n} does not divide the members' first columns")
    partials = torch.empty((split, rows, group.cols), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(group.cols, block_n), triton.cdiv(rows, block_m), split)
    _fp32_linear_kernel[grid](
        x,
        x.stride(0),
        *group.args,
        partials,
        rows,
        group.cols,
        depth,
        *group.firsts,
        k_per_split,
        HAS_BIAS=biases is not None and split == 1,
        MEMBERS=len(weights),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT=split,
        PRECISION="tf32x3",
        num_warps=warps,
        num_stages=stages,
    )
    return partials
