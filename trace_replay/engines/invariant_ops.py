"""Row-wise operations whose result for a row never depends on the other rows.

Deterministic mode computes every token as one *row* and keeps each row's arithmetic a
function of that row alone. Library kernels choose their algorithm (blocking, threads,
vector width, reduction tree) from the shape of the call, so the rule here is: **every
call that reduces has a fixed shape** — a block of a fixed number of rows, zero-padded —
and within one shape a row's result must not depend on the other rows or on its position.
Elementwise operations need no blocking except where a library treats some elements of
a call differently from others (see Assumptions).

Assumptions, checked by ``tests/test_invariant_ops.py`` and, for the GEMM, again each time
an engine starts (:func:`probe_linear`):

* GEMM (MKL/oneDNN on CPU, cuBLAS on CUDA without Triton): for a fixed ``[M, K] x [K, N]``
  shape, row ``r`` of the product depends only on row ``r`` of the input, not on the other
  rows' values or on ``r``. Measured on an AMD EPYC (AVX-512, MKL 2024.2, torch 2.13): true
  for every M, on 1 or 2 threads; moreover every M >= 4 gives a row the same bits (M <= 3
  takes another path), so the menu of sizes 4..64 is one arithmetic. The probe keeps, at
  start-up, the largest sizes of the menu that agree with one another (at worst one size).
* Reductions over the last dimension (sum, mean, amax, log_softmax, softmax) of a
  ``[rows, n]`` tensor reduce each row with the same code whatever its index, as long as
  there are at least two rows (PyTorch's CPU reductions split a *single* output's reduction
  across threads) and the shape is fixed.
* CPU elementwise kernels run a vectorized body and a scalar tail; ``exp`` (through VML) and
  IEEE operations (+, *, /, sqrt) give the same bits in both, but ``silu``/``sigmoid`` do
  not (measured: 3,906 of 100,000 values differ), so SiLU is computed as ``x / (1 + exp(-x))``.
* CUDA elementwise kernels compute every element with the same device function.
* The number of intra-op threads does not change during an engine's life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trace_replay.engines.scoring import TokenScores

__all__ = ["RowBlocks", "probe_linear", "in_blocks", "rms_norm_rows", "silu_mul", "score_rows"]

LINEAR_MENU = (4, 8, 16, 32, 64)  # GEMM row counts on CPU, as far as the probe finds them equal


@dataclass(frozen=True)
class RowBlocks:
    """How many rows each kind of call gets; part of an engine's arithmetic (``settings``).

    ``linear`` is the menu of GEMM row counts for the torch path (the Triton kernel takes any
    count); ``rowwise`` the rows of a norm call; ``attention`` the query rows of a torch
    attention call; ``score`` the rows of a scoring call.
    """

    linear: tuple[int, ...]
    rowwise: int
    attention: int
    score: int

    @staticmethod
    def for_device(device: torch.device) -> RowBlocks:
        if device.type == "cuda":
            return RowBlocks(linear=(64,), rowwise=256, attention=64, score=64)
        return RowBlocks(linear=LINEAR_MENU, rowwise=8, attention=8, score=8)


def _same_row(weight: torch.Tensor, sizes: Sequence[int], generator: torch.Generator) -> bool:
    """Whether one random row gets the same bits at the ends of blocks of every size."""
    k = weight.shape[1]
    row = torch.randn(k, generator=generator).to(weight)
    seen = None
    for size in sizes:
        for position in {0, size - 1}:
            x = torch.randn(size, k, generator=generator).to(weight)
            x[position] = row
            got = torch.nn.functional.linear(x, weight)[position]
            if seen is None:
                seen = got
            elif not torch.equal(got, seen):
                return False
    return True


def probe_linear(weights: Sequence[torch.Tensor], menu: Sequence[int]) -> tuple[int, ...]:
    """The GEMM row counts deterministic mode may use with these weights on this machine.

    For each distinct weight shape, a random row is placed first and last in blocks of
    each size with random neighbours. Returns the largest sizes of ``menu`` (smallest ones
    dropped first) for which its bits agree everywhere; at worst the largest size alone.

    Raises
    ------
    RuntimeError
        When even one fixed shape gives a row different bits at different positions: this
        machine's GEMM cannot be made batch-invariant this way.
    """
    generator = torch.Generator().manual_seed(0)
    shapes = {}
    for weight in weights:
        shapes.setdefault((tuple(weight.shape), weight.dtype), weight)
    menu = sorted(menu)
    with torch.inference_mode():
        for first in range(len(menu)):
            if all(_same_row(w, menu[first:], generator) for w in shapes.values()):
                return tuple(menu[first:])
    raise RuntimeError("deterministic mode: this machine's GEMM gives a row different bits "
                       "at different positions of a fixed-shape block; batch invariance "
                       "cannot be guaranteed here")


def in_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              rows: int) -> torch.Tensor:
    """``fn`` over ``x`` ``[R, ...]`` in calls of exactly ``rows`` rows (zero-padded)."""
    count = x.shape[0]
    pad = -count % rows
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    if x.shape[0] == rows:
        return fn(x)[:count]
    return torch.cat([fn(x[i:i + rows]) for i in range(0, x.shape[0], rows)])[:count]


def rms_norm_rows(x: torch.Tensor, norm: torch.nn.Module, rows: int) -> torch.Tensor:
    """LlamaRMSNorm (float32 statistics, cast back, then the weight) in fixed row blocks."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

    def block(h: torch.Tensor) -> torch.Tensor:
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
        return norm.weight * h32.to(h.dtype)

    return in_blocks(block, x, rows)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as ``gate / (1 + exp(-gate)) * up`` (same bits in any position)."""
    return gate / (1 + torch.exp(-gate)) * up


def score_rows(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int,
               rows: int) -> TokenScores:
    """:func:`~trace_replay.engines.scoring.score_tokens` made row-invariant.

    The same quantities (log-softmax in float32, rank = 1 + strictly greater, top-k,
    entropy), computed in blocks of exactly ``rows`` rows; entropy is
    ``-sum(softmax * log_softmax)`` from two row kernels instead of an elementwise exp.
    """
    count = logits.shape[0]
    pad = -count % rows
    token_ids = token_ids.long()
    if pad:
        logits = torch.cat([logits, logits.new_zeros((pad, logits.shape[1]))])
        token_ids = torch.cat([token_ids, token_ids.new_zeros(pad)])
    parts = []
    for start in range(0, count + pad, rows):
        block = logits[start:start + rows].float()
        ids = token_ids[start:start + rows]
        logprobs = torch.log_softmax(block, dim=-1)
        logprob = logprobs.gather(1, ids[:, None]).squeeze(1)
        rank = (logprobs > logprob[:, None]).sum(dim=1) + 1
        # p * log p is 0 for p = 0 (log p = -inf gives NaN otherwise)
        entropy = -(torch.softmax(block, dim=-1) * logprobs).nan_to_num(nan=0.0).sum(dim=1)
        if top_k > 0:
            top = logprobs.topk(top_k, dim=-1)
            top_ids, top_lps = top.indices, top.values
        else:
            top_ids, top_lps = ids.new_zeros((rows, 0)), logprob.new_zeros((rows, 0))
        parts.append((logprob, rank, top_ids, top_lps, entropy))
    return TokenScores(*(torch.cat(p)[:count] for p in zip(*parts)))

