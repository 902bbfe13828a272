"""The engine base class and the config every engine takes.

:class:`EngineConfig` is validated before any model is loaded; :class:`EngineBase`
implements every :class:`~trace_replay.engines.protocol.Engine` member but ``run``;
:func:`check_engine` names what a user engine lacks. The protocol, the capabilities, the
weights' digest and the closed-engine guard live in their own modules
(``protocol.py``, ``capabilities.py``, ``identity.py``); their names are
importable from here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import Self  # 3.11; read by the type checker only

from trace_replay.engines.capabilities import (
    Activations,
    ActivationSource,
    BatchHooks,
    Generates,
    protocol_members,
    supports,
)
from trace_replay.engines.identity import (
    EngineClosed,
    engine_identity,
    glance,
    guard_class,
    marking_closed,
    read_weights,
    refused_when_closed,
)
from trace_replay.engines.protocol import (
    BatchFailed,
    Engine,
    ReplayRequest,
    TraceResult,
    missing_members,
)

__all__ = [
    "ActivationSource",
    "Activations",
    "BatchFailed",
    "BatchHooks",
    "ENGINE_MEMBERS",
    "Engine",
    "EngineBase",
    "EngineClosed",
    "EngineConfig",
    "Generates",
    "PROVENANCE",
    "ReplayRequest",
    "TraceResult",
    "check_engine",
    "engine_identity",
    "missing_members",
    "protocol_members",
    "supports",
]


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
            raise ValueError(
                f"device {str(device)!r} is not available on this machine "
                f"(torch.{device.type}.is_available() is False)"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device {str(device)!r} does not exist: this machine has "
                f"{count} {device.type} device(s)"
            )


class EngineBase(ABC):
    """Shared plumbing: every :class:`Engine` member but ``run``.

    Subclasses implement ``run`` and set the provenance ``name``, ``model_label``,
    ``engine_path``, ``dtype``, ``device``, ``batch_size``, ``top_k`` (the annotated
    attributes without a value here, :data:`PROVENANCE`; :func:`check_engine` names those
    missing), and where they differ from the defaults ``deterministic``, ``max_model_len``,
    ``tokenizer_source`` and ``lm``; ``can_generate`` is True when the class overrides
    ``generate``.
    They may extend :meth:`settings` and :meth:`stats`, and override ``generate`` and
    ``activations`` where they can (:mod:`~trace_replay.engines.capabilities`; an engine
    that calls ``on_batch`` declares it, :class:`BatchHooks`). ``vocab_size`` and ``weights_digest`` read ``lm``;
    engines whose model is elsewhere override them.

    Once ``close`` has run, ``run``, ``generate``, ``weights_digest`` and ``activations``
    raise :class:`EngineClosed`, in every subclass: each class's own ``close`` and those
    methods are wrapped when the class is defined, so no engine repeats the check.
    """

    name: str = "engine"
    model_label: str
    engine_path: str
    dtype: str | None  # None: not known here (a server does not report its own)
    device: str | None
    batch_size: int
    top_k: int
    deterministic: bool = False
    max_model_len: int | None = None
    selected_by: str | None = None  # set by make_engine("auto", ...): how the choice was made
    # the model in this process (None: elsewhere, closed): a transformers model, or any
    # torch.nn.Module with its get_output_embeddings(), read duck-typed (hence Any)
    lm: Any = None
    tokenizer_source: Any = None  # what models.load_tokenizer reads (None: the embedded model)
    _tokenizer: Any = None
    _weights_seen: tuple[bytes, str] | None = None  # (glance, digest): see weights_digest
    _closed: bool = False  # set by close(); then closing.NEEDS_OPEN methods raise EngineClosed

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard_class(cls)

    @abstractmethod
    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Score ``requests``; one result each, in the order given (see :class:`Engine`)."""

    @property
    def can_generate(self) -> bool:
        """Whether ``generate`` works (:class:`Generates`): whether the class overrides it."""
        return supports(type(self), Generates)

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

    @refused_when_closed
    def weights_digest(self) -> str | None:
        """A digest of the weights the engine scores with, read now; ``None`` where the
        engine cannot read them (a server). A checkpoint keys on it, so rows computed with
        other weights under the same model name are never served; every replay records it.

        For a model in memory (``lm``): per parameter, its name, shape, dtype, float64 sum
        and sum of squares, and the exact bytes of a strided sample of 1,024 elements — one
        pass over the weights on their device, changed by any edit short of a contrived one.
        That pass takes seconds on a CPU (float64 sums of 135M float32 weights), so its
        digest is kept while a glance at the weights stays the same: per parameter its
        storage, its count of in-place edits and a sample
        (:func:`~trace_replay.engines.identity.glance`).
        """
        if self.lm is None:
            return None
        seen = glance(self.lm)
        if self._weights_seen is None or self._weights_seen[0] != seen:
            self._weights_seen = (seen, self._read_weights())
        return self._weights_seen[1]

    def _read_weights(self) -> str:
        """:meth:`weights_digest`'s full pass over ``lm``'s parameters."""
        return read_weights(self.lm)

    @refused_when_closed
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        eos_token_id: int | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Free generation, ``(token_ids, raw logprobs)`` per prompt; only where
        ``can_generate`` (this default raises NotImplementedError)."""
        raise NotImplementedError(f"engine {self.name!r} cannot generate (can_generate is False)")

    generate._refuses = True  # type: ignore[attr-defined]  # not Generates (supports())

    @refused_when_closed
    def activations(self) -> Activations:
        """Where this engine's forwards can be watched (:class:`Activations`); this default
        raises NotImplementedError: the model runs outside this process."""
        raise NotImplementedError(
            f"engine {self.name!r} runs its model outside this process: "
            "its activations cannot be read (layer attribution runs "
            "engines that are an ActivationSource)"
        )

    activations._refuses = True  # type: ignore[attr-defined]  # not an ActivationSource

    def settings(self) -> dict[str, Any]:
        settings = {
            "engine": self.name,
            "engine_path": self.engine_path,
            "model": self.model_label,
            "dtype": self.dtype,
            "device": self.device,
            "batch_size": self.batch_size,
            "top_k": self.top_k,
            "deterministic": self.deterministic,
        }
        if self.selected_by is not None:
            settings["selected_by"] = self.selected_by
        return settings

    def stats(self) -> dict[str, Any]:
        return {}

    @marking_closed  # noqa: B027 (a default: an engine that holds nothing needs no close)
    def close(self) -> None:
        """Release what the engine holds; a closed engine cannot run again
        (:class:`EngineClosed`)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine_path}, {self.dtype}, {self.device})"


# what a subclass of EngineBase sets itself: the annotated attributes without a value there
PROVENANCE = tuple(
    name
    for name in EngineBase.__annotations__
    if not hasattr(EngineBase, name) and not name.startswith("_")
)

# every member of the core protocol, attributes and methods (what check_engine asks for)
ENGINE_MEMBERS = protocol_members(Engine, ("__enter__", "__exit__"))


def check_engine(engine: Any) -> None:
    """Raise TypeError naming the :class:`Engine` members ``engine`` lacks (none: it is one).

    Members are looked up as :func:`missing_members` does: the ``tokenizer`` property is not
    evaluated, and an object that forwards attributes to a wrapped engine passes.
    """
    wanted = ENGINE_MEMBERS + (PROVENANCE if isinstance(engine, EngineBase) else ())
    missing = missing_members(engine, wanted)
    if missing:
        raise TypeError(
            f"{type(engine).__name__} is not an Engine: it lacks "
            f"{', '.join(missing)} (subclass trace_replay.engines.base.EngineBase, "
            "which gives all but run and the provenance attributes)"
        )
