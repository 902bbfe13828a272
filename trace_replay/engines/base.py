"""The engine interface: what every engine takes, does and gives back.

An engine is built once (it holds a loaded model), replays batches of
:class:`ReplayRequest` into :class:`TraceResult` s, and says what it is (``settings``, the
provenance recorded in ``df.attrs``) apart from what it has done so far (``stats``).
:class:`Engine` declares every member; ``replay``, ``record``, checkpoints and layer
attribution use nothing else. :class:`EngineBase` implements all but ``run``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["Activations", "BatchFailed", "ENGINE_MEMBERS", "Engine", "EngineBase",
           "EngineClosed", "EngineConfig", "PROVENANCE", "ReplayRequest", "TraceResult",
           "check_engine", "engine_identity", "missing_members", "protocol_members"]


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
    extra: dict = field(default_factory=dict)  # more per-step [T] columns, by name


@dataclass(frozen=True)
class EngineConfig:
    """What every engine takes; engine-specific options are keyword arguments of its own.

    Validated on construction, so a bad value fails before any model is loaded.
    """

    model: Any = None  # None (embedded model), a folder, a cached name, or a loaded nn.Module
    dtype: str | torch.dtype | None = None  # None: the weights' own (float32 for the embedded)
    device: str | torch.device | None = None  # None: CUDA when available, else CPU
    batch_size: int | None = None  # request slots (vLLM: max_num_seqs); None: per engine
    top_k: int = 5  # alternatives recorded per step
    # batch-invariant arithmetic: a trace's numbers never depend on its batch-mates
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        for name, lowest in (("top_k", 0), ("batch_size", 1)):
            value = getattr(self, name)
            if value is None and name == "batch_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if self.dtype is not None:
            from trace_replay.models.load import resolve_dtype

            resolve_dtype(self.dtype)  # raises on an unknown name
        if self.device is not None:
            _check_device(self.device)


def _check_device(device: str | torch.device) -> None:
    """Refuse a malformed device, or one this machine does not have, before any loading."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a device name ({error})") from None
    backend = getattr(torch, device.type, None) if device.type in ("cuda", "mps", "xpu") else None
    if backend is not None:
        count = backend.device_count() if backend.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} is not available on this machine "
                             f"(torch.{device.type}.is_available() is False)")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has "
                             f"{count} {device.type} device(s)")


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


_CONTEXT = ("__enter__", "__exit__")


class BatchFailed(Exception):
    """``Engine.run`` failed for some of its requests: ``results`` holds one entry per
    request, in order, the result of each that finished and None for the others; ``error`` is
    the first failure, which ``replay`` raises once it has kept the finished results."""

    def __init__(self, error: BaseException, results: list[TraceResult | None]) -> None:
        super().__init__(str(error))
        self.error, self.results = error, results


class EngineClosed(RuntimeError):
    """An engine was asked to score, generate, digest its weights or give its activations
    after ``close()`` (or its ``with`` block) released what it needs."""


@runtime_checkable
class Engine(Protocol):
    """The one interface of every engine: :func:`~trace_replay.runs.replay`, ``record``,
    checkpoints and layer attribution use these members and nothing else.

    ``run`` keeps the order of its requests and calls ``on_tokens(n)`` as ``n`` more trace
    tokens are scored (at least once per batch, so progress moves within a batch). An engine
    whose requests fail one by one (a server) raises :class:`BatchFailed` with the results
    that did finish, so that a checkpointed replay keeps them.
    ``settings`` is fixed once the engine is built (two runs with equal settings are
    comparable); ``stats`` accumulates over ``run`` calls. ``close`` releases the model and
    any worker processes; engines are context managers. A closed :class:`EngineBase` raises
    :class:`EngineClosed` from ``run``, ``generate``, ``weights_digest`` and ``activations``;
    ``settings`` and ``stats`` still answer.

    ``on_batch`` is set by a caller that watches the forwards (layer attribution) and reset
    to None after. While it is set, an engine whose forwards run in this process
    (``activations()`` answers) calls it with each batch's requests, in row order, before
    that batch's forwards, and runs those forwards as ``activations()`` describes, even where
    it has a faster path that skips the model's modules (prefill's separate head). Other
    engines never call it.

    A user engine passed to ``replay`` needs every member (:func:`check_engine` names the
    missing ones); subclassing :class:`EngineBase` gives all but ``run`` and the provenance
    attributes its docstring lists.
    """

    name: str  # "torch", "prefill", "vllm", "vllm-server"
    batch_size: int  # request slots; replay hands ``run`` whole batches of them
    max_model_len: int | None  # prompt + trace tokens at most (None: no known limit)
    deterministic: bool  # batch-invariant arithmetic was asked for
    selected_by: str | None  # how make_engine("auto", ...) chose this engine, else None
    can_generate: bool  # ``generate`` works (decode engines)
    on_batch: Callable[[Sequence[ReplayRequest]], None] | None
    tokenizer: Any  # the model's; text traces are tokenized with it
    vocab_size: int | None  # logits per step, the bound of ``rank`` (None: unknown)

    def settings(self) -> dict[str, Any]: ...

    def run(self, requests: Sequence[ReplayRequest], *,
            on_tokens: Callable[[int], None] | None = None) -> list[TraceResult]: ...

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[tuple[list[int], list[float]]]: ...

    def stats(self) -> dict[str, Any]: ...

    def weights_digest(self) -> str | None: ...

    def activations(self) -> Activations: ...

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc_info: object) -> None: ...


