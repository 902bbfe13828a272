"""From device scores to per-trace host results, one host transfer per batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trace_replay.engines.base import ReplayRequest, TraceResult
from trace_replay.engines.builtin.decode import Steps
from trace_replay.engines.builtin.scoring import TokenScores, collect_rows

__all__ = ["split_results", "wave_results"]


def split_results(requests: Sequence[ReplayRequest], host: dict[str, np.ndarray],
                  rows: Sequence[np.ndarray | slice]) -> list[TraceResult]:
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
    The host arrays are put in row order once, so each result holds views of them.
    """
    host = collect_rows(TokenScores(*(torch.cat(parts) for parts in zip(*(s for s, _ in steps)))),
                        torch.cat([tokens for _, tokens in steps]))
    order, lengths = _committed_order(wave, [len(tokens) for _, tokens in steps],
                                      counts.cpu().numpy())
    host = {name: values[order] for name, values in host.items()}
    ends = np.cumsum(lengths)
    return split_results(wave, host, [slice(end - n, end) for end, n in zip(ends, lengths)])


def _committed_order(wave: Sequence[ReplayRequest], sizes: Sequence[int],
                     counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of each row's kept tokens, row after row, and how many each row keeps.

    Forward f, row b committed the tokens at ``bounds[f] + b * width_f + [0, counts[f, b])``;
    they are listed row-major over (row, forward), so each row's tokens come in order.
    """
    batch = len(wave)
    bounds = np.cumsum([0, *sizes])[:-1]
    widths = np.asarray(sizes) // batch
    starts = (bounds[:, None] + np.arange(batch)[None, :] * widths[:, None]).T.ravel()
    n = counts.T.ravel().astype(np.int64)
    flat = np.repeat(starts, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    per_row = counts.sum(axis=0).astype(np.int64)
    # keep each row's first trace_len tokens
    trace_len = np.array([r.trace_len for r in wave])
    within = np.arange(len(flat)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    keep = within < np.repeat(trace_len, per_row)
    return flat[keep], np.minimum(per_row, trace_len)
