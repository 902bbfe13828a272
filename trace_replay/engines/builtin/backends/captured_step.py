"""A decode step captured once in a CUDA graph and launched: what both graph backends share.

:class:`~trace_replay.engines.builtin.backends.static.StaticCacheBackend` and
:class:`~trace_replay.engines.builtin.backends.deterministic.DeterministicBackend` each write a capturable
``step(tokens, positions) -> logits`` over their own cache. :func:`capture_step` warms it up
(compiling and autotuning happen there, for real, on a side stream), puts back the
bookkeeping the warm-up advanced, and captures one step; :class:`StepGraph` holds the graph
with its static input and output tensors and launches it for any batch up to its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

__all__ = ["StepGraph", "capture", "capture_step"]

WARMUP_RUNS = 2


class StepGraph(NamedTuple):
    """A captured step: its graph, static inputs ``[rows, q]`` and static output."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [rows, q] int64
    positions: torch.Tensor  # [rows, q] int64
    logits: torch.Tensor  # what the step returned while captured

    def launch(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the step on ``tokens``/``positions`` ``[B, q]`` (B <= rows); no host sync.

        Rows past ``B`` keep the inputs of an earlier step: their outputs are to be ignored.
        Returns the static output, valid until the next launch.
        """
        batch = tokens.shape[0]
        self.tokens[:batch].copy_(tokens)
        self.positions[:batch].copy_(positions)
        self.graph.replay()
        return self.logits


def capture_step(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rows: int,
    q: int,
    state: Sequence[torch.Tensor],
    *,
    pad_id: int = 0,
    pool=None,
) -> StepGraph:
    """Capture ``step`` for ``rows`` rows of ``q`` tokens.

    ``step`` must be capturable (no host reads, fixed shapes). ``state`` lists the tensors
    a step advances (cursors, valid masks): see :func:`capture`. Static inputs start as
    ``pad_id`` at position 0.
    """
    device = state[0].device
    tokens = torch.full((rows, q), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros((rows, q), dtype=torch.long, device=device)
    graph, logits = capture(lambda: step(tokens, positions), state, pool=pool)
    return StepGraph(graph, tokens, positions, logits)


_Out = TypeVar("_Out")


def capture(
    fn: Callable[[], _Out], state: Sequence[torch.Tensor], *, pool=None
) -> tuple[torch.cuda.CUDAGraph, _Out]:
    """Warm ``fn`` up on a side stream, then capture one call; returns (graph, its output).

    ``state`` lists the tensors a call advances: the warm-up runs change them for real, so
    they are saved first and put back after every run; what a warm-up wrote elsewhere is
    where the next real call writes anyway.
    """
    device = state[0].device
    saved = [tensor.clone() for tensor in state]

    def restore() -> None:
        for tensor, value in zip(state, saved):
            tensor.copy_(value)

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            fn()
            restore()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