def protocol_members(protocol: type, dunders: Sequence[str] = ()) -> tuple[str, ...]:
    """Every member ``protocol`` declares, sorted: its annotated attributes and its public
    methods, with the special methods named in ``dunders``."""
    return tuple(sorted({*protocol.__annotations__, *(
        name for name, value in vars(protocol).items()
        if inspect.isfunction(value) and (not name.startswith("_") or name in dunders))}))


def missing_members(obj: Any, names: Sequence[str]) -> list[str]:
    """The ``names`` that ``obj`` lacks, in order.

    A member the object or its class defines counts without being read (a lazy property is
    not evaluated); any other is read as a user would (``hasattr``), so an object that
    forwards attributes to a wrapped one has them.
    """
    return [name for name in names if not _defines(obj, name)]


# every member of the protocol, attributes and methods (what check_engine asks for)
ENGINE_MEMBERS = protocol_members(Engine, _CONTEXT)


def check_engine(engine: Any) -> None:
    """Raise TypeError naming the :class:`Engine` members ``engine`` lacks (none: it is one).

    Members are looked up as :func:`missing_members` does: the ``tokenizer`` property is not
    evaluated, and an object that forwards attributes to a wrapped engine passes.
    """
    wanted = ENGINE_MEMBERS + (PROVENANCE if isinstance(engine, EngineBase) else ())
    missing = missing_members(engine, wanted)
    if missing:
        raise TypeError(f"{type(engine).__name__} is not an Engine: it lacks "
                        f"{', '.join(missing)} (subclass trace_replay.engines.base.EngineBase, "
                        "which gives all but run and the provenance attributes)")


