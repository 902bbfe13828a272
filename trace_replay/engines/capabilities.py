"""What only some engines can do, one small protocol per capability.

The core :class:`~trace_replay.engines.protocol.Engine` is what ``replay`` needs; a
capability is checked where it is used, by :func:`supports`, never by an engine's name:

* :class:`Generates`: free generation (``tr.record``);
* :class:`ActivationSource`: forwards in this process that can be watched (layer
  attribution reads the model ``activations()`` describes);
* :class:`BatchHooks`: ``on_batch``, called with each batch's requests before its forwards
  (layer attribution pairs rows with traces through it).

A new capability is a protocol of its own module beside this one, checked the same way;
the registry (:mod:`~trace_replay.engines.registry`) says, per engine name, which ones an
engine has before it is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from trace_replay.engines.protocol import missing_members

if TYPE_CHECKING:
    import torch

    from trace_replay.engines.protocol import ReplayRequest

__all__ = [
    "ActivationSource",
    "Activations",
    "BatchHooks",
    "Generates",
    "missing_members",
    "protocol_members",
    "supports",
]


@dataclass(frozen=True)
class Activations:
    """Where an engine's forwards can be watched in this process (layer attribution).

    ``model`` is the transformers model whose weights every forward uses; its module layout
    names the sites. With ``rows`` None the forwards call ``model``'s own modules, so forward
    hooks see ``[batch, width, ...]`` activations with the model's position and mask
    arguments. Otherwise the forwards bypass those modules, and ``rows`` (a row-wise model,
    :class:`~trace_replay.engines.builtin.backends.deterministic_model.DeterministicLlama`) reports
    each forward's rows to its ``observer``.
    """

    model: torch.nn.Module
    rows: Any = None


@runtime_checkable
class Generates(Protocol):
    """Free generation: ``(token_ids, raw logprobs)`` per prompt, greedy at temperature 0,
    else seeded sampling; stops at ``eos_token_id`` (kept) when given."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> list[tuple[list[int], list[float]]]: ...


@runtime_checkable
class ActivationSource(Protocol):
    """Forwards in this process: ``activations()`` says where they can be watched."""

    def activations(self) -> Activations: ...


@runtime_checkable
class BatchHooks(Protocol):
    """``on_batch`` is set by a caller that watches the forwards and reset to None after.
    While it is set, the engine calls it with each batch's requests, in row order, before
    that batch's forwards, and runs those forwards as ``activations()`` describes, even where
    it has a faster path that skips the model's modules (prefill's separate head)."""

    on_batch: Callable[[Sequence[ReplayRequest]], None] | None


def protocol_members(protocol: type, dunders: Sequence[str] = ()) -> tuple[str, ...]:
    """Every member ``protocol`` declares, sorted: its annotated attributes, its properties
    (read-only attributes) and its public methods, with the special methods named in
    ``dunders``."""
    return tuple(
        sorted(
            {
                *protocol.__annotations__,
                *(
                    name
                    for name, value in vars(protocol).items()
                    if isinstance(value, property)
                    or inspect.isfunction(value)
                    and (not name.startswith("_") or name in dunders)
                ),
            }
        )
    )


def supports(engine: Any, capability: type) -> bool:
    """Whether ``engine`` (an engine or an engine class) has ``capability``: it defines every
    member, and none is a default that only refuses (``EngineBase.generate``)."""
    names = protocol_members(capability)
    if missing_members(engine, names):
        return False
    return not any(getattr(_static(engine, name), "_refuses", False) for name in names)


def _static(obj: Any, name: str) -> Any:
    try:
        return inspect.getattr_static(obj, name)
    except AttributeError:
        return getattr(obj, name, None)
