"""The opening the grouped linear kernels share: which member weight an output tile is in.

A group launch (:mod:`~trace_replay.kernels.fp32_linear`, :mod:`~trace_replay.kernels.gemv`)
puts up to three weights' outputs side by side; the launcher aligns every member's first
column to the tile width, so a tile lies inside one member.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from trace_replay._triton import tl, triton

__all__ = ["tile_member"]


@triton.jit
def tile_member(
    tile_start,  # the tile's first output column
    weight_ptr, weight1_ptr, weight2_ptr,
    bias_ptr, bias1_ptr, bias2_ptr,
    first1, first2,  # output columns where the second and third members start
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
