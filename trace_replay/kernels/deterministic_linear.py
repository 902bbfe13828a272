"""``x @ weight.T`` whose every output row depends on its own input row alone.

A batch-invariant linear layer: row ``r`` of the result is bitwise the same whatever the
other rows hold, where row ``r`` sits and how many rows there are.

* **Triton** (CUDA): one program per ``BLOCK_M x BLOCK_N`` output tile, each running the
  whole reduction over ``K`` in ``BLOCK_K`` steps in the same order; the tile sizes are
  constants (no autotuning keyed on the row count, no split-K), so the arithmetic of an
  output element is fixed by ``K`` and its column alone. float32 inputs use IEEE products
  (no TF32).
* **3xTF32** (CUDA, float32; :func:`linear_rows_3xtf32`): the tensor-core kernel of
  :mod:`~trace_replay.kernels.fp32_linear` at a configuration fixed by the weight's shape
  alone (tiles, warps, stages and the split of ``K``: what that module picks for a
  64-row call), so a row's products and the order its ``K`` partials are added in are the
  same at 1 row or 10,000. One launch per layer (two at a split above 1), where the
  reference path makes one call per block of rows; float32 accuracy as the default
  float32 decode has it (the 3xTF32 split). :func:`linear_parts_3xtf32` is the same
  kernel for one to three weights side by side (q/k/v, gate/up), its split-K partials
  left for the kernel that reads the output to add.
* **Reference** (the CPU path): ``F.linear`` over blocks of rows whose sizes come from a
  fixed menu (:func:`block_plan`). A GEMM library picks its algorithm from the call's
  shape; a fixed shape fixes the algorithm, and row ``r``'s reduction order then does not
  depend on the other rows' values or on ``r``'s position in the block (verified at engine
  start by :func:`~trace_replay.engines.builtin.backends.deterministic_ops.probe_linear`, which also checks
  whether the menu's sizes agree with one another; if they do not, the menu is one size).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trace_replay.kernels import fp32_linear
from trace_replay.kernels._triton import tl, triton

__all__ = [
    "INVARIANT_ROWS",
    "block_plan",
    "config_3xtf32",
    "group_config_3xtf32",
    "linear_parts_3xtf32",
    "linear_rows_3xtf32",
    "linear_rows_reference",
    "linear_rows_triton",
]

# Tile of one program. Constants: the arithmetic of an output element must not depend on
# the number of rows (autotuning keyed on M, or split-K, would make it depend).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _linear_kernel(
    x_ptr,  # [R, K], float, rows of the input
    w_ptr,  # [N, K], float, nn.Linear weight
    out_ptr,  # [R, N], float, written
    R,
    N,
    K,
    stride_xr,
    stride_wn,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact products, not TF32
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        # masked loads give 0: a padded k adds 0 * 0 to every element alike
        a = tl.load(
            x_ptr + rows[:, None] * stride_xr + k[None, :],
            mask=(rows[:, None] < R) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None],
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    mask = (rows[:, None] < R) & (cols[None, :] < N)
    tl.store(
        out_ptr + rows[:, None] * stride_or + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` by the Triton kernel, any number of rows.

    Parameters
    ----------
    x : torch.Tensor
        ``[R, K]`` rows (made contiguous).
    weight : torch.Tensor
        ``[N, K]`` weight of an ``nn.Linear`` (made contiguous), same dtype as ``x``.

    Returns
    -------
    torch.Tensor
        ``[R, N]`` in ``x``'s dtype, accumulated in float32.
    """
    x, weight = x.contiguous(), weight.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](
        x,
        weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32,
    )
    return out


# the row count whose fp32_linear configuration every call of linear_rows_3xtf32 uses: a
# decode step's (a wave of 64 traces), so decode runs at the default path's tiles
INVARIANT_ROWS = 64


def config_3xtf32(cols: int, depth: int) -> tuple[int, int, int, int, int, int]:
    """The one ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split)`` that
    :func:`linear_rows_3xtf32` runs for a ``[cols, depth]`` weight, whatever the row count:
    :func:`~trace_replay.kernels.fp32_linear.blocks` at :data:`INVARIANT_ROWS` rows.

    Examples
    --------
    >>> config_3xtf32(576, 576) == fp32_linear.blocks(INVARIANT_ROWS, 576, 576)
    True
    """
    return fp32_linear.blocks(INVARIANT_ROWS, cols, depth)


