"""The core engine protocol: what every engine takes, does and gives back.

An engine is built once (it holds a loaded model), replays batches of
:class:`ReplayRequest` into :class:`TraceResult` s, and says what it is (``settings``, the
provenance recorded in ``df.attrs``) apart from what it has done so far (``stats``).
``replay``, checkpoints and the cluster path use these members and nothing else. What
only some engines can do (free generation, watched forwards) is declared in
:mod:`~trace_replay.engines.capabilities`, one small protocol per capability.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from typing import Self  # 3.11; read by the type checker only

__all__ = ["BatchFailed", "Engine", "ReplayRequest", "TraceResult", "missing_members"]


@dataclass(frozen=True)
class ReplayRequest:
    """One tokenized trace, ready for an engine."""

    trace_id: str
    prompt_token_ids: tuple[int, ...]
    trace_token_ids: tuple[int, ...]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def trace_len(self) -> int:
        return len(self.trace_token_ids)


@dataclass
class TraceResult:
    """An engine's per-step numbers for one trace (host arrays, one entry per step)."""

    trace_id: str
    prompt_len: int
    token_ids: np.ndarray  # [T] int64, the trace tokens as the engine emitted them
    logprob: np.ndarray  # [T] float64
    rank: np.ndarray  # [T] int64
    top_token_ids: np.ndarray  # [T, top_k] int64
    top_logprobs: np.ndarray  # [T, top_k] float64
    entropy: np.ndarray  # [T] float64, NaN where the engine cannot give it
    # [T] float64: log of the probability mass outside the top-k (None: not recorded)
    tail_logmass: np.ndarray | None = None
    extra: dict = field(default_factory=dict)  # more per-step [T] columns, by name


class BatchFailed(Exception):
    """``Engine.run`` failed for some of its requests: ``results`` holds one entry per
    request, in order, the result of each that finished and None for the others; ``error`` is
    the first failure, which ``replay`` raises once it has kept the finished results."""

    def __init__(self, error: BaseException, results: list[TraceResult | None]) -> None:
        super().__init__(str(error))
        self.error, self.results = error, results


@runtime_checkable
class Engine(Protocol):
    """The one interface of every engine: :func:`~trace_replay.runs.replay`, checkpoints
    and the cluster path use these members and nothing else.

    ``run`` keeps the order of its requests and calls ``on_tokens(n)`` as ``n`` more trace
    tokens are scored (at least once per batch, so progress moves within a batch). An engine
    whose requests fail one by one (a server) raises :class:`BatchFailed` with the results
    that did finish, so that a checkpointed replay keeps them.
    ``settings`` is fixed once the engine is built (two runs with equal settings are
    comparable); ``stats`` accumulates over ``run`` calls. ``weights_digest`` names the
    weights scored with, read now (None where the engine cannot read them). ``close``
    releases the model and any worker processes; engines are context managers.

    A user engine passed to ``replay`` needs every member
    (:func:`~trace_replay.engines.base.check_engine` names the missing ones); subclassing
    :class:`~trace_replay.engines.base.EngineBase` gives all but ``run`` and the provenance
    attributes its docstring lists.
    """

    name: str  # the registry's name of the engine (trace_replay.engines.registry)
    batch_size: int  # request slots; replay hands ``run`` whole batches of them
    max_model_len: int | None  # prompt + trace tokens at most (None: no known limit)
    deterministic: bool  # batch-invariant arithmetic was asked for
    selected_by: str | None  # how make_engine("auto", ...) chose this engine, else None
    tokenizer: Any  # the model's; text traces are tokenized with it

    @property
    def vocab_size(self) -> int | None:
        """Logits per step, the bound of ``rank`` (None: unknown); read-only, so an engine
        may derive it from its model."""

    def settings(self) -> dict[str, Any]: ...

    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]: ...

    def stats(self) -> dict[str, Any]: ...

    def weights_digest(self) -> str | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...


def missing_members(obj: Any, names: Sequence[str]) -> list[str]:
    """The ``names`` that ``obj`` lacks, in order.

    A member the object or its class defines counts without being read (a lazy property is
    not evaluated); any other is read as a user would (``hasattr``), so an object that
    forwards attributes to a wrapped one has them.
    """
    return [name for name in names if not _defines(obj, name)]


def _defines(obj: Any, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return hasattr(obj, name)
    return True
