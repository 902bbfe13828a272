"""The ``k`` largest logits of each row, for small ``k``: one pass over the logits, then a
look at the ``k`` chunks that can hold them.

``torch.topk`` on a ``[rows, vocab]`` tensor runs a radix select: several passes over the
whole tensor. A replay reports a few tokens (``top_k`` ≤ 32), and those few lie in few
chunks of the vocabulary:

1. one program per group of ``CHUNK``-wide chunks of a row writes each chunk's maximum (the
   logits are read once, one reduction each);
2. one program per row takes the ``k`` chunks with the largest maxima (ties: the lower
   chunk) and picks the ``k`` largest logits among their ``k × CHUNK`` entries.

Exact, not a heuristic: a logit among the ``k`` largest (ties going to the lower index) has
at most ``k - 1`` logits ranked above it, while every chunk ranked above its own chunk
holds a logit ranked above it (the chunk's first maximum), so its chunk is among the first
``k``. The second program can also finish the scores: given the scored token and its
logprob it writes the top-k logprobs (:func:`top_k_scores`), so a replay step's top-k costs
two launches in all.
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`
# itself, not a string, to treat a kernel parameter as a compile-time constant.

import torch

from trace_replay.kernels._triton import tl, triton, use_triton

__all__ = [
    "CHUNK",
    "GROUP",
    "NUM_WARPS",
    "MAX_TOP_K",
    "top_k_indices",
    "top_k_scores",
    "top_k_indices_reference",
]

MAX_TOP_K = 32
# first pass: logits per chunk, chunks per program, warps (``benchmarks/bench_scoring.py``
# sweeps them); the second pass holds ``k × CHUNK`` entries per row
CHUNK = 128
GROUP = 16
NUM_WARPS = 4
_NONE = tl.constexpr(2**31 - 1)  # larger than any vocabulary index (a constexpr: kernels read it)


@triton.jit
def _keys(values):
    """Float32 sort keys: NaN and -inf become the lowest finite float, so -inf marks "taken"
    (and "not there")."""
    return tl.where((values != values) | (values == float("-inf")), -3.4028234663852886e38, values)


@triton.jit
def _chunk_max_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    logits_stride,
    vocab,
    chunks,
    chunk_max_ptr,  # [rows, chunks] float32, written: each chunk's largest key
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row, group = tl.program_id(0), tl.program_id(1)
    chunk = group * GROUP + tl.arange(0, GROUP)
    index = chunk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = index < vocab
    values = tl.load(logits_ptr + row * logits_stride + index, mask=inside, other=0.0)
    keys = tl.where(inside, _keys(values.to(tl.float32)), float("-inf"))
    tl.store(chunk_max_ptr + row * chunks + chunk, tl.max(keys, axis=1), mask=chunk < chunks)


@triton.jit
def _pick_kernel(
    logits_ptr,
    logits_stride,
    vocab,
    chunks,
    chunk_max_ptr,  # [rows, chunks] float32
    out_index_ptr,  # [rows, K] int64, written: vocabulary indices, largest first
    token_ptr,  # [rows] int: the scored tokens (SCORES)
    token_logprob_ptr,  # [rows] float32: their logprobs (SCORES)
    out_logprob_ptr,  # [rows, K] float32, written: logprob + (top logit - token logit) (SCORES)
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two
    CHUNKS_P: tl.constexpr,  # chunks rounded up to a power of two
    BLOCK: tl.constexpr,
    SCORES: tl.constexpr,
):
    row = tl.program_id(0)
    at = tl.arange(0, CHUNKS_P)
    maxima = tl.load(chunk_max_ptr + row * chunks + at, mask=at < chunks, other=float("-inf"))
    slot = tl.arange(0, KP)
    picked = tl.full((KP,), _NONE, tl.int32)
    for i in range(K):  # the K chunks with the largest maxima, ties to the lower chunk
        best = tl.max(maxima, axis=0)
        chunk = tl.min(tl.where(maxima == best, at, _NONE), axis=0)
        # past the real chunks (vocab < K chunks) the maxima left are -inf: nothing there
        chunk = tl.where(best > float("-inf"), chunk, _NONE)
        picked = tl.where(slot == i, chunk, picked)
        maxima = tl.where(at == chunk, float("-inf"), maxima)
    there = picked[:, None] != _NONE
    index = tl.where(there, picked[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], _NONE)
    inside = index < vocab
    base = logits_ptr + row * logits_stride
    values = tl.load(base + index, mask=inside, other=0.0).to(tl.float32)
    keys = tl.where(inside, _keys(values), float("-inf"))
    if SCORES:
        token_logit = tl.load(base + tl.load(token_ptr + row)).to(tl.float32)
        token_logprob = tl.load(token_logprob_ptr + row)
    for i in range(K):  # the K largest entries, ties to the lower index
        best = tl.max(tl.max(keys, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(keys == best, index, _NONE), axis=1), axis=0)
        tl.store(out_index_ptr + row * K + i, pick.to(tl.int64))
        if SCORES:
            # the picked entry's own value (NaN stays NaN): a sum of it and zeros
            value = tl.sum(tl.sum(tl.where(index == pick, values, 0.0), axis=1), axis=0)
            tl.store(out_logprob_ptr + row * K + i, token_logprob + (value - token_logit))
        keys = tl.where(index == pick, float("-inf"), keys)


def _check(logits: torch.Tensor, k: int, chunk: int) -> None:
    vocab = logits.shape[1]
    if not 1 <= k <= min(vocab, MAX_TOP_K):
        raise ValueError(f"k must be in 1..{min(vocab, MAX_TOP_K)}, got {k}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (last stride 1)")


def _launch(logits, k, chunk, group, num_warps, token_ids=None, token_logprob=None):
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    _chunk_max_kernel[(rows, triton.cdiv(chunks, group))](
        logits,
        logits.stride(0),
        vocab,
        chunks,
        chunk_max,
        BLOCK=chunk,
        GROUP=group,
        num_warps=num_warps,
    )
    index = torch.empty((rows, k), dtype=torch.long, device=logits.device)
    scores = token_ids is not None
    top = torch.empty((rows, k), dtype=torch.float32, device=logits.device) if scores else index
    _pick_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        chunks,
        chunk_max,
        index,
        token_ids if scores else index,
        token_logprob if scores else chunk_max,
        top,
        K=k,
        KP=max(2, triton.next_power_of_2(k)),
        CHUNKS_P=max(16, triton.next_power_of_2(chunks)),
        BLOCK=chunk,
        SCORES=scores,
        num_warps=4,
    )
    return index, top


def top_k_indices(
    logits: torch.Tensor,
    k: int,
    *,
    chunk: int | None = None,
    group: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``[rows, k]`` int64 indices of each row's ``k`` largest logits, largest first.

    Ties go to the lower index; NaN and -inf rank as the lowest finite float (below every
    other number, level with it). Runs the Triton kernels when
    :func:`~trace_replay.kernels._triton.use_triton` allows it, else
    :func:`top_k_indices_reference`. No host synchronization.

    Parameters
    ----------
    logits
        ``[rows, vocab]`` floating tensor, rows contiguous (last stride 1).
    k
        How many, ``1 <= k <= min(vocab, MAX_TOP_K)``.
    chunk, group, num_warps
        The first pass: logits per chunk (a power of two), chunks per program (a power of
        two) and warps; default :data:`CHUNK`, :data:`GROUP` and :data:`NUM_WARPS`.

    Examples
    --------
    >>> top_k_indices(torch.tensor([[0.5, 2.0, -1.0, 2.0]]), 2).tolist()
    [[1, 3]]
    """
    chunk, group, num_warps = _settings(chunk, group, num_warps)
    _check(logits, k, chunk)
    if not use_triton(logits):
        return top_k_indices_reference(logits, k)
    return _launch(logits, k, chunk, group, num_warps)[0]


