"""The engines by name: one :class:`EngineSpec` each, the one place that lists them.

:func:`~trace_replay.engines.make_engine` builds an engine from its spec, and every caller
that takes an engine by name reads the spec instead of a list of names of its own: the
CLI's choices and help, ``record`` (engines that generate), layer attribution (engines whose
forwards run in this process), :class:`~trace_replay.engines.cache.ModelCache` (engines
handed a loaded model) and the engines ``replay`` keeps. Adding an engine is its folder and
one :func:`register_engine` call (here for the package's own; anywhere for a user's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENGINES",
    "ENGINE_OPTIONS",
    "EngineSpec",
    "engine_spec",
    "engine_specs",
    "register_engine",
    "unregister_engine",
]


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its name, where its factory lives, its options and what it can do.

    The factory is called as ``factory(config, **options)`` (and ``verbose=`` where
    ``verbose`` is True) with an :class:`~trace_replay.engines.base.EngineConfig`, and returns
    an :class:`~trace_replay.engines.protocol.Engine`. A ``"module:attribute"`` string is
    imported only when the engine is built, so naming an engine imports nothing heavy.
    """

    name: str
    factory: str | Callable[..., Any]  # "package.module:Class", or the callable itself
    summary: str  # one line: the CLI's help, docs
    options: tuple[str, ...] | None = ()  # keyword options beyond EngineConfig; None: all
    verbose: bool = False  # the factory takes verbose= (its start-up logging)
    generates: bool = False  # capabilities.Generates: record can use it
    activations: bool = False  # ActivationSource and BatchHooks: layer attribution can
    loaded_model: bool = True  # takes a model loaded in this process (else loads a path)
    kept: bool = True  # replay keeps it when started by name (runs/kept_engines.py)
    needs: str = ""  # what it cannot start without, beyond a model (the demo says so)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an engine's name is a non-empty str, got {self.name!r}")
        if isinstance(self.factory, str) and ":" not in self.factory:
            raise ValueError(
                f"engine {self.name!r}: factory {self.factory!r} is not 'module:attribute'"
            )

    def takes(self) -> tuple[str, ...]:
        """The keyword options this engine takes beyond the config (``None``: every
        registered engine's, for an engine that builds another)."""
        if self.options is not None:
            return self.options
        found = (o for spec in _SPECS.values() if spec.options for o in spec.options)
        return tuple(dict.fromkeys(found))

    def load(self) -> Callable[..., Any]:
        """The factory, imported now where it is named by a string."""
        if not isinstance(self.factory, str):
            return self.factory
        module, _, attribute = self.factory.partition(":")
        return getattr(importlib.import_module(module), attribute)


_SPECS: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec, *, replace: bool = False) -> EngineSpec:
    """Add ``spec`` under its name (refused where the name is taken, unless ``replace``)."""
    if spec.name in _SPECS and not replace:
        raise ValueError(f"engine {spec.name!r} is registered already (replace=True to swap it)")
    _SPECS[spec.name] = spec
    return spec


def unregister_engine(name: str) -> EngineSpec:
    """Remove the engine ``name`` and return its spec."""
    return _SPECS.pop(engine_spec(name).name)


def engine_spec(name: str) -> EngineSpec:
    """The spec of ``name``; ValueError naming every registered engine if there is none."""
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(_SPECS)}")
    return spec


def engine_specs() -> tuple[EngineSpec, ...]:
    """Every registered engine, in registration order."""
    return tuple(_SPECS.values())


class _Names(Sequence):
    """The registered names, read at each use (a registration shows at once)."""

    def __getitem__(self, index: Any) -> Any:
        return tuple(_SPECS)[index]

    def __len__(self) -> int:
        return len(_SPECS)

    def __contains__(self, name: object) -> bool:
        return name in _SPECS

    def __repr__(self) -> str:
        return repr(tuple(_SPECS))


class _Options(Mapping):
    """Each registered engine's options, read at each use (an engine taking every
    engine's options is left out)."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        spec = _SPECS[name]
        if spec.options is None:
            raise KeyError(name)
        return spec.options

    def __iter__(self) -> Iterator[str]:
        return (name for name, spec in _SPECS.items() if spec.options is not None)

    def __len__(self) -> int:
        return sum(spec.options is not None for spec in _SPECS.values())


ENGINES: Sequence[str] = _Names()
ENGINE_OPTIONS: Mapping[str, tuple[str, ...]] = _Options()

register_engine(
    EngineSpec(
        "auto",
        "trace_replay.engines:_make_auto",
        "vLLM when it starts, else torch (with a warning saying why)",
        options=None,
        verbose=True,
        generates=True,
        loaded_model=False,
    )
)
register_engine(
    EngineSpec(
        "torch",
        "trace_replay.engines.builtin.engine:TorchEngine",
        "the built-in batched decode loop over a transformers model (CPU, CUDA)",
        options=(
            "speculative",
            "backend",
            "float32_matmul",
            "batch1_fusions",
            "deterministic_attention",
        ),
        generates=True,
        activations=True,
    )
)
register_engine(
    EngineSpec(
        "prefill",
        "trace_replay.engines.builtin.prefill:PrefillEngine",
        "teacher-forced scoring, one forward over prompt + trace",
        options=("deterministic_attention",),
        activations=True,
    )
)
register_engine(
    EngineSpec(
        "vllm",
        "trace_replay.engines.vllm:start_engine",
        "vLLM in this process: native trace replay or logits-processor forcing",
        options=("engine_args", "native"),
        verbose=True,
        generates=True,
        loaded_model=False,
    )
)
register_engine(
    EngineSpec(
        "vllm-server",
        "trace_replay.engines.server.engine:ServerEngine",
        "a running vLLM server over HTTP (trace-replay serve), --engine-arg base_url=...",
        options=("engine_args",),
        kept=False,
        needs="a server's base_url (--engine-arg base_url=http://HOST:PORT/v1)",
    )
)
