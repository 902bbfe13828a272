"""Indices of the ``k`` largest logits of each row, for small ``k``, in two passes.

``torch.topk`` on a ``[rows, vocab]`` tensor runs a radix select: several passes over the
whole tensor (about 250 µs for 256 × 49,152 on an H200: the largest part of a replay
step's scoring). For the few tokens a replay reports (``top_k`` ≤ 32), two small passes
do: each program takes ``k`` maxima (one argmax each) of one ``BLOCK``-wide chunk of a row
in registers, then one program per row takes ``k`` maxima of those candidates. The logits
are read once.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay._triton import tl, triton, use_triton

__all__ = ["CHUNK", "NUM_WARPS", "MAX_TOP_K", "top_k_indices", "top_k_indices_reference"]

MAX_TOP_K = 32
# first pass: logits per program, and its warps (``benchmarks/bench_scoring.py`` sweeps both)
CHUNK = 1024
NUM_WARPS = 1


@triton.jit
def _keys(values):
    """Float32 sort keys: NaN and -inf become the lowest finite float, so -inf marks "taken"."""
    values = values.to(tl.float32)
    return tl.where((values != values) | (values == float("-inf")), -3.4028234663852886e38,
                    values)


@triton.jit
def _take_k_largest(keys, positions, out_index_ptr, base, K: tl.constexpr):
    """Store ``base`` + the positions of the ``K`` largest ``keys`` (ties: lowest position),
    largest first.

    One argmax per pick; a taken key becomes -inf, which no real key is (see ``_keys``).
    """
    for i in range(K):
        pick = tl.argmax(keys, axis=0, tie_break_left=True)
        tl.store(out_index_ptr + i, pick + base)
        keys = tl.where(positions == pick, float("-inf"), keys)


@triton.jit
def _chunk_top_k_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    logits_stride,
    vocab,
    cand_index_ptr,  # [rows, chunks * K] int32, written: vocabulary indices
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row, chunk = tl.program_id(0), tl.program_id(1)
    index = chunk * BLOCK + tl.arange(0, BLOCK)
    keys = _keys(tl.load(logits_ptr + row * logits_stride + index, mask=index < vocab,
                         other=float("nan")))
    # past the vocabulary: -inf, never taken before every real entry is
    keys = tl.where(index < vocab, keys, float("-inf"))
    out = (row * tl.num_programs(1) + chunk) * K
    _take_k_largest(keys, tl.arange(0, BLOCK), cand_index_ptr + out, chunk * BLOCK, K)


@triton.jit
def _merge_top_k_kernel(
    logits_ptr,
    logits_stride,
    vocab,
    cand_index_ptr,  # [rows, width] int32: each chunk's K candidates
    width,
    out_index_ptr,  # [rows, K] int32, written: positions among the candidates
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    index = tl.load(cand_index_ptr + row * width + offs, mask=offs < width, other=0)
    real = (offs < width) & (index < vocab)
    keys = _keys(tl.load(logits_ptr + row * logits_stride + index, mask=real, other=float("nan")))
    # candidates sit by chunk, each chunk's largest first: ties still go to the lower index
    keys = tl.where(real, keys, float("-inf"))
    _take_k_largest(keys, offs, out_index_ptr + row * K, 0, K)


def top_k_indices(logits: torch.Tensor, k: int, *, chunk: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """``[rows, k]`` int64 indices of each row's ``k`` largest logits, largest first.

    Ties go to the lower index; NaN and -inf rank as the lowest finite float (below every
    other number, level with it). Runs the Triton kernels when
    :func:`~trace_replay._triton.use_triton` allows it, else
    :func:`top_k_indices_reference`. No host synchronization.

    Parameters
    ----------
    logits
        ``[rows, vocab]`` floating tensor, rows contiguous (last stride 1).
    k
        How many, ``1 <= k <= min(vocab, MAX_TOP_K)``.
    chunk, num_warps
        Logits per first-pass program (a power of two) and its warps; default
        :data:`CHUNK` and :data:`NUM_WARPS`.

    Examples
    --------
    >>> top_k_indices(torch.tensor([[0.5, 2.0, -1.0, 2.0]]), 2).tolist()
    [[1, 3]]
    """
    rows, vocab = logits.shape
    chunk = CHUNK if chunk is None else chunk
    num_warps = NUM_WARPS if num_warps is None else num_warps
    if not 1 <= k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"k must be in 1..{min(vocab, MAX_TOP_K)}, got {k}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (last stride 1)")
    if not use_triton(logits):
        return top_k_indices_reference(logits, k)
    chunks = triton.cdiv(vocab, chunk)
    cand_index = torch.empty((rows, chunks * k), dtype=torch.int32, device=logits.device)
    _chunk_top_k_kernel[(rows, chunks)](logits, logits.stride(0), vocab, cand_index, K=k,
                                        BLOCK=chunk, num_warps=num_warps)
    picked = torch.empty((rows, k), dtype=torch.int32, device=logits.device)
    _merge_top_k_kernel[(rows,)](logits, logits.stride(0), vocab, cand_index, chunks * k,
                                 picked, K=k, BLOCK=max(16, triton.next_power_of_2(chunks * k)))
    return cand_index.gather(1, picked.long()).long()


def top_k_indices_reference(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Pure-torch :func:`top_k_indices`: a stable sort, so ties go to the lower index."""
    keys = logits.float()
    keys = torch.where(keys.isnan() | (keys == float("-inf")), torch.finfo(torch.float32).min,
                       keys)
    return keys.sort(dim=-1, descending=True, stable=True).indices[:, :k]
