"""Row-wise operations whose result for a row never depends on the other rows.

Deterministic mode computes every token as one *row* and keeps each row's arithmetic a
function of that row alone. Library kernels choose their algorithm (blocking, threads,
vector width, reduction tree) from the shape of the call, so the rule here is: **every
call that reduces has a fixed shape** — a block of a fixed number of rows, zero-padded —
and within one shape a row's result must not depend on the other rows or on its position.
Elementwise operations need no blocking except where a library treats some elements of
a call differently from others (see Assumptions).

Assumptions, checked by ``tests/test_deterministic_ops.py`` and, for the GEMM, again each time
an engine starts (:func:`probe_linear`):

* GEMM (MKL/oneDNN on CPU, cuBLAS on CUDA): for a fixed ``[M, K] x [K, N]`` shape, row
  ``r`` of the product depends only on row ``r`` of the input, not on the other rows'
  values or on ``r``. Whether a row also keeps its bits at another M depends on the
  library and dtype; the probe keeps, at start-up, a group of menu sizes that agree
  (:func:`probe_linear`); without one, the Triton GEMM
  (:mod:`~trace_replay.kernels.deterministic_linear`, invariant by construction) is used.
* Reductions over the last dimension (sum, mean, amax, log_softmax, softmax) of a
  ``[rows, n]`` tensor reduce each row with the same code whatever its index, as long as
  there are at least two rows (PyTorch's CPU reductions split a *single* output's reduction
  across threads) and the shape is fixed.
* CPU elementwise kernels run a vectorized body and a scalar tail; ``exp`` (through VML) and
  IEEE operations (+, *, /, sqrt) give the same bits in both, but ``silu``/``sigmoid`` do
  not, so SiLU is computed as ``x / (1 + exp(-x))``.
* CUDA elementwise kernels compute every element with the same device function.
* The number of intra-op threads does not change during an engine's life.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trace_replay.engines.builtin.scoring import TokenScores, tail_logmass

__all__ = ["LINEAR_MENU", "RowBlocks", "probe_linear", "silu_mul", "score_rows", "tail_rows"]

LINEAR_MENU = (4, 8, 16, 32, 64)  # GEMM row counts on CPU, as far as the probe finds them equal
# on CUDA (cuBLAS); on an H200 bfloat16 rows agree across all, float32 rows at none
CUDA_LINEAR_MENU = (64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class RowBlocks:
    """How many rows each kind of call gets; part of an engine's arithmetic (``settings``).

    ``linear`` is the menu of GEMM row counts (cut down by :func:`probe_linear`);
    ``rowwise`` the rows of a torch norm call; ``attention`` the query rows of a torch
    attention call; ``score`` the rows of a scoring call. On CUDA norms and attention are
    Triton kernels, which take any number of rows.
    """

    linear: tuple[int, ...]
    rowwise: int
    attention: int
    score: int

    @staticmethod
    def for_device(device: torch.device) -> RowBlocks:
        if device.type == "cuda":
            return RowBlocks(linear=CUDA_LINEAR_MENU, rowwise=64, attention=64, score=64)
        return RowBlocks(linear=LINEAR_MENU, rowwise=8, attention=8, score=8)


def _row_bits(
    weight: torch.Tensor, row: torch.Tensor, size: int, generator: torch.Generator
) -> bytes | None:
    """The bits ``row`` gets in a block of ``size`` rows, or None if they move with its place.

    The row is placed first, in the middle and last, with random neighbours each time.
    """
    seen = None
    for position in sorted({0, size // 2, size - 1}):
        x = torch.randn(size, row.shape[0], generator=generator).to(weight)
        x[position] = row
        got = torch.nn.functional.linear(x, weight)[position]
        if seen is not None and not torch.equal(got, seen):
            return None
        seen = got
    assert seen is not None  # the loop ran: a block has at least one place
    return seen.cpu().view(torch.uint8).numpy().tobytes()


def probe_linear(weights: Sequence[torch.Tensor], menu: Sequence[int]) -> tuple[int, ...]:
    """The GEMM row counts deterministic mode may use with these weights on this machine.

    For each distinct weight shape, one random row is computed in blocks of every size of
    ``menu`` (:func:`_row_bits`). Sizes whose row moves with its place are dropped; the
    rest fall into groups that give the row the same bits for every shape. The group kept
    has its smallest block at most 256 rows (a decode step stays cheap), then the most
    sizes, then the largest smallest block (fewer calls for long prefills).

    Raises
    ------
    RuntimeError
        When every size gives a row different bits at different positions: this machine's
        GEMM cannot be made batch-invariant this way.
    """
    generator = torch.Generator().manual_seed(0)
    shapes: dict[tuple, torch.Tensor] = {}
    for weight in weights:
        shapes.setdefault((tuple(weight.shape), weight.dtype), weight)
    groups: dict[tuple, list[int]] = {}
    with torch.inference_mode():
        rows = [torch.randn(w.shape[1], generator=generator).to(w) for w in shapes.values()]
        for size in sorted(menu):
            bits = tuple(_row_bits(w, r, size, generator) for w, r in zip(shapes.values(), rows))
            if None not in bits:
                groups.setdefault(bits, []).append(size)
    if not groups:
        raise RuntimeError(
            "deterministic mode: this machine's GEMM gives a row different bits "
            "at different positions of a fixed-shape block; batch invariance "
            "cannot be guaranteed here"
        )
    best = max(groups.values(), key=lambda g: (g[0] <= 256, len(g), g[0]))
    return tuple(best)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as ``gate / (1 + exp(-gate)) * up`` (same bits in any position)."""
    return gate / (1 + torch.exp(-gate)) * up


def score_rows(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int, rows: int) -> TokenScores:
    """:func:`~trace_replay.engines.builtin.scoring.score_tokens` made row-invariant.

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
        block = logits[start : start + rows].float()
        ids = token_ids[start : start + rows]
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
        parts.append((logprob, rank, top_ids, top_lps, entropy, tail_logmass(logprobs, top_ids)))
    return TokenScores(*(torch.cat(p)[:count] for p in zip(*parts)))


def tail_rows(logits: torch.Tensor, top_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`~trace_replay.engines.builtin.scoring.tail_logmass` in blocks of exactly
    ``rows`` rows (padded), so that a row's value does not depend on its batch."""
    count = logits.shape[0]
    pad = -count % rows
    if pad:
        logits = torch.cat([logits, logits.new_zeros((pad, logits.shape[1]))])
        top_ids = torch.cat([top_ids, top_ids.new_zeros((pad, top_ids.shape[1]))])
    return torch.cat(
        [
            tail_logmass(logits[a : a + rows], top_ids[a : a + rows])
            for a in range(0, count + pad, rows)
        ]
    )[:count]
