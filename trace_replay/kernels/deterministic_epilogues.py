"""What follows a linear layer in deterministic mode, fused with the linear's partial sum.

The row-invariant GEMM (:func:`~trace_replay.kernels.deterministic_linear.linear_parts_3xtf32`)
leaves ``[S, R, N]`` float32 partials, ``S`` ranges of ``K`` fixed by the weight's shape.
The step after it reads them, adds them in the order ``0, 1, ..., S - 1`` and then the bias
(the order of :func:`~trace_replay.kernels.fp32_linear.sum_partials`), rounds to the
model's dtype (what the linear's output would hold), and goes on in the same kernel:

* :func:`rotary_cache_triton`: a layer's q/k/v projection. Rotary on q and k (cos/sin from
  the table row of each row's position), k and v written into the layer's cache at the
  row's (cache row, slot), q returned.
* :func:`residual_norm_triton`: the residual stream ``x + out`` and the RMSNorm of it that
  the next step reads (the post-attention norm, the next layer's input norm, the final norm).
* :func:`silu_mul_triton`: ``silu(gate) * up`` of one gate/up projection.

A row's arithmetic is its own: programs own whole rows or single elements, a norm reduces
its whole padded row in one ``tl.sum``, and nothing is shaped by the number of rows. So a
decode step and a prefill chunk give a row the same bits. Paths whose linears are not the
partials kind (linears in row blocks) hand in their outputs as ``S = 1`` partials.

Each launcher has a pure-torch reference (``*_reference``, the CPU path's formulas) that
agrees within float rounding, not bitwise: the compiler may contract a multiply and an add.
:func:`sum_parts` is bitwise the kernels' sum (additions only), for an observer that wants
a linear's output.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import torch

from trace_replay.kernels._triton import tl, triton

__all__ = [
    "residual_norm_reference",
    "residual_norm_triton",
    "rotary_cache_reference",
    "rotary_cache_triton",
    "silu_mul_reference",
    "silu_mul_triton",
    "sum_parts",
]

HEADS_PER_PROGRAM = 4  # q/k/v heads of one row per rotary program
_SILU_BLOCK = 1024  # elements per SiLU program (an elementwise pass: any size works)


@triton.jit
def _linear_out(
    parts_ptr,
    bias_ptr,
    offs,
    cols,
    mask,
    part_stride,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    dtype_ptr,
):
    """The linear's output at ``offs`` (column ``cols``) as float32 holding a value of
    ``dtype_ptr``'s element type: partial 0, plus 1, ..., plus the bias, rounded to it."""
    acc = tl.load(parts_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(parts_ptr + s * part_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return acc.to(dtype_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotary_cache_kernel(
    parts_ptr,  # [S, R, (H + 2 H_kv) D], q | k | v side by side
    bias_ptr,  # [(H + 2 H_kv) D], or any pointer when not HAS_BIAS
    cos_ptr,
    sin_ptr,  # [P, D] tables, rows by position
    position_ptr,
    cache_row_ptr,
    slot_ptr,  # [R] int64 each
    q_ptr,  # [R, H, D], written
    k_ptr,
    v_ptr,  # [B, H_kv, L, D] one layer's cache, written at (cache row, slot)
    part_stride,
    stride_table,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program (of the H + 2 H_kv)
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    DTYPE = q_ptr.dtype.element_ty  # the model's: q's, the cache's, the projection's output's
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, D_PAD)
    half = D // 2
    # rotate_half: the first half takes -x[d + half], the second x[d - half]
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    ok = (head[:, None] < H + 2 * H_KV) & (d[None, :] < D)
    cols = head[:, None] * D + d[None, :]
    width = (H + 2 * H_KV) * D
    x = _linear_out(
        parts_ptr, bias_ptr, row * width + cols, cols, ok, part_stride, SPLIT, HAS_BIAS, q_ptr
    )
    partner_cols = head[:, None] * D + partner[None, :]
    xp = _linear_out(
        parts_ptr,
        bias_ptr,
        row * width + partner_cols,
        partner_cols,
        ok,
        part_stride,
        SPLIT,
        HAS_BIAS,
        q_ptr,
    )
    position = tl.load(position_ptr + row)
    cos = tl.load(cos_ptr + position * stride_table + d, mask=d < D, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_table + d, mask=d < D, other=0.0).to(tl.float32)
    rotated = x * cos[None, :] + (sign[None, :] * xp) * sin[None, :]
    is_q = head < H
    is_k = (head >= H) & (head < H + H_KV)
    is_v = head >= H + H_KV
    tl.store(q_ptr + row * H * D + cols, rotated.to(DTYPE), mask=ok & is_q[:, None])
    b = tl.load(cache_row_ptr + row)
    slot = tl.load(slot_ptr + row)
    k_head = tl.where(is_k, head - H, 0)
    tl.store(
        k_ptr + b * stride_kb + k_head[:, None] * stride_kh + slot * stride_kl + d[None, :],
        rotated.to(DTYPE),
        mask=ok & is_k[:, None],
    )
    v_head = tl.where(is_v, head - H - H_KV, 0)
    tl.store(
        v_ptr + b * stride_vb + v_head[:, None] * stride_vh + slot * stride_vl + d[None, :],
        x.to(DTYPE),
        mask=ok & is_v[:, None],
    )


@triton.jit
def _residual_norm_kernel(
    parts_ptr,  # [S, R, N]
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    x_ptr,  # [R, N] the residual stream
    weight_ptr,  # [N] the norm's weight
    x_out_ptr,
    h_ptr,  # [R, N] each, written: x + out, and its norm
    part_stride,
    N,
    eps,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= N
):
    DTYPE = x_out_ptr.dtype.element_ty  # the stream's: the linear's output is rounded to it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    out = _linear_out(
        parts_ptr, bias_ptr, row * N + cols, cols, mask, part_stride, SPLIT, HAS_BIAS, x_out_ptr
    )
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    new = (x + out).to(DTYPE)
    tl.store(x_out_ptr + row * N + cols, new, mask=mask)
    # the norm as trace_replay.kernels.deterministic_rms_norm computes it
    new32 = new.to(tl.float32)
    variance = tl.sum(new32 * new32, axis=0) / N
    normed = (new32 * tl.rsqrt(variance + eps)).to(DTYPE)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(h_ptr + row * N + cols, (weight * normed).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    parts_ptr,  # [S, R, 2 I], gate | up side by side
    bias_ptr,  # [2 I], or any pointer when not HAS_BIAS
    out_ptr,  # [R, I], written
    part_stride,
    inter,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DTYPE = out_ptr.dtype.element_ty  # the model's
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = row * 2 * inter
    gate = _linear_out(
        parts_ptr, bias_ptr, base + cols, cols, mask, part_stride, SPLIT, HAS_BIAS, out_ptr
    )
    up = _linear_out(
        parts_ptr,
        bias_ptr,
        base + inter + cols,
        inter + cols,
        mask,
        part_stride,
        SPLIT,
        HAS_BIAS,
        out_ptr,
    )
    tl.store(out_ptr + row * inter + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(DTYPE), mask=mask)


def _common(parts: torch.Tensor, bias: torch.Tensor | None) -> dict:
    if parts.dim() != 3 or not parts.is_contiguous():
        raise ValueError(f"parts must be a contiguous [S, R, N] tensor (got {tuple(parts.shape)})")
    if bias is not None and bias.shape != (parts.shape[2],):
        raise ValueError(
            f"bias has shape {tuple(bias.shape)}; the parts have {parts.shape[2]} columns"
        )
    return dict(SPLIT=parts.shape[0], HAS_BIAS=bias is not None)


def rotary_cache_triton(
    parts: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_row: torch.Tensor,
    slot: torch.Tensor,
    heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """q with rotary applied; k (rotary applied) and v written into the cache.

    Parameters
    ----------
    parts : torch.Tensor
        ``[S, R, (H + 2 H_kv) D]`` partials of the q/k/v projection (members side by side).
    bias : torch.Tensor or None
        ``[(H + 2 H_kv) D]`` the projection's bias, added after the partials.
    cos, sin : torch.Tensor
        ``[P, D]`` rotary tables, row ``p`` for position ``p`` (attention scaling included).
    positions, cache_row, slot : torch.Tensor
        ``[R]`` int64: each row's rotary position, cache row and slot.
    k_cache, v_cache : torch.Tensor
        ``[B, H_kv, L, D]`` one layer's cache, written at ``[cache_row[r], :, slot[r]]``.
    heads : int
        ``H``, the query heads.
    dtype : torch.dtype
        The model's: the projection's output is rounded to it, q and the cache hold it.

    Returns
    -------
    torch.Tensor
        ``[R, H, D]`` queries in ``dtype``.
    """
    _, rows, width = parts.shape
    kv_heads, dim = k_cache.shape[1], k_cache.shape[3]
    if width != (heads + 2 * kv_heads) * dim:
        raise ValueError(
            f"parts have {width} columns; {heads} + 2 x {kv_heads} heads of {dim} "
            f"need {(heads + 2 * kv_heads) * dim}"
        )
    q = torch.empty((rows, heads, dim), dtype=dtype, device=parts.device)
    if rows:
        grid = (rows, triton.cdiv(heads + 2 * kv_heads, HEADS_PER_PROGRAM))
        _rotary_cache_kernel[grid](
            parts,
            bias if bias is not None else parts,
            cos,
            sin,
            positions,
            cache_row,
            slot,
            q,
            k_cache,
            v_cache,
            rows * width,
            cos.stride(0),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            H=heads,
            H_KV=kv_heads,
            D=dim,
            D_PAD=triton.next_power_of_2(dim),
            HEADS=HEADS_PER_PROGRAM,
            **_common(parts, bias),
        )
    return q


def residual_norm_triton(
    parts: torch.Tensor,
    bias: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + out, rms_norm(x + out) * weight)``, ``out`` the linear's output in ``x``'s dtype.

    ``parts`` ``[S, R, N]`` and ``bias`` ``[N]`` as :func:`rotary_cache_triton` takes them,
    ``x`` ``[R, N]`` the residual stream (read, not written), ``weight`` the norm's.
    """
    _, rows, width = parts.shape
    x = x.contiguous()
    new = torch.empty_like(x)
    normed = torch.empty((rows, width), dtype=torch.result_type(weight, x), device=x.device)
    if rows:
        _residual_norm_kernel[(rows,)](
            parts,
            bias if bias is not None else parts,
            x,
            weight,
            new,
            normed,
            rows * width,
            width,
            float(eps),
            BLOCK=triton.next_power_of_2(width),
            **_common(parts, bias),
        )
    return new, normed


def silu_mul_triton(
    parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``silu(gate) * up`` ``[R, I]`` of a gate/up projection's ``[S, R, 2 I]`` partials
    (gate's columns first), as ``gate / (1 + exp(-gate)) * up``."""
    _, rows, width = parts.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=dtype, device=parts.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _SILU_BLOCK))](
            parts,
            bias if bias is not None else parts,
            out,
            rows * width,
            inter,
            BLOCK=_SILU_BLOCK,
            **_common(parts, bias),
        )
    return out


def sum_parts(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The linear's output ``[R, N]`` as the kernels see it: float32 partials added in order,
    then the bias, rounded to ``dtype`` (additions only: bitwise the kernels' sum).

    Examples
    --------
    >>> sum_parts(torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([0.5]), torch.float32).tolist()
    [[3.5]]
    """
    out = parts[0].float()
    for part in parts[1:]:
        out = out + part.float()
    return (out if bias is None else out + bias.float()).to(dtype)


def rotary_cache_reference(
    parts,
    bias,
    cos,
    sin,
    positions,
    k_cache,
    v_cache,
    cache_row,
    slot,
    heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`rotary_cache_triton` in torch ops (float32 arithmetic, one rounding to ``dtype``)."""
    rows = parts.shape[1]
    kv_heads, dim = k_cache.shape[1], k_cache.shape[3]
    out = sum_parts(parts, bias, dtype).float().view(rows, heads + 2 * kv_heads, dim)
    half = dim // 2
    rotated = torch.cat([-out[..., half:], out[..., :half]], dim=-1)
    cos_r, sin_r = cos[positions].float()[:, None], sin[positions].float()[:, None]
    turned = (out * cos_r + rotated * sin_r).to(dtype)
    k_cache[cache_row, :, slot] = turned[:, heads : heads + kv_heads]
    v_cache[cache_row, :, slot] = out[:, heads + kv_heads :].to(dtype)
    return turned[:, :heads].contiguous()


def residual_norm_reference(
    parts, bias, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`residual_norm_triton` in torch ops."""
    new = (x.float() + sum_parts(parts, bias, x.dtype).float()).to(x.dtype)
    new32 = new.float()
    normed = (new32 * torch.rsqrt(new32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return new, weight * normed


def silu_mul_reference(parts, bias, dtype: torch.dtype) -> torch.Tensor:
    """:func:`silu_mul_triton` in torch ops."""
    out = sum_parts(parts, bias, dtype).float()
    gate, up = out.chunk(2, dim=-1)
    return (gate / (1 + torch.exp(-gate)) * up).to(dtype)
