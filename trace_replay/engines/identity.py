"""What :class:`~trace_replay.engines.base.EngineBase` adds around every engine: which weights it
scores with, and the guard that makes a closed engine refuse work.

- The weights' digest and the identity results carry (:func:`engine_identity`): a checkpoint
  keys on it, so rows computed with other weights under the same model name are never
  served; every replay records it in ``df.attrs``.
- The closed-engine guard: once ``close`` has run, what needs the model refuses.
  ``EngineBase`` wraps each class's own ``close`` and the methods of :data:`NEEDS_OPEN` when
  the class is defined, so no engine repeats the check.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trace_replay.engines.protocol import Engine

__all__ = [
    "NEEDS_OPEN",
    "EngineClosed",
    "engine_identity",
    "glance",
    "guard_class",
    "marking_closed",
    "read_weights",
    "refused_when_closed",
]


def glance(lm: torch.nn.Module) -> bytes:
    """A cheap look at ``lm``'s weights: per parameter its storage, its count of in-place
    edits (``Tensor._version``, which autograd keeps: an optimizer step, ``load_state_dict``,
    an edit under ``torch.no_grad``) and a strided sample of its values. While it stays the
    same, :func:`read_weights`' digest stands; an edit through ``.data`` counts no edit and
    is seen when it changes a sampled element (a rescale, a reload, a training step do)."""
    digest = hashlib.sha256()
    for name, weight in lm.named_parameters():
        digest.update(f"{name}:{weight.data_ptr()}:{weight._version}".encode())
        digest.update(_sample(weight))
    return digest.digest()


def read_weights(lm: torch.nn.Module) -> str:
    """A digest of ``lm``'s weights: per parameter, its name, shape, dtype, float64 sum and
    sum of squares, and the exact bytes of a strided sample of 1,024 elements — one pass
    over the weights on their device (seconds on a CPU for 135M float32 weights), changed by
    any edit short of a contrived one."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, weight in lm.named_parameters():
            flat = weight.detach().reshape(-1)
            sums = (
                torch.stack([flat.sum(dtype=torch.float64), flat.double().square().sum()])
                .cpu()
                .numpy()
            )
            digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype}".encode())
            digest.update(sums.tobytes())
            digest.update(_sample(weight))
    return digest.hexdigest()[:32]


def _sample(weight: torch.Tensor) -> bytes:
    """The exact bytes of 1,024 elements of ``weight``, strided over all of it."""
    with torch.no_grad():
        flat = weight.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024]
        return sample.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def engine_identity(engine: Engine) -> dict:
    """What ``engine``'s results are labelled with (``df.attrs``) and a checkpoint folder is
    keyed on: its settings and, where the engine reads its weights (``weights_digest()``),
    their digest, read now. A model edited or retrained in place under the same name is then
    refused by a folder and by ``merge`` as other settings, never served the rows of its old
    weights; so is another server, or another model behind the same server address (a
    server engine digests its address and its scores of a fixed probe)."""
    settings = engine.settings()
    weights = engine.weights_digest()
    return settings if weights is None else {**settings, "weights_digest": weights}


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
            raise EngineClosed(
                f"engine {self.name!r} is closed: {method.__name__}() needs "
                "what close() (or the end of its with block) released; build "
                "a new engine"
            )
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
