"""Attention of one query token per row over its own KV-cache row, batch-invariant.

Row ``r`` is one query token: heads ``q[r]``, its cache row ``cache_row[r]`` and its own
slot ``slot[r]`` in that row. It attends to the keys at slots ``t <= slot[r]`` that
``valid`` marks (and always to its own slot). Keys are visited from slot 0 in fixed blocks
of ``BLOCK_N`` with an online softmax (running max, running sum, rescaled accumulator,
all float32), so a row's arithmetic is fixed by its own keys: not by the other rows, the
cache length, or how many rows share the call. A block that holds no allowed key changes
nothing bitwise: its max is ``-inf``, so the running max stays, the rescale factor is
exactly 1 and its probabilities are exactly 0.

* **Triton** (CUDA): one program per (row, kv head), looping over its own blocks only.
* **Reference** (the CPU path): the same algorithm in torch ops over blocks of rows of a
  fixed count; a row below the block's longest runs extra blocks, which are exact no-ops.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import torch

from trace_replay.kernels._triton import tl, triton

__all__ = ["attention_rows_reference", "attention_rows_triton", "launch_args"]

BLOCK_N = 32  # keys per step; fixed, so a row's reduction order depends on its slot alone


@triton.jit
def _attention_kernel(
    q_ptr,  # [R, H, D], float, queries (one token per row)
    k_ptr,  # [B, H_kv, L, D], float, key cache
    v_ptr,  # [B, H_kv, L, D], float, value cache
    valid_ptr,  # [B, L], int8, 1 where a slot holds a key in context
    cache_row_ptr,  # [R], int64, cache row of each query
    slot_ptr,  # [R], int64, the query's own slot
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
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,  # power of two >= D (tl.arange needs one)
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(cache_row_ptr + row).to(tl.int64)
    own = tl.load(slot_ptr + row).to(tl.int32)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * G + g
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(
        q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    ).to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(0, own + 1, BLOCK_N):
        t = start + offsets
        inside = t < L
        kv_mask = inside[:, None] & (d[None, :] < D)
        keys = tl.load(
            k_ptr + b * stride_kb + kv_head * stride_kh + t[:, None] * stride_kl + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [G_PAD, BLOCK_N]
        ok = tl.load(valid_ptr + b * stride_valid + t, mask=inside, other=0) != 0
        allowed = (ok & (t <= own)) | (t == own)
        scores = tl.where(allowed[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_new))
        p = tl.where(allowed[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(
            v_ptr + b * stride_vb + kv_head * stride_vh + t[:, None] * stride_vl + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def attention_rows_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    cache_row: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each query row's attention over its own cache row, by the Triton kernel.

    Parameters
    ----------
    q : torch.Tensor
        ``[R, H, D]`` query heads of R tokens (rotary applied).
    k_cache, v_cache : torch.Tensor
        ``[B, H_kv, L, D]`` one layer's cache; ``H`` is a multiple of ``H_kv`` (GQA).
    valid : torch.Tensor
        ``[B, L]`` bool: slots that hold a key in context (dropped drafts are False).
    cache_row, slot : torch.Tensor
        ``[R]`` int64: each query's cache row and its own slot there.
    scale : float
        Multiplies ``q . k``.

    Returns
    -------
    torch.Tensor
        ``[R, H, D]`` in ``q``'s dtype.
    """
    q, out, valid, strides, shape = launch_args(q, k_cache, v_cache, valid)
    if q.shape[0]:
        _attention_kernel[(q.shape[0], k_cache.shape[1])](
            q,
            k_cache,
            v_cache,
            valid,
            cache_row,
            slot,
            out,
            float(scale),
            k_cache.shape[2],
            *strides,
            **shape,
            BLOCK_N=BLOCK_N,
        )
    return out


def launch_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor
) -> tuple:
    """What both attention launchers pass alike: ``(q contiguous, out, valid as int8,
    strides, shape constants)``; the strides in the kernels' order (q's row and head, the
    caches' row, head and slot, valid's row, out's row and head), the constants ``G``,
    ``G_PAD``, ``D`` and ``D_PAD``."""
    q = q.contiguous()
    out = torch.empty_like(q)
    valid = valid.view(torch.int8) if valid.dtype == torch.bool else valid
    groups, dim = q.shape[1] // k_cache.shape[1], q.shape[2]
    strides = (
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        valid.stride(0),
        out.stride(0),
        out.stride(1),
    )
    shape = dict(
        G=groups, G_PAD=triton.next_power_of_2(groups), D=dim, D_PAD=triton.next_power_of_2(dim)
    )
    return q, out, valid, strides, shape


def attention_rows_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    cache_row: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    rows_per_call: int = 8,
) -> torch.Tensor:
    """:func:`attention_rows_triton` in torch ops, ``rows_per_call`` query rows at a time.

    Every torch call sees the same shapes (a block of ``rows_per_call`` rows, zero-padded,
    and ``BLOCK_N`` keys), so its algorithm is fixed; the blocks of keys are combined in a
    Python loop from slot 0 on. The cache length must be a multiple of ``BLOCK_N``.
    """
    rows, heads, dim = q.shape
    batch, kv_heads, length, _ = k_cache.shape
    if length % BLOCK_N:
        raise ValueError(f"cache length {length} is not a multiple of {BLOCK_N}")
    groups = heads // kv_heads
    out = torch.empty_like(q)
    pad = -rows % rows_per_call
    q = torch.cat([q, q.new_zeros((pad, heads, dim))]).float()
    # padding rows read cache row 0 at slot 0: always allowed, so finite and inert
    cache_row = torch.cat([cache_row, cache_row.new_zeros(pad)])
    slot = torch.cat([slot, slot.new_zeros(pad)])
    offsets = torch.arange(BLOCK_N, device=q.device)
    for start in range(0, rows + pad, rows_per_call):
        b = cache_row[start : start + rows_per_call]
        own = slot[start : start + rows_per_call]
        qb = q[start : start + rows_per_call].view(rows_per_call, kv_heads, groups, dim)
        m_i = qb.new_full((rows_per_call, kv_heads, groups, 1), float("-inf"))
        l_i = qb.new_zeros((rows_per_call, kv_heads, groups, 1))
        acc = qb.new_zeros((rows_per_call, kv_heads, groups, dim))
        for key_start in range(0, int(own.max()) + 1, BLOCK_N):
            t = key_start + offsets
            keys = k_cache[b, :, key_start : key_start + BLOCK_N].float()  # [rows, H_kv, N, D]
            values = v_cache[b, :, key_start : key_start + BLOCK_N].float()
            scores = torch.matmul(qb, keys.transpose(-1, -2)) * scale  # [rows, H_kv, G, N]
            allowed = (valid[b][:, key_start : key_start + BLOCK_N] & (t <= own[:, None])) | (
                t == own[:, None]
            )
            allowed = allowed[:, None, None, :]
            scores = scores.masked_fill(~allowed, float("-inf"))
            m_new = torch.maximum(m_i, scores.amax(dim=-1, keepdim=True))
            alpha = torch.where(m_new == m_i, 1.0, torch.exp(m_i - m_new))
            p = torch.exp(scores - m_new).masked_fill(~allowed, 0.0)
            l_i = l_i * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, values)
            m_i = m_new
        block = (acc / l_i).view(rows_per_call, heads, dim)
        take = min(rows_per_call, rows - start)
        if take > 0:
            out[start : start + take] = block[:take].to(out.dtype)
    return out
