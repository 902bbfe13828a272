"""The one scoring rule every engine shares: logprob, rank, top-k and entropy of a token."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["TokenScores", "score_tokens", "collect_rows"]


class TokenScores(NamedTuple):
    """Device tensors for N scored positions."""

    logprob: torch.Tensor  # [N] float32
    rank: torch.Tensor  # [N] int64
    top_token_ids: torch.Tensor  # [N, top_k] int64
    top_logprobs: torch.Tensor  # [N, top_k] float32
    entropy: torch.Tensor  # [N] float32


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
    """Score ``token_ids`` under the unmodified distribution ``logits`` ([N, V]).

    Log-softmax runs in float32 whatever the model dtype, as vLLM's sampler does. Rank is
    1 + the number of tokens with a strictly greater logprob, so ties share the best rank.
    Everything stays on the device: no host synchronization.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.long()
    logprob = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logprobs > logprob[:, None]).sum(dim=1) + 1
    top = logprobs.topk(top_k, dim=-1) if top_k > 0 else None
    # p * log p is 0 for p = 0 (log p = -inf gives NaN otherwise)
    entropy = -(logprobs.exp() * logprobs).nan_to_num(nan=0.0).sum(dim=1)
    empty_ids = token_ids.new_zeros((len(token_ids), 0))
    return TokenScores(
        logprob=logprob,
        rank=rank,
        top_token_ids=top.indices if top is not None else empty_ids,
        top_logprobs=top.values if top is not None else logprob.new_zeros((len(token_ids), 0)),
        entropy=entropy,
    )


def collect_rows(scores: TokenScores, token_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Move one batch of scores to the host in a single transfer per field."""
    host = {name: value.cpu().numpy() for name, value in scores._asdict().items()}
    host["token_ids"] = token_ids.long().cpu().numpy()
    host["logprob"] = host["logprob"].astype(np.float64)
    host["top_logprobs"] = host["top_logprobs"].astype(np.float64)
    host["entropy"] = host["entropy"].astype(np.float64)
    return host
