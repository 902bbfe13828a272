"""Pairing two runs' activations: run a's held until run b produces the same (trace, step).

:class:`HeldActivations` is run a's sink: per forward, the gathered rows of each site on the
host, indexed by (trace, step). :class:`Comparer` is run b's sink: it finds each row's
partner, reduces the pair to :func:`row_metrics` and drops run a's copy once every row of a
block has been compared, so held memory shrinks while run b runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trace_replay.analysis.capture import ForwardRows, Site
from trace_replay.engines.base import ReplayRequest

__all__ = ["METRICS", "HeldActivations", "Comparer", "row_metrics"]

METRICS = ("max_abs_diff", "rel_l2", "cosine", "bitwise_equal")


class HeldActivations:
    """Run a's activations of one pass, per forward, until run b's partner arrives."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[int, torch.Tensor]] = {}  # forward -> site -> [N, width]
        self.where: dict[tuple[int, int], tuple[int, int]] = {}  # (trace, step) -> (fwd, row)
        self.left: dict[tuple[int, int], int] = {}  # (fwd, site) -> rows not yet compared

    def put(self, site: Site, rows: ForwardRows, values: torch.Tensor) -> None:
        fid = rows.forward_id
        if fid not in self.blocks:
            self.blocks[fid] = {}
            for i, key in enumerate(zip(rows.trace_index.tolist(), rows.step.tolist())):
                if key in self.where:
                    raise RuntimeError(f"run a computed trace #{key[0]} step {key[1]} twice")
                self.where[key] = (fid, i)
        self.blocks[fid][site.index] = values.cpu()
        self.left[fid, site.index] = len(rows.step)

    def take(
        self, site: Site, groups: dict[int, tuple[np.ndarray, np.ndarray]], n: int
    ) -> torch.Tensor:
        """Run a's values for ``n`` rows of b, gathered per a-forward; drops what is used up."""
        out = None
        for fid, (b_rows, a_rows) in groups.items():
            block = self.blocks[fid][site.index]
            if out is None:
                out = block.new_empty((n, block.shape[1]))
            out[torch.from_numpy(b_rows)] = block[torch.from_numpy(a_rows)]
            self.left[fid, site.index] -= len(a_rows)
            if self.left[fid, site.index] == 0:
                del self.blocks[fid][site.index]
        return out


class Comparer:
    """Run b's sink: pairs each activation with run a's and keeps four numbers per row."""

    def __init__(
        self, held: HeldActivations, requests: Sequence[ReplayRequest], last_site: int, bar
    ) -> None:
        self.held, self.requests, self.last_site, self.bar = held, requests, last_site, bar
        self.groups: tuple[int, dict] | None = None  # (b forward, its rows grouped by a fwd)
        self.parts: list[dict[str, np.ndarray]] = []

    def __call__(self, site: Site, rows: ForwardRows, values: torch.Tensor) -> None:
        if self.groups is None or self.groups[0] != rows.forward_id:
            self.groups = (rows.forward_id, self._group(rows))
        mine = values.cpu()
        theirs = self.held.take(site, self.groups[1], len(mine))
        self.parts.append(
            {
                "trace_index": rows.trace_index,
                "step": rows.step,
                "layer": np.full(len(mine), site.layer),
                "site": np.full(len(mine), site.name, dtype=object),
                **row_metrics(theirs, mine),
            }
        )
        if site.index == self.last_site:
            self.bar.update(len(mine))

    def _group(self, rows: ForwardRows) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        found: dict[int, tuple[list, list]] = {}
        for i, key in enumerate(zip(rows.trace_index.tolist(), rows.step.tolist())):
            if key not in self.held.where:
                raise RuntimeError(
                    f"run b computed trace {self.requests[key[0]].trace_id!r} "
                    f"step {key[1]}, which run a did not"
                )
            fid, row = self.held.where.pop(key)
            found.setdefault(fid, ([], []))[0].append(i)
            found[fid][1].append(row)
        return {fid: (np.array(b), np.array(a)) for fid, (b, a) in found.items()}


def row_metrics(a: torch.Tensor, b: torch.Tensor) -> dict[str, np.ndarray]:
    """``max_abs_diff``, ``rel_l2``, ``cosine`` and ``bitwise_equal`` of each row of b vs a.

    Computed in float64. A row without any difference has ``rel_l2`` 0 and ``cosine`` 1
    exactly; ``bitwise_equal`` needs the same dtype and identical bit patterns.
    """
    if a.dtype == b.dtype:
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        bitwise = (a.view(ints) == b.view(ints)).all(dim=1)
    else:
        bitwise = torch.zeros(len(a), dtype=torch.bool)
    a, b = a.double(), b.double()
    diff = b - a
    max_abs = diff.abs().amax(dim=1)
    norm_a, norm_b = a.norm(dim=1), b.norm(dim=1)
    rel_l2 = diff.norm(dim=1) / norm_a
    cosine = ((a * b).sum(dim=1) / (norm_a * norm_b)).clamp(-1.0, 1.0)
    same = (max_abs == 0) | bitwise
    return {
        "max_abs_diff": torch.where(same, 0.0, max_abs).numpy(),
        "rel_l2": torch.where(same, 0.0, rel_l2).numpy(),
        "cosine": torch.where(same, 1.0, cosine).numpy(),
        "bitwise_equal": bitwise.numpy(),
    }