def _defines(obj: Any, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return hasattr(obj, name)
    return True


# what a closed engine refuses: each needs the model (or worker, or connection) it released
_NEEDS_OPEN = ("run", "generate", "weights_digest", "activations")


def _refused_when_closed(method: Callable) -> Callable:
    """``method``, raising :class:`EngineClosed` instead on an engine that is closed."""
    @functools.wraps(method)
    def guarded(self: EngineBase, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineClosed(f"engine {self.name!r} is closed: {method.__name__}() needs "
                               "what close() (or the end of its with block) released; build "
                               "a new engine")
        return method(self, *args, **kwargs)

    guarded._guarded = True
    return guarded


def _marking_closed(close: Callable) -> Callable:
    """``close``, marking the engine closed once it has run (or failed part way: a half
    released engine is no more usable)."""
    @functools.wraps(close)
    def marking(self: EngineBase) -> None:
        try:
            close(self)
        finally:
            self._closed = True

    marking._guarded = True
    return marking


class EngineBase(ABC):
    """Shared plumbing: every :class:`Engine` member but ``run``.

    Subclasses implement ``run`` and set the provenance ``name``, ``model_label``,
    ``engine_path``, ``dtype``, ``device``, ``batch_size``, ``top_k`` (the annotated
    attributes without a value here, :data:`PROVENANCE`; :func:`check_engine` names those
    missing), and where they differ from the defaults ``deterministic``, ``max_model_len``,
    ``tokenizer_source`` and ``lm``; ``can_generate`` is True when the class overrides
    ``generate``.
    They may extend :meth:`settings` and :meth:`stats`, and override ``generate`` and
    ``activations`` where they can. ``vocab_size`` and ``weights_digest`` read ``lm``;
    engines whose model is elsewhere override them.

    Once ``close`` has run, ``run``, ``generate``, ``weights_digest`` and ``activations``
    raise :class:`EngineClosed`, in every subclass: each class's own ``close`` and those
    methods are wrapped when the class is defined, so no engine repeats the check.
    """

    name: str = "engine"
    model_label: str
    engine_path: str
    dtype: str
    device: str
    batch_size: int
    top_k: int
    deterministic: bool = False
    max_model_len: int | None = None
    selected_by: str | None = None  # set by make_engine("auto", ...): how the choice was made
    on_batch: Callable[[Sequence[ReplayRequest]], None] | None = None  # see Engine
    lm: torch.nn.Module | None = None  # the model in this process (None: elsewhere, closed)
    tokenizer_source: Any = None  # what models.load_tokenizer reads (None: the embedded model)
    _tokenizer: Any = None
    _weights_seen: tuple[bytes, str] | None = None  # (glance, digest): see weights_digest
    _closed: bool = False  # set by close(); then _NEEDS_OPEN methods raise EngineClosed

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in (*_NEEDS_OPEN, "close"):
            method = vars(cls).get(name)
            if callable(method) and not getattr(method, "_guarded", False):
                wrap = _marking_closed if name == "close" else _refused_when_closed
                setattr(cls, name, wrap(method))

    @abstractmethod
    def run(self, requests: Sequence[ReplayRequest], *,
            on_tokens: Callable[[int], None] | None = None) -> list[TraceResult]:
        """Score ``requests``; one result each, in the order given (see :class:`Engine`)."""

    @property
    def can_generate(self) -> bool:
        """Whether ``generate`` works: by default, whether the class overrides it."""
        return type(self).generate is not EngineBase.generate

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded on first use (text traces, token texts)."""
        if self._tokenizer is None:
            from trace_replay.models.load import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_source)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Logits per step, the bound of ``rank``: ``lm``'s output size (None without ``lm``)."""
        head = None if self.lm is None else self.lm.get_output_embeddings()
        return None if head is None else int(head.weight.shape[0])

    @_refused_when_closed
    def weights_digest(self) -> str | None:
        """A digest of the weights the engine scores with, read now; ``None`` where the
        engine cannot read them (a server). A checkpoint keys on it, so rows computed with
        other weights under the same model name are never served; every replay records it.

        For a model in memory (``lm``): per parameter, its name, shape, dtype, float64 sum
        and sum of squares, and the exact bytes of a strided sample of 1,024 elements — one
        pass over the weights on their device, changed by any edit short of a contrived one.
        That pass takes seconds on a CPU (float64 sums of 135M float32 weights), so its
        digest is kept while a glance at the weights stays the same: per parameter its
        storage, its count of in-place edits (``Tensor._version``, which autograd keeps:
        an optimizer step, ``load_state_dict``, an edit under ``torch.no_grad``) and the
        sample. An edit through ``.data`` counts no edit; it is seen when it changes a
        sampled element (a rescale, a reload, a training step do).
        """
        if self.lm is None:
            return None
        glance = hashlib.sha256()
        for name, weight in self.lm.named_parameters():
            glance.update(f"{name}:{weight.data_ptr()}:{weight._version}".encode())
            glance.update(_sample(weight))
        if self._weights_seen is None or self._weights_seen[0] != glance.digest():
            self._weights_seen = (glance.digest(), self._read_weights())
        return self._weights_seen[1]

    def _read_weights(self) -> str:
        """:meth:`weights_digest`'s full pass over ``lm``'s parameters."""
        digest = hashlib.sha256()
        with torch.no_grad():
            for name, weight in self.lm.named_parameters():
                flat = weight.detach().reshape(-1)
                sums = torch.stack([flat.sum(dtype=torch.float64),
                                    flat.double().square().sum()]).cpu().numpy()
                digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype}".encode())
                digest.update(sums.tobytes())
                digest.update(_sample(weight))
        return digest.hexdigest()[:32]

    @_refused_when_closed
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[tuple[list[int], list[float]]]:
        """Free generation, ``(token_ids, raw logprobs)`` per prompt; only where
        ``can_generate`` (this default raises NotImplementedError)."""
        raise NotImplementedError(f"engine {self.name!r} cannot generate (can_generate is "
                                  "False)")

    @_refused_when_closed
    def activations(self) -> Activations:
        """Where this engine's forwards can be watched (:class:`Activations`); this default
        raises NotImplementedError: the model runs outside this process."""
        raise NotImplementedError(f"engine {self.name!r} runs its model outside this process: "
                                  "its activations cannot be read (layer attribution runs "
                                  "the torch and prefill engines)")

    def settings(self) -> dict[str, Any]:
        settings = {"engine": self.name, "engine_path": self.engine_path,
                    "model": self.model_label, "dtype": self.dtype, "device": self.device,
                    "batch_size": self.batch_size, "top_k": self.top_k,
                    "deterministic": self.deterministic}
        if self.selected_by is not None:
            settings["selected_by"] = self.selected_by
        return settings

    def stats(self) -> dict[str, Any]:
        return {}

    @_marking_closed
    def close(self) -> None:
        """Release what the engine holds; a closed engine cannot run again
        (:class:`EngineClosed`)."""

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine_path}, {self.dtype}, {self.device})"


def _sample(weight: torch.Tensor) -> bytes:
    """The exact bytes of 1,024 elements of ``weight``, strided over all of it."""
    with torch.no_grad():
        flat = weight.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // 1024)][:1024]
        return sample.cpu().contiguous().view(torch.uint8).numpy().tobytes()


# what a subclass of EngineBase sets itself: the annotated attributes without a value there
PROVENANCE = tuple(name for name in EngineBase.__annotations__
                   if not hasattr(EngineBase, name) and not name.startswith("_"))


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
