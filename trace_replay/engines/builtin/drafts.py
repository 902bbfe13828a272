"""Draft proposals for the verify path: the trace itself, or prompt-lookup n-grams."""

from __future__ import annotations

import torch

__all__ = ["parse_speculative", "ngram_drafts"]

METHODS = ("trace", "ngram")


def parse_speculative(speculative: dict | None) -> tuple[str, int] | None:
    """Validate ``{"method": "trace" | "ngram", "num_tokens": k}`` into ``(method, k)``."""
    if speculative is None:
        return None
    if not isinstance(speculative, dict):
        raise TypeError(
            f"speculative must be a dict like {{'method': 'trace', 'num_tokens': 4}}, "
            f"got {speculative!r}"
        )
    unknown = set(speculative) - {"method", "num_tokens"}
    if unknown:
        raise ValueError(f"speculative: unknown keys {sorted(unknown)}")
    method = speculative.get("method", "trace")
    k = speculative.get("num_tokens", 4)
    if method not in METHODS:
        raise ValueError(f"speculative method must be one of {METHODS}, got {method!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative num_tokens must be a positive integer, got {k!r}")
    return method, k


def ngram_drafts(
    context: torch.Tensor, context_len: torch.Tensor, k: int, max_ngram: int = 3
) -> torch.Tensor:
    """Prompt-lookup drafts, vectorized over rows: no host synchronization.

    For each row, find the latest earlier occurrence of the row's last n tokens (n from
    ``max_ngram`` down to 1) and propose the ``k`` tokens that followed it. Rows with no match
    propose token 0, which verification simply rejects.

    Parameters
    ----------
    context
        ``[B, L]`` int64, committed tokens of each row left-aligned; entries past
        ``context_len`` are ignored.
    context_len
        ``[B]`` int64, committed tokens per row.
    """
    batch, width = context.shape
    drafts = torch.zeros((batch, k), dtype=context.dtype, device=context.device)
    found = torch.zeros(batch, dtype=torch.bool, device=context.device)
    for n in range(max_ngram, 0, -1):
        if width < n + 1:
            continue
        tail_pos = (context_len[:, None] - n + torch.arange(n, device=context.device)).clamp(min=0)
        tail = context.gather(1, tail_pos)
        windows = context.unfold(1, n, 1)  # [B, L - n + 1, n]
        starts = torch.arange(windows.shape[1], device=context.device)
        # an earlier occurrence, followed by at least one committed token
        match = (windows == tail[:, None, :]).all(-1) & (starts[None, :] + n < context_len[:, None])
        last = torch.where(match, starts[None, :], -1).amax(dim=1)
        ok = (last >= 0) & ~found & (context_len > n)
        follow = (last[:, None] + n + torch.arange(k, device=context.device)).clamp(0, width - 1)
        valid = follow < context_len[:, None]
        proposal = torch.where(valid, context.gather(1, follow), 0)
        drafts = torch.where(ok[:, None], proposal, drafts)
        found |= ok
    return drafts