def linear_rows_3xtf32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 ``x @ weight.T`` on tensor cores (3xTF32), row ``r`` a function of ``x[r]``.

    Every call for one weight shape runs :func:`config_3xtf32`'s configuration: the same
    tiles, the same ``K`` ranges, the partials added in the same order (split-K's sum is an
    elementwise pass), so the number of rows, the other rows and a row's place in its tile
    do not reach its arithmetic. That a tensor-core product treats every row of a tile
    alike is the hardware's contract, checked bitwise on CUDA by
    ``tests/kernels/test_deterministic_kernels.py``.

    Parameters
    ----------
    x : torch.Tensor
        ``[R, K]`` float32 rows.
    weight : torch.Tensor
        ``[N, K]`` float32 ``nn.Linear`` weight.

    Returns
    -------
    torch.Tensor
        ``[R, N]`` float32, within float32 rounding of the float64 product.
    """
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"linear_rows_3xtf32 takes float32 (got {x.dtype} and {weight.dtype})")
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    config = config_3xtf32(weight.shape[0], weight.shape[1])
    return fp32_linear.launch(x, weight.contiguous(), config=config)


def group_config_3xtf32(cols: Sequence[int], depth: int) -> tuple[int, ...] | None:
    """The one configuration that :func:`linear_parts_3xtf32` runs for weights of ``cols``
    output columns each (``[c, depth]``), side by side in one launch, whatever the row count:
    :func:`~trace_replay.kernels.fp32_linear.group_blocks` at :data:`INVARIANT_ROWS` rows
    with the split :func:`config_3xtf32` gives their whole output; None when no tile width
    puts every member on tiles of its own.

    Examples
    --------
    >>> group_config_3xtf32([576, 192, 192], 576)[:2], group_config_3xtf32([20, 12], 64)
    ((64, 32), None)
    """
    split = config_3xtf32(sum(cols), depth)[5]
    return fp32_linear.group_blocks(INVARIANT_ROWS, list(cols), depth, split)


def linear_parts_3xtf32(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 ``x @ W.T`` for one to three weights that read ``x`` (q/k/v, gate/up), their
    outputs side by side, as unsummed ``[S, R, N_0 + N_1 (+ N_2)]`` partials: one launch at
    :func:`group_config_3xtf32` (one weight: :func:`config_3xtf32`), so row ``r``'s partials
    depend on ``x[r]`` alone, as in :func:`linear_rows_3xtf32`. The partials' sum in order
    (:func:`~trace_replay.kernels.fp32_linear.sum_partials`) is the product; the caller adds
    it in whatever reads it next (:mod:`~trace_replay.kernels.deterministic_epilogues`).

    Raises
    ------
    ValueError
        On inputs that are not float32, or weights that no tile width separates
        (:func:`group_config_3xtf32` is None: launch them one at a time).
    """
    if x.dtype != torch.float32 or any(w.dtype != torch.float32 for w in weights):
        raise ValueError(
            f"linear_parts_3xtf32 takes float32 (got {x.dtype} and {[w.dtype for w in weights]})"
        )
    cols = [w.shape[0] for w in weights]
    if x.shape[0] == 0:
        return x.new_empty((1, 0, sum(cols)))
    if len(weights) == 1:
        return fp32_linear.launch_partials(
            x, weights[0].contiguous(), config=config_3xtf32(cols[0], x.shape[1])
        )
    config = group_config_3xtf32(cols, x.shape[1])
    if config is None:
        raise ValueError(f"no tile width puts every member of {cols} on tiles of its own")
    return fp32_linear.launch_group_partials(x, weights, None, config[5], config=config)


def block_plan(rows: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Split ``rows`` into blocks of the menu ``sizes``: ``[(start, size), ...]``.

    Whole blocks of the largest size first; the rest goes in the smallest size that holds
    it (the last block may reach past ``rows``: the caller pads).
    """
    largest = max(sizes)
    plan = [(start, largest) for start in range(0, rows - rows % largest, largest)]
    rest = rows % largest
    if rest:
        plan.append((rows - rest, min(s for s in sizes if s >= rest)))
    return plan


def linear_rows_reference(
    x: torch.Tensor, weight: torch.Tensor, sizes: Sequence[int] = (16,)
) -> torch.Tensor:
    """``x @ weight.T`` as ``F.linear`` calls on blocks of rows from the menu ``sizes``.

    Every call has ``[size, K]`` rows, zero-padded at the end; the padding rows are dropped.

    Parameters
    ----------
    x : torch.Tensor
        ``[R, K]`` rows.
    weight : torch.Tensor
        ``[N, K]``.
    sizes : Sequence[int]
        Row counts a GEMM call may have.

    Returns
    -------
    torch.Tensor
        ``[R, N]``.
    """
    rows = x.shape[0]
    plan = block_plan(rows, sizes)
    if not plan:
        return x.new_empty((0, weight.shape[0]))
    end = plan[-1][0] + plan[-1][1]
    if end > rows:
        x = torch.cat([x, x.new_zeros((end - rows, x.shape[1]))])
    out = [F.linear(x[start : start + size].contiguous(), weight) for start, size in plan]
    return torch.cat(out)[:rows] if len(out) > 1 else out[0][:rows]
