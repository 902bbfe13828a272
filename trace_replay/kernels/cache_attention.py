"""Decode attention over a static KV cache that never reads the slots no query can see.

The static backend's cache has one length for a whole wave (a bucket: 256 slots for 16
prompt + 128 trace tokens), and its additive mask hides what a row has not written yet.
Scaled-dot-product attention under a mask reads every slot of every row at every step:
at the start of a wave most of them are hidden from every query. Here one program per
(row, kv head) takes the ``G * q`` query rows that share that kv head (``G`` query heads
per kv head, ``q`` tokens per row), walks the cache ``BLOCK_N`` slots at a time, and skips
a block the mask hides from all of them: its keys and values are never loaded. The
softmax is the online one of flash attention, in float32.

A skipped block changes nothing: a hidden slot's weight is ``exp(score + min - max)``,
which is exactly 0 in float32 once any visible slot has set the row's maximum (each row
sees its own slot).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import functools

import torch
import torch.nn.functional as F

from trace_replay.kernels._triton import interpreting, tl, triton, use_triton

__all__ = ["MAX_QUERY_ROWS", "cache_attention", "cache_attention_reference", "grouped_mask"]

MAX_QUERY_ROWS = 64  # G * q per program; wider (prefill) is left to the caller's SDPA


@triton.jit
def _cache_attention_kernel(
    query_ptr,  # [B, H_kv, M, D] float, last stride 1; row g * q + i: head g's token i
    query_strides_b,
    query_strides_h,
    query_strides_m,
    key_ptr,  # [B, H_kv, L, D], same dtype, last stride 1
    key_strides_b,
    key_strides_h,
    key_strides_n,
    value_ptr,  # [B, H_kv, L, D], same dtype, last stride 1
    value_strides_b,
    value_strides_h,
    value_strides_n,
    mask_ptr,  # [B, q, L] additive, any float dtype; the same for every head
    mask_strides_b,
    mask_strides_q,
    mask_strides_n,
    out_ptr,  # [B, H_kv, M, D] contiguous, query's dtype, written
    rows,
    q,
    length,
    dim,
    scale,
    hidden_below,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FLOAT32_DOTS: tl.constexpr,
    PRECISION: tl.constexpr,  # of the float32 dots: "ieee" or "tf32x3"
):
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    row_ok, dim_ok = offs_m < rows, offs_d < dim
    query = tl.load(
        query_ptr
        + b * query_strides_b
        + h * query_strides_h
        + offs_m[:, None] * query_strides_m
        + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if FLOAT32_DOTS:
        query = query.to(tl.float32)
    mask_rows = mask_ptr + b * mask_strides_b + (offs_m % q)[:, None] * mask_strides_q
    keys_base = key_ptr + b * key_strides_b + h * key_strides_h + offs_d[None, :]
    values_base = value_ptr + b * value_strides_b + h * value_strides_h + offs_d[None, :]
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, length, BLOCK_N):
        slot = start + offs_n
        slot_ok = slot < length
        bias = tl.load(
            mask_rows + slot[None, :] * mask_strides_n,
            mask=row_ok[:, None] & slot_ok[None, :],
            other=float("-inf"),
        )
        bias = bias.to(tl.float32)
        if tl.max(tl.max(bias, axis=1), axis=0) > hidden_below:
            load_ok = slot_ok[:, None] & dim_ok[None, :]
            keys = tl.load(keys_base + slot[:, None] * key_strides_n, mask=load_ok, other=0.0)
            values = tl.load(values_base + slot[:, None] * value_strides_n, mask=load_ok, other=0.0)
            if FLOAT32_DOTS:
                keys, values = keys.to(tl.float32), values.to(tl.float32)
                scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION)
            else:
                scores = tl.dot(query, tl.trans(keys))
            # padding rows (past `rows`) see every real slot: finite garbage, never stored
            scores = scores * scale + tl.where(row_ok[:, None], bias, 0.0)
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # a row with nothing visible yet keeps -inf; shift by 0 so exp gives 0, not NaN
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(weights, axis=1)
            if FLOAT32_DOTS:
                acc = acc * rescale[:, None] + tl.dot(
                    weights.to(values.dtype), values, input_precision=PRECISION
                )
            else:
                acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
            row_max = new_max
    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + ((b * tl.num_programs(1) + h) * rows + offs_m[:, None]) * dim + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def cache_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    precision: str = "ieee",
) -> torch.Tensor:
    """Attention of grouped queries over a KV cache, skipping blocks the mask hides from all.

    Runs the Triton kernel when :func:`~trace_replay.kernels._triton.use_triton` allows it (CUDA
    tensors, or ``TRITON_INTERPRET=1``), else :func:`cache_attention_reference`. Inside
    ``torch.compile`` it is one opaque operator (``torch.ops.trace_replay.cache_attention``).

    Parameters
    ----------
    query
        ``[B, H_kv, G * q, D]``: row ``g * q + i`` is query head ``g`` of the kv head, token
        ``i`` of the row; ``G * q <= MAX_QUERY_ROWS``.
    key, value
        ``[B, H_kv, L, D]``, the dtype of ``query``.
    mask
        ``[B, 1, q, L]`` additive (0 visible, the dtype's most negative value hidden); a
        block of slots whose every entry is below half that value for every query of a
        row is skipped.
    scale
        Multiplies the scores before the mask is added.
    precision
        How the kernel multiplies float32 inputs: ``"ieee"`` (float32 FMAs, no tensor
        cores) or ``"tf32x3"`` (tensor cores, each input split into a TF32 part and its
        TF32 remainder, as :mod:`~trace_replay.kernels.fp32_linear` does; within float32
        rounding of float64). 16-bit inputs ignore it.

    Returns
    -------
    torch.Tensor
        ``[B, H_kv, G * q, D]`` contiguous, the dtype of ``query``.

    Examples
    --------
    >>> query, cache = torch.ones(1, 1, 2, 16), torch.arange(32.0).reshape(1, 1, 2, 16)
    >>> mask = torch.tensor([[[[0.0, torch.finfo(torch.float32).min]]]])
    >>> cache_attention(query, cache, cache, mask, 1.0)[0, 0, :, :3].tolist()
    [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    """
    batch, kv_heads, rows, dim = query.shape
    if rows > MAX_QUERY_ROWS:
        raise ValueError(f"{rows} query rows per kv head; the kernel takes {MAX_QUERY_ROWS}")
    if rows % mask.shape[2]:
        raise ValueError(
            f"{rows} query rows are not a multiple of the mask's {mask.shape[2]} tokens"
        )
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"precision={precision!r}; choose 'ieee' or 'tf32x3'")
    if not use_triton(query, key, value, mask):
        return cache_attention_reference(query, key, value, mask, scale)
    return torch.ops.trace_replay.cache_attention(query, key, value, mask, float(scale), precision)


@torch.library.custom_op("trace_replay::cache_attention", mutates_args=())
def _cache_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    precision: str,
) -> torch.Tensor:
    return launch(query, key, value, mask, scale, precision=precision)


def launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    precision: str = "ieee",
) -> torch.Tensor:
    """Run the kernel (no fallback); ``block_n``/``num_warps`` override the choices below
    (``benchmarks/bench_cache_attention.py --sweep``)."""
    batch, kv_heads, rows, dim = query.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty((batch, kv_heads, rows, dim), dtype=query.dtype, device=query.device)
    block_d = max(16, triton.next_power_of_2(dim))
    # Blocks and warps from the sweep; float32 keeps 4 warps (some of its configurations
    # spill at 2). Fewer programs than SMs leave the GPU idle but for each program's walk
    # down the cache, so 16-bit inputs then take longer steps with more warps.
    few = (
        query.dtype != torch.float32
        and block_d <= 128
        and batch * kv_heads < _multiprocessors(query.device)
    )
    if block_n is None:
        block_n = 128 if few else 32 if block_d > 128 else 64
    if num_warps is None:
        num_warps = 4 if query.dtype == torch.float32 or few else 2
    _cache_attention_kernel[(batch, kv_heads)](
        query,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value,
        value.stride(0),
        value.stride(1),
        value.stride(2),
        mask,
        mask.stride(0),
        mask.stride(2),
        mask.stride(3),
        out,
        rows,
        mask.shape[2],
        key.shape[2],
        dim,
        scale,
        torch.finfo(mask.dtype).min / 2,
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        # float32 inputs multiply at `precision` (never plain TF32); and Triton's
        # interpreter gets bfloat16 dots wrong (3.9), so under it every dot is in float32
        FLOAT32_DOTS=query.dtype == torch.float32 or interpreting(),
        PRECISION=precision if query.dtype == torch.float32 else "ieee",
        num_warps=num_warps,
    )
    return out


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: the choice is moot
    return torch.cuda.get_device_properties(device).multi_processor_count


@_cache_attention_op.register_fake
def _(query, key, value, mask, scale, precision):
    return query.new_empty(query.shape)


def cache_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Pure-torch :func:`cache_attention`: SDPA over every slot, the mask repeated per head."""
    mask = grouped_mask(mask, query.shape[2] // mask.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, 1, q, L]`` mask for the ``groups * q`` query rows of a kv head (a view)."""
    batch, _, q, length = mask.shape
    if q == 1:
        return mask
    return (
        mask[:, :, None].expand(batch, 1, groups, q, length).reshape(batch, 1, groups * q, length)
    )
