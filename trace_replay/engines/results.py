"""From device scores to per-trace host results, one host transfer per batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trace_replay.engines.base import ReplayRequest, TraceResult
from trace_replay.engines.decode import Steps
from trace_replay.engines.scoring import TokenScores, collect_rows

__all__ = ["split_results", "wave_results"]


def split_results(requests: Sequence[ReplayRequest], host: dict[str, np.ndarray],
                  rows: Sequence[np.ndarray]) -> list[TraceResult]:
    """One :class:`TraceResult` per request from host arrays, taking ``rows[i]`` for request i."""
    return [TraceResult(trace_id=r.trace_id, prompt_len=r.prompt_len,
                        **{name: values[take] for name, values in host.items()})
            for r, take in zip(requests, rows)]


def wave_results(wave: Sequence[ReplayRequest], steps: Steps,
                 counts: torch.Tensor) -> list[TraceResult]:
    """Results of a decoded wave; ``counts[f, b]`` tokens of row b were committed by forward f.

    Forward f scored ``width_f = len(tokens_f) // B`` positions per row, row-major; the first
    ``counts[f, b]`` of row b's are its committed tokens, and a row keeps its first
    ``trace_len`` committed tokens (rows that finished early ran on with the batch).
    """
    host = collect_rows(TokenScores(*(torch.cat(parts) for parts in zip(*(s for s, _ in steps)))),
                        torch.cat([tokens for _, tokens in steps]))
    counts = counts.cpu().numpy()
    batch = len(wave)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in steps])
    index_parts, row_parts = [], []
    for f in range(len(steps)):  # vectorized over rows: one pass per forward
        width = (bounds[f + 1] - bounds[f]) // batch
        grid = bounds[f] + np.arange(batch * width).reshape(batch, width)
        kept = np.arange(width)[None, :] < counts[f][:, None]
        index_parts.append(grid[kept])  # row-major: each row's committed tokens in order
        row_parts.append(np.nonzero(kept)[0])
    rows = np.concatenate(row_parts)
    order = np.argsort(rows, kind="stable")  # by row, forwards in order within a row
    per_row = np.split(np.concatenate(index_parts)[order],
                       np.cumsum(np.bincount(rows, minlength=batch))[:-1])
    return split_results(wave, host, [take[: r.trace_len] for take, r in zip(per_row, wave)])
