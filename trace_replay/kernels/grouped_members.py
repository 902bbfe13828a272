"""What the grouped linear kernels share: their members' arguments, and which member an
output tile is in.

A group launch (:mod:`~trace_replay.kernels.fp32_linear`, :mod:`~trace_replay.kernels.gemv`)
puts up to three weights' outputs side by side; the launcher aligns every member's first
column to the tile width, so a tile lies inside one member. :func:`members` prepares the
launchers' arguments, :func:`tile_member` is the kernels' lookup.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from trace_replay.kernels._triton import tl, triton

__all__ = ["Members", "members", "tile_member"]


class Members(NamedTuple):
    """One to three weights (and biases) as a group kernel takes them."""

    args: list  # weight, weight1, weight2, the shared row stride, bias, bias1, bias2
    starts: list[int]  # first output column of each member after the first
    cols: int  # output columns of all members
    firsts: list[int]  # the kernel's first1, first2 (past the end for absent members)


def members(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None
) -> Members:
    """The kernel arguments of ``weights`` (``[N_i, K]`` each) and ``biases`` (one per weight,
    or None) for a launch on ``x`` ``[M, K]``.

    A lone weight keeps its own row stride; members are made contiguous, so that they share
    one (``K``). Absent members' pointers repeat the first's (never read: ``MEMBERS`` stops
    the kernel before them); without biases every bias pointer is ``x`` (never read).
    """
    if not 1 <= len(weights) <= 3 or (biases is not None and len(biases) != len(weights)):
        raise ValueError(
            f"{len(weights)} weights and {biases and len(biases)} biases: "
            "one to three weights, and a bias for each or for none"
        )
    if len(weights) == 1 and weights[0].stride(-1) == 1:  # any row stride
        row_stride = weights[0].stride(0)
    else:
        weights, row_stride = [w.contiguous() for w in weights], x.shape[1]
    bias_ptrs = _three([b.contiguous() for b in biases]) if biases is not None else [x] * 3
    starts = list(itertools.accumulate(w.shape[0] for w in weights))
    cols = starts[-1]
    return Members(
        [*_three(weights), row_stride, *bias_ptrs],
        starts[:-1],
        cols,
        [*starts[:-1], cols, cols][:2],
    )


def _three(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [*tensors, *[tensors[0]] * (3 - len(tensors))]


@triton.jit
def tile_member(
    tile_start,  # the tile's first output column
    weight_ptr,
    weight1_ptr,
    weight2_ptr,
    bias_ptr,
    bias1_ptr,
    bias2_ptr,
    first1,
    first2,  # output columns where the second and third members start
    MEMBERS: tl.constexpr,
):
    """Return ``(weight, bias, first)``: the member's weight and bias pointers and its
    first output column (the tile's weight rows are its columns less ``first``)."""
    w_base, b_base, first = weight_ptr, bias_ptr, tile_start * 0
    if MEMBERS > 1:
        if tile_start >= first1:
            w_base, b_base, first = weight1_ptr, bias1_ptr, first1
    if MEMBERS > 2:
        if tile_start >= first2:
            w_base, b_base, first = weight2_ptr, bias2_ptr, first2
    return w_base, b_base, first
