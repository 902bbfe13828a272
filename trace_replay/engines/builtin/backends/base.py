"""The interface every forward pass of the built-in engine implements, and its check.

:class:`~trace_replay.engines.builtin.engine.TorchEngine` and its replay loop
(:mod:`~trace_replay.engines.builtin.decode`, :mod:`~trace_replay.engines.builtin.verify`)
use a backend through the members :class:`Backend` declares and nothing else;
:func:`~trace_replay.engines.builtin.backends.factory.make_backend` builds one by kind from
:class:`BackendOptions` (the engine's choices, checked before any model loads) and checks it
(:func:`check_backend`). The backends import this module; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trace_replay.engines.base import Activations, missing_members, protocol_members
from trace_replay.engines.builtin.scoring import TokenScores

__all__ = [
    "BACKEND_MEMBERS",
    "DETERMINISTIC_ATTENTION",
    "FLOAT32_MATMUL",
    "Backend",
    "BackendOptions",
    "check_backend",
    "check_float32_matmul",
]

FLOAT32_MATMUL = ("3xtf32", "ieee")
DETERMINISTIC_ATTENTION = ("tiles", "rows")


class Backend(Protocol):
    """A forward pass holding one wave's KV cache, and how its steps are scored.

    Design contract:

    * ``prefill`` starts a wave: left-padded prompts in, ``[B, V]`` next-token logits out.
      ``decode`` feeds ``tokens`` ``[B, q]`` at ``positions`` ``[B, q]`` and returns
      ``[B, q, V]`` logits; ``keep`` ``[B, q]`` says which of the last decoded tokens stay in
      context (verify: a rejected draft is never attended again). A replay never reads back
      to the host inside them.
    * ``static_logits``: ``decode`` returns the same tensor every step (a captured graph's
      output), so the replay loop may capture its forced step over it.
    * ``score(logits, token_ids, top_k)`` scores a step: the engines' shared scorer for the
      device, or the backend's own where its numbers must not depend on the batch.
    * ``settings()`` is what the backend adds to the engine's ``settings()``: its choices
      that change numbers, nothing for those left at their defaults.
    * ``activations()`` answers ``Engine.activations`` (where the forwards can be watched);
      a backend whose steps call no Python module raises NotImplementedError naming the one
      to build instead.
    * ``name`` goes into the engine path (``torch-decode[<name>]``); ``forwards`` counts the
      forwards run, prefills included.
    """

    name: str
    forwards: int

    @property
    def static_logits(self) -> bool:
        """Read-only: a backend may derive it (the static backend: whether it captures)."""

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def keep(self, keep: torch.Tensor) -> None: ...

    def score(self, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores: ...

    def settings(self) -> dict[str, Any]: ...

    def activations(self) -> Activations: ...


# every member of the protocol (what check_backend asks for)
BACKEND_MEMBERS = protocol_members(Backend)


def check_backend(backend: Any) -> None:
    """Raise TypeError naming the :class:`Backend` members ``backend`` lacks (none: it is one)."""
    missing = missing_members(backend, BACKEND_MEMBERS)
    if missing:
        raise TypeError(
            f"{type(backend).__name__} is not a built-in engine backend: it lacks "
            f"{', '.join(missing)} (see trace_replay.engines.builtin.backends."
            "base.Backend)"
        )


def check_float32_matmul(value: str) -> None:
    """Refuse a ``float32_matmul`` that is not one of :data:`FLOAT32_MATMUL`."""
    if value not in FLOAT32_MATMUL:
        raise ValueError(f"float32_matmul={value!r}; choose one of {', '.join(FLOAT32_MATMUL)}")


@dataclass(frozen=True)
class BackendOptions:
    """The engine's choices that reach its backend; refused when made if out of range (before
    any model loads). A backend ignores those that are not its own."""

    max_query_len: int = 1  # most tokens per row a decode feeds (k + 1 for verify)
    float32_matmul: str = "3xtf32"  # static: a float32 model's products on CUDA
    batch1_fusions: bool = True  # static: the batch-1 fusions, half precision on CUDA
    deterministic_attention: str = "tiles"  # invariant: its Triton attention

    def __post_init__(self) -> None:
        check_float32_matmul(self.float32_matmul)
        if self.deterministic_attention not in DETERMINISTIC_ATTENTION:
            raise ValueError(
                f"deterministic_attention={self.deterministic_attention!r}; "
                f"choose one of {', '.join(DETERMINISTIC_ATTENTION)}"
            )
