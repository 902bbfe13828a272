"""Row-invariant attention with the queries of one trace taken a tile at a time.

The semantics of :mod:`~trace_replay.kernels.deterministic_attention` (each query row attends
over its own cache row, to the slots ``valid`` marks up to its own slot and always its own
slot; keys visited from slot 0 in blocks of :data:`~trace_replay.kernels.deterministic_attention.BLOCK_N`
with an online softmax in float32), computed for up to :data:`BLOCK_Q` query rows of one
cache row per program, so a prefill's queries share every key and value load and the two
products of a key block run as ``tl.dot`` on tensor cores (3xTF32: float32 accuracy).

Why a row's bits do not depend on its tile:

* the tile's shape is a constant (``BLOCK_Q`` queries × the heads of one kv head, padded),
  so a decode step's tile (one query, the rest masked) and a prefill's (up to ``BLOCK_Q``
  queries) run the same compiled kernel, and a tensor-core product computes each element
  of its output with the same instructions whatever the other rows hold (the contract
  :func:`~trace_replay.kernels.deterministic_linear.linear_rows_3xtf32` rests on too);
* the softmax's reductions run along a row of the tile, each row alike;
* a tile walks key blocks up to its last query's slot; for a query with an earlier slot
  the blocks past its own hold no allowed key, and such a block is an exact no-op: its
  maximum is ``-inf``, so the running maximum stays, the rescale factor is exactly 1, its
  probabilities are exactly 0 and it adds exact zeros.

The caller says which rows form a tile: ``tiles`` holds boundaries (tile ``t`` is rows
``tiles[t]`` to ``tiles[t + 1] - 1``), every tile at most ``BLOCK_Q`` rows of one cache
row. ``torch.arange(R + 1)`` (one row per tile) is always valid: a decode step's form.

The pure-torch reference is :func:`~trace_replay.kernels.deterministic_attention.attention_rows_reference`
(same numbers within float32 rounding).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

from collections.abc import Sequence

import torch

from trace_replay.kernels._triton import tl, triton
from trace_replay.kernels.deterministic_attention import BLOCK_N, launch_args

__all__ = ["BLOCK_Q", "attention_tiles_triton", "tile_bounds"]

BLOCK_Q = 16  # query rows per tile (times the padded heads per kv head: the tile's rows)


@triton.jit
def _tiled_attention_kernel(
    q_ptr,  # [R, H, D], float, queries (rotary applied)
    k_ptr,  # [B, H_kv, L, D], float, key cache
    v_ptr,  # [B, H_kv, L, D], float, value cache
    valid_ptr,  # [B, L], int8, 1 where a slot holds a key in context
    cache_row_ptr,  # [R], int64
    slot_ptr,  # [R], int64, each query's own slot
    tiles_ptr,  # [T + 1], int64, tile boundaries (rows)
    out_ptr,  # [R, H, D], float, written
    scale,
    L,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_valid,
    stride_or,
    stride_oh,
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,  # power of two >= G
    D: tl.constexpr,
    D_PAD: tl.constexpr,  # power of two >= D
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(tiles_ptr + tile)
    count = tl.load(tiles_ptr + tile + 1) - first
    # the tile's rows: query i (of the tile) with head g of this kv head at row i * G_PAD + g
    m = tl.arange(0, BLOCK_Q * G_PAD)
    query = m // G_PAD
    g = m % G_PAD
    live = (query < count) & (g < G)
    row = first + query
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    b = tl.load(cache_row_ptr + first, mask=count > 0, other=0)  # the tile's one cache row
    own = tl.load(slot_ptr + row, mask=live, other=-1)  # dead rows allow no key
    heads = kv_head * G + g
    q = tl.load(
        q_ptr + row[:, None] * stride_qr + heads[:, None] * stride_qh + d[None, :],
        mask=live[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full((BLOCK_Q * G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * G_PAD, D_PAD), tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    last = tl.max(own, axis=0)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    for start in range(0, last + 1, BLOCK_N):
        t = start + offsets
        inside = t < L
        kv_mask = inside[:, None] & d_ok[None, :]
        keys = tl.load(k_base + t[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        scores = tl.dot(q, tl.trans(keys), input_precision="tf32x3") * scale
        ok = tl.load(valid_ptr + b * stride_valid + t, mask=inside, other=0) != 0
        allowed = (ok[None, :] & (t[None, :] <= own[:, None])) | (t[None, :] == own[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows with nothing allowed yet subtract 0, not -inf (exp(-inf - -inf) is NaN)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - shift))
        p = tl.where(allowed, tl.exp(scores - shift[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(v_base + t[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0).to(
            tl.float32
        )
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="tf32x3")
        m_i = m_new
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_or + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live[:, None] & d_ok[None, :],
    )


def tile_bounds(lengths: Sequence[int], block: int = BLOCK_Q) -> list[int]:
    """Tile boundaries for rows that come as runs of one cache row each (a prefill's
    sequences, ``lengths`` rows each, in order): every run cut into tiles of ``block``
    rows, the last shorter; a run of no rows makes no tile.

    Examples
    --------
    >>> tile_bounds([5, 0, 2], block=4)
    [0, 4, 5, 7]
    """
    bounds = [0]
    for length in lengths:
        if length <= 0:
            continue
        start = bounds[-1]
        bounds += list(range(start + block, start + length, block)) + [start + length]
    return bounds


def attention_tiles_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    cache_row: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    tiles: torch.Tensor,
) -> torch.Tensor:
    """Each query row's attention over its own cache row, a tile of rows per program.

    Takes :func:`~trace_replay.kernels.deterministic_attention.attention_rows_triton`'s
    arguments and returns what it returns (``[R, H, D]`` in ``q``'s dtype), plus:

    Parameters
    ----------
    tiles : torch.Tensor
        ``[T + 1]`` int64 boundaries on ``q``'s device, from 0 to R, increasing, each tile
        at most :data:`BLOCK_Q` rows that share a cache row (not checked: the device would
        have to be read); ``torch.arange(R + 1)`` always qualifies.
    """
    q, out, valid, strides, shape = launch_args(q, k_cache, v_cache, valid)
    if q.shape[0]:
        _tiled_attention_kernel[(tiles.shape[0] - 1, k_cache.shape[1])](
            q,
            k_cache,
            v_cache,
            valid,
            cache_row,
            slot,
            tiles,
            out,
            float(scale),
            k_cache.shape[2],
            *strides,
            **shape,
            BLOCK_Q=BLOCK_Q,
            BLOCK_N=BLOCK_N,
        )
    return out
