"""The closed-engine guard: once ``close`` has run, what needs the model refuses.

:class:`~trace_replay.engines.base.EngineBase` wraps each class's own ``close`` and the
methods of :data:`NEEDS_OPEN` when the class is defined, so no engine repeats the check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["EngineClosed", "NEEDS_OPEN", "guard_class", "marking_closed", "refused_when_closed"]

# what a closed engine refuses: each needs the model (or worker, or connection) it released
NEEDS_OPEN = ("run", "generate", "weights_digest", "activations")


class EngineClosed(RuntimeError):
    """An engine was asked to score, generate, digest its weights or give its activations
    after ``close()`` (or its ``with`` block) released what it needs."""


def refused_when_closed(method: Callable) -> Callable:
    """``method``, raising :class:`EngineClosed` instead on an engine that is closed."""
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineClosed(f"engine {self.name!r} is closed: {method.__name__}() needs "
                               "what close() (or the end of its with block) released; build "
                               "a new engine")
        return method(self, *args, **kwargs)

    guarded._guarded = True  # type: ignore[attr-defined]
    return guarded


def marking_closed(close: Callable) -> Callable:
    """``close``, marking the engine closed once it has run (or failed part way: a half
    released engine is no more usable)."""
    @functools.wraps(close)
    def marking(self: Any) -> None:
        try:
            close(self)
        finally:
            self._closed = True

    marking._guarded = True  # type: ignore[attr-defined]
    return marking


def guard_class(cls: type) -> None:
    """Wrap the methods ``cls`` itself defines among ``close`` and :data:`NEEDS_OPEN`."""
    for name in (*NEEDS_OPEN, "close"):
        method = vars(cls).get(name)
        if callable(method) and not getattr(method, "_guarded", False):
            wrap = marking_closed if name == "close" else refused_when_closed
            setattr(cls, name, wrap(method))
