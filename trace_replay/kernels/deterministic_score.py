"""Scoring of a token under its row of logits, the result a function of that row alone.

The quantities of :func:`~trace_replay.engines.builtin.scoring.score_tokens`: the token's logprob
(float32), its rank (1 + the number of tokens of strictly greater logprob), the entropy of
the row's distribution, and the top-k, for deterministic mode, where a row's numbers must
not depend on the rows beside it or on how many there are.

* **Triton** (CUDA): one program per row walks the vocabulary in :data:`BLOCK`-wide chunks,
  twice. The first pass keeps, per lane, a running maximum and a sum of exponentials
  rescaled to it; the lanes are then combined (one ``tl.max``, one ``tl.sum``) into the
  row's ``logsumexp``. Every logprob is ``logit - logsumexp``; the second pass counts the
  logprobs above the token's and adds ``p * log p`` per lane. A row's arithmetic is fixed
  by its vocabulary size alone. The top-k are :func:`~trace_replay.kernels.top_k.top_k_scores`'s
  (per-row programs too; ties to the lower index; a top token's logprob is the token's
  plus the difference of their logits).
* **Reference**: the same formulas in torch ops on the whole tensor, for checking the
  kernel: equal to it within float32 rounding, not bit for bit (torch sums in another
  order). It is not row-invariant; deterministic mode's CPU path scores with
  :func:`~trace_replay.engines.builtin.backends.deterministic_ops.score_rows` (fixed row blocks).
"""

# No `from __future__ import annotations`: Triton's interpreter must see `tl.constexpr`.

import torch

from trace_replay.kernels._triton import tl, triton
from trace_replay.kernels.top_k import MAX_TOP_K, top_k_scores

__all__ = ["BLOCK", "score_rows_reference", "score_rows_triton", "supports"]

BLOCK = 2048  # logits per step of a row's walk; fixed, so a row's sums have one order


@triton.jit
def _score_kernel(
    logits_ptr,  # [R, V], float, rows contiguous
    stride,
    vocab,
    token_ptr,  # [R], int64: the scored tokens
    logprob_ptr,  # [R] float32, written
    rank_ptr,  # [R] int64, written
    entropy_ptr,  # [R] float32, written
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    # pass 1: per lane, the largest logit seen and the sum of exp(logit - that maximum)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(
            tl.float32
        )
        new_max = tl.maximum(lane_max, x)
        # a lane with nothing finite yet scales by exp(-inf - 0) = 0, not exp(-inf - -inf)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    lanes = tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max))
    lse = row_max + tl.log(tl.sum(lanes, axis=0))
    token_logprob = tl.load(base + tl.load(token_ptr + row)).to(tl.float32) - lse
    # pass 2: logprobs above the token's, and p * log p (0 where p is 0)
    above = tl.zeros((BLOCK,), tl.int32)
    plogp = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        inside = start + offs < vocab
        x = tl.load(base + start + offs, mask=inside, other=float("-inf")).to(tl.float32)
        logprob = x - lse
        above += (inside & (logprob > token_logprob)).to(tl.int32)
        p = tl.exp(logprob)
        plogp += p * tl.where(p > 0, logprob, 0.0)  # 0 * -inf would be NaN
    tl.store(logprob_ptr + row, token_logprob)
    tl.store(rank_ptr + row, tl.sum(above, axis=0).to(tl.int64) + 1)
    tl.store(entropy_ptr + row, -tl.sum(plogp, axis=0))


def supports(logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`score_rows_triton` takes these ``[R, V]`` logits and ``top_k``: up to
    the top-k kernel's :data:`~trace_replay.kernels.top_k.MAX_TOP_K` (and ``V``). The answer
    depends on ``V`` and ``top_k`` alone, never on the rows or their layout, so a caller
    that picks by it picks alike for a decode step and a prefill chunk."""
    return logits.dim() == 2 and 0 <= top_k <= min(MAX_TOP_K, logits.shape[1])


def score_rows_triton(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, ...]:
    """Score ``token_ids`` ``[R]`` under ``logits`` ``[R, V]``, one program per row.

    Parameters
    ----------
    logits : torch.Tensor
        ``[R, V]``, any float dtype (copied first where its last stride is not 1).
    token_ids : torch.Tensor
        ``[R]`` integer.
    top_k : int
        ``0 <= top_k <= min(MAX_TOP_K, V)`` (:func:`supports`).

    Returns
    -------
    tuple of torch.Tensor
        In :class:`~trace_replay.engines.builtin.scoring.TokenScores`' order: logprob ``[R]``
        float32, rank ``[R]`` int64, top ids ``[R, top_k]`` int64, top logprobs
        ``[R, top_k]`` float32, entropy ``[R]`` float32.
    """
    if not supports(logits, top_k):
        raise ValueError(
            f"score_rows_triton takes [R, V] logits and top_k <= {MAX_TOP_K} "
            f"(got {tuple(logits.shape)}, top_k={top_k})"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    token_ids = token_ids.long().contiguous()
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    rank = torch.empty(rows, dtype=torch.long, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _score_kernel[(rows,)](
            logits,
            logits.stride(0),
            vocab,
            token_ids,
            logprob,
            rank,
            entropy,
            BLOCK=BLOCK,
            num_warps=8,
        )
    if top_k and rows:
        top_ids, top_logprobs = top_k_scores(logits, top_k, token_ids, logprob)
    else:
        top_ids = token_ids.new_zeros((rows, top_k))
        top_logprobs = logprob.new_zeros((rows, top_k))
    return logprob, rank, top_ids, top_logprobs, entropy


def score_rows_reference(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, ...]:
    """:func:`score_rows_triton`'s formulas in torch ops: logprob ``= logit - logsumexp``,
    rank ``= 1 +`` the logprobs strictly above, entropy ``= -sum(p log p)`` (0 where p is
    0), the top-k largest first with ties to the lower index, their logprobs the token's
    plus the difference of logits."""
    x = logits.float()
    token_ids = token_ids.long()
    logprobs = x - torch.logsumexp(x, dim=-1, keepdim=True)
    logprob = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logprobs > logprob[:, None]).sum(dim=1) + 1
    p = logprobs.exp()
    entropy = -torch.where(p > 0, p * logprobs, 0.0).sum(dim=1)
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :top_k]
    token_logit = x.gather(1, token_ids[:, None])
    top = logprob[:, None] + (x.gather(1, order) - token_logit)
    return logprob, rank, order, top, entropy
