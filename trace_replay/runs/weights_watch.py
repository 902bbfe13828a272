"""Rows are kept only while the engine's weights are those the run started with.

A run reads the engine's ``weights_digest()`` once, at its start, and labels every row with
it (``df.attrs``, the checkpoint's key). An engine whose weights can change while it runs
(:class:`~trace_replay.engines.moving_weights.MovingWeights`: a server that loads new
weights while serving) is read again after each group of rows is computed and before it
is kept: every part with a checkpoint, every engine call without. Rows between two equal
readings were computed with the run's weights; when a reading differs, the rows since the
last equal one may hold the new weights' numbers, and the run stops with
:class:`WeightsChanged` naming the first of them, keeping what was verified before.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trace_replay.wording import plural

if TYPE_CHECKING:
    from trace_replay.engines.protocol import Engine

__all__ = ["WeightsChanged", "WeightsWatch"]


class WeightsChanged(RuntimeError):
    """The engine's weights changed during a run; ``trace_id`` is the first trace whose rows
    may hold the new weights' numbers (none of it, or of the traces after it, was kept)."""

    def __init__(self, message: str, *, trace_id: str) -> None:
        super().__init__(message)
        self.trace_id = trace_id

    def __reduce__(self) -> tuple:
        return functools.partial(type(self), trace_id=self.trace_id), self.args


class WeightsWatch:
    """Reads ``engine``'s weights again before rows are kept.

    A run makes one for an engine that has
    :class:`~trace_replay.engines.moving_weights.MovingWeights` only (checked by the run,
    so that other engines' runs do not touch this module).

    Parameters
    ----------
    engine
        The run's engine, whose ``weights_digest()`` is cheap to read.
    digest
        Its ``weights_digest()`` as the run read it at the start (``None``: nothing to
        compare with, nothing checked).
    kept_in
        Where verified rows go, for the error (a checkpoint folder; ``None``: the result).
    """

    def __init__(self, engine: Engine, digest: str | None, *, kept_in: str | None = None) -> None:
        self.engine, self.digest, self.kept_in = engine, digest, kept_in
        self.verified = 0  # traces computed with the run's weights, as far as seen

    def check(self, trace_ids: Sequence[str]) -> None:
        """Raise :class:`WeightsChanged` naming ``trace_ids[0]`` unless the engine's weights,
        read now, are still the run's; ``trace_ids`` are the traces computed since the last
        check, in the order computed."""
        if self.digest is None or not len(trace_ids):
            return
        now = self.engine.weights_digest()
        if now == self.digest:
            self.verified += len(trace_ids)
            return
        first, after = trace_ids[0], len(trace_ids) - 1
        kept = f"the {plural(self.verified, 'trace')} verified before it " + (
            f"are in {self.kept_in}"
            if self.kept_in
            else "are not returned either (with checkpoint= they are kept)"
        )
        raise WeightsChanged(
            f"the weights of engine {self.engine.name!r} changed during the run "
            f"(weights_digest {self.digest} at its start, {now} now; for vllm-server, the "
            f"server's scores of a fixed probe moved): trace {first!r}"
            + (f" and the {plural(after, 'trace')} computed after it" if after else "")
            + f" may hold the new weights' numbers and were not kept; {kept}. A server that "
            "loads new weights while serving (an RL rollout server) must keep one set of "
            "weights for a replay: pin them, or run one replay (and one checkpoint folder) "
            "per weights version (docs/engines.md, vllm-server)",
            trace_id=first,
        )
