"""Layer attribution's hook for deterministic mode: the sites of the row-wise forward.

In deterministic mode the engines compute with
:class:`~trace_replay.engines.builtin.backends.deterministic_model.DeterministicLlama`, which uses the model's
weights but not its modules' ``forward``, so :class:`~trace_replay.analysis.capture.SiteCapture`'s
module hooks would see nothing. :class:`RowCapture` is its counterpart: it is the model's
:class:`~trace_replay.engines.builtin.backends.deterministic_model.RowObserver`, receives each forward's rows
(every token is one row; ``cache_row`` names the batch row) and hands the sink the same
:class:`~trace_replay.analysis.capture.ForwardRows` and ``[N, width]`` values as ``SiteCapture``
does, so the pairing and metrics of :mod:`trace_replay.analysis.attribution` are shared.

The logits site is computed here, from the final-norm rows that are replay steps, with the
model's own row-invariant ``lm_head``: a row's logits have the same bits whichever rows
share the call, so they are the logits the engine scored.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from trace_replay.analysis.capture import ForwardRows, Sink, Site
from trace_replay.engines.base import Engine, ReplayRequest

if TYPE_CHECKING:  # the row-wise model imports the Triton kernels' modules
    from trace_replay.engines.builtin.backends.deterministic_model import DeterministicLlama

__all__ = ["RowCapture"]


class RowCapture:
    """The deterministic backend's forwards, fed to ``sink`` per site (see module docstring).

    Use as a context manager around ``engine.run(requests)``; ``model`` is the ``rows`` of
    the engine's ``activations()``. Parameters are those of
    :class:`~trace_replay.analysis.capture.SiteCapture`, with the row-wise ``model`` for the module.
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: DeterministicLlama,
        engine: Engine,
        requests: Sequence[ReplayRequest],
        sites: Sequence[Site],
        sink: Sink,
    ) -> None:
        self.model, self.engine, self.sink = model, engine, sink
        self.sites = {(site.layer, site.name): site for site in sites}
        self.logits = next((s for s in sites if s.name == "logits"), None)
        self.index = {r.trace_id: i for i, r in enumerate(requests)}
        self._batch: Sequence[ReplayRequest] | None = None
        self._rows: ForwardRows | None = None

    def __enter__(self) -> RowCapture:
        if self.model.observer is not None:
            raise RuntimeError("the model is already observed by another capture")
        self.engine.on_batch = self._on_batch
        self.model.observer = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.model.observer = None
        self.engine.on_batch = None

    def _on_batch(self, batch: Sequence[ReplayRequest]) -> None:
        self._batch = list(batch)

    def begin(self, cache_row: torch.Tensor, positions: torch.Tensor) -> None:
        """Which rows of this forward are replay steps (cache row ``b`` is batch row ``b``)."""
        if self._batch is None:
            raise RuntimeError("a forward ran before the engine announced its batch")
        batch = self._batch
        row = cache_row.cpu().long()
        real = row < len(batch)  # padding rows sit in the scratch row, past every batch row
        safe = torch.where(real, row, 0)
        prompt_len = torch.tensor([r.prompt_len for r in batch])[safe]
        trace_len = torch.tensor([r.trace_len for r in batch])[safe]
        step = positions.cpu().long() - (prompt_len - 1)
        (picked,) = torch.nonzero(real & (step >= 0) & (step < trace_len), as_tuple=True)
        trace_index = np.array(
            [self.index[batch[b].trace_id] for b in row[picked].tolist()], dtype=np.int64
        )
        picked_device = picked.to(cache_row.device)
        # rows are flat (one token each): batch_rows index them, columns are unused
        self._rows = ForwardRows(
            next(self._ids),
            picked_device,
            torch.zeros_like(picked_device),
            trace_index,
            step[picked].numpy(),
        )

    def site(self, layer: int, name: str, values: torch.Tensor) -> None:
        rows = self._rows
        if rows is None or not len(rows.step):
            return
        wanted = self.sites.get((layer, name))
        picked = None
        if wanted is not None:
            picked = values.detach()[rows.batch_rows]
            self.sink(wanted, rows, picked)
        if name == "final_norm" and self.logits is not None:
            if picked is None:
                picked = values.detach()[rows.batch_rows]
            self.sink(self.logits, rows, self.model.lm_head(picked))
