"""The engine interface: what every engine takes, does and gives back.

An engine is built once (it holds a loaded model), replays batches of
:class:`ReplayRequest` into :class:`TraceResult` s, and says what it is (``settings``, the
provenance recorded in ``df.attrs``) apart from what it has done so far (``stats``).
:func:`trace_replay.runs.replay` calls nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["Engine", "EngineBase", "EngineConfig", "Generator", "ReplayRequest", "TraceResult"]


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


@runtime_checkable
class Engine(Protocol):
    """What :func:`trace_replay.runs.replay` needs from an engine.

    ``run`` keeps the order of its requests and calls ``on_tokens(n)`` as ``n`` more trace
    tokens are scored (at least once per batch, so progress moves within a batch);
    ``tokenizer`` is the model's (text traces are
    tokenized with it). ``settings`` is fixed once the engine is built
    (two runs with equal settings are comparable); ``stats`` accumulates over ``run`` calls.
    ``close`` releases the model and any worker processes; engines are context managers.
    """

    name: str
    max_model_len: int | None
    tokenizer: Any

    def settings(self) -> dict[str, Any]: ...

    def run(self, requests: Sequence[ReplayRequest], *,
            on_tokens: Callable[[int], None] | None = None) -> list[TraceResult]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc_info: object) -> None: ...


@runtime_checkable
class Generator(Protocol):
    """Engines that can also generate freely (used by :func:`trace_replay.traces.recording`)."""

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                 temperature: float = 0.0, seed: int = 0,
                 eos_token_id: int | None = None) -> list[tuple[list[int], list[float]]]: ...


class EngineBase:
    """Shared plumbing: the common settings, an empty ``stats``, ``close`` and ``with``.

    Subclasses set ``name``, ``model_label``, ``engine_path``, ``dtype``, ``device``,
    ``batch_size``, ``top_k``, ``deterministic``, ``max_model_len`` and
    ``tokenizer_source``, and may extend :meth:`settings`.
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
    # called with each batch's requests, in row order, before that batch's forwards; forward
    # hooks (trace_replay.analysis.capture) use it to map batch rows to traces
    on_batch: Callable[[Sequence[ReplayRequest]], None] | None = None
    tokenizer_source: Any = None  # what models.load_tokenizer reads (None: the embedded model)
    _tokenizer: Any = None

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
        """Logits per step, the bound of ``rank``: a loaded model's (``lm`` or vLLM's
        ``llm``) output size; ``None`` where the engine does not know it."""
        head = getattr(getattr(self, "lm", None), "get_output_embeddings", lambda: None)()
        if getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
        llm = getattr(self, "llm", None)
        return None if llm is None else int(llm.llm_engine.model_config.get_vocab_size())

    def weights_digest(self) -> str | None:
        """A digest of the weights the engine scores with, read now; ``None`` where the
        engine cannot read them (a server). A checkpoint keys on it, so rows computed with
        other weights under the same model name are never served.

        For a model in memory (``lm``): per parameter, its name, shape, dtype, float64 sum
        and sum of squares, and the exact bytes of a strided sample of 1,024 elements — one
        pass over the weights on their device, changed by any edit short of a contrived one.
        """
        lm = getattr(self, "lm", None)
        if not isinstance(lm, torch.nn.Module):
            return None
        digest = hashlib.sha256()
        with torch.no_grad():
            for name, weight in lm.named_parameters():
                flat = weight.detach().reshape(-1)
                sample = flat[::max(1, flat.numel() // 1024)][:1024]
                sums = torch.stack([flat.sum(dtype=torch.float64),
                                    flat.double().square().sum()]).cpu().numpy()
                digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype}".encode())
                digest.update(sums.tobytes())
                digest.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:32]

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

    def close(self) -> None:
        """Release what the engine holds; a closed engine cannot run again."""

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine_path}, {self.dtype}, {self.device})"
