"""The capability of an engine whose weights can change while it runs.

A server's weights are the server's: an RL rollout server loads each training step's while
it serves, so rows scored a minute apart may come from two models. An engine that says so
(:class:`MovingWeights`, with ``weights_can_change`` True; ``isinstance`` checks it)
promises a ``weights_digest()`` cheap enough to read before every part or batch is kept
(the server engine: one probe, two one-token requests), and
:mod:`~trace_replay.runs.weights_watch` reads it there. Engines whose weights are in this
process or loaded once from files do not have it: their digest is read once, at the start.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["MovingWeights"]


@runtime_checkable
class MovingWeights(Protocol):
    """Weights that can change under the engine while it runs; ``weights_digest()`` reads
    what they are now, cheaply."""

    weights_can_change: bool  # True: replay reads weights_digest() again before keeping rows

    def weights_digest(self) -> str | None: ...
