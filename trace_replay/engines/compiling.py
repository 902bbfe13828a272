"""What every ``torch.compile`` of the package needs from dynamo's configuration."""

from __future__ import annotations

import torch

__all__ = ["RECOMPILES", "allow_recompiles"]

# graphs one compiled function may hold: one per (shape, dtype) it meets
RECOMPILES = 64


def allow_recompiles() -> None:
    """Let a compiled function hold :data:`RECOMPILES` graphs, not dynamo's default 8.

    The package compiles per static shape (``dynamic=False``) and with ``fullgraph=True``,
    so the limit is a hard error, not a fallback: a process that replays several models,
    dtypes or batch sizes (a test session, a sweep) meets more than 8 shapes of the
    decoder layer or of the scorer (one per row count, dtype and top-k). Never lowers a
    limit set higher.
    """
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                 RECOMPILES)