def top_k_scores(
    logits: torch.Tensor,
    k: int,
    token_ids: torch.Tensor,
    token_logprob: torch.Tensor,
    *,
    chunk: int | None = None,
    group: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_k_indices` and the top tokens' logprobs, ``([rows, k] int64, [rows, k]
    float32)``.

    A top token's logprob is taken from the scored token's: ``token_logprob + (logit_top -
    logit_token)`` in float32, the rule of
    :func:`~trace_replay.engines.builtin.scoring.top_from_logprob` (same operations, same order),
    computed by the kernel that picks the top-k.

    Examples
    --------
    >>> logits = torch.tensor([[0.5, 2.0, -1.0, 2.0]])
    >>> ids, top = top_k_scores(logits, 2, torch.tensor([0]), torch.tensor([-2.0]))
    >>> ids.tolist(), top.tolist()
    ([[1, 3]], [[-0.5, -0.5]])
    """
    chunk, group, num_warps = _settings(chunk, group, num_warps)
    _check(logits, k, chunk)
    if not use_triton(logits):
        ids = top_k_indices_reference(logits, k)
        token_logit = logits.gather(1, token_ids.long()[:, None]).float()
        return ids, token_logprob[:, None] + (logits.gather(1, ids).float() - token_logit)
    return _launch(
        logits,
        k,
        chunk,
        group,
        num_warps,
        token_ids.contiguous(),
        token_logprob.float().contiguous(),
    )


def _settings(chunk, group, num_warps):
    """The first pass's settings, module defaults read at each call (benchmarks tune them)."""
    group = GROUP if group is None else group
    if group < 1 or group & (group - 1):
        raise ValueError(f"group must be a power of two, got {group}")
    return (CHUNK if chunk is None else chunk, group, NUM_WARPS if num_warps is None else num_warps)


def top_k_indices_reference(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Pure-torch :func:`top_k_indices`: a stable sort, so ties go to the lower index."""
    keys = logits.float()
    keys = torch.where(keys.isnan() | (keys == float("-inf")), torch.finfo(torch.float32).min, keys)
    return keys.sort(dim=-1, descending=True, stable=True).indices[:, :k]
