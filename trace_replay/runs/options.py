"""What a replay is asked to do besides its traces: one frozen, validated record.

:func:`~trace_replay.runs.replay` builds a :class:`ReplayOptions` from its keywords (the CLI
builds one from its flags), and every path reads it: an engine started by name, the
in-memory and checkpointed loops, and a cluster run's actors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ReplayOptions"]


@dataclass(frozen=True)
class ReplayOptions:
    """``replay``'s options (see :func:`~trace_replay.runs.replay` for each), checked when
    made, before anything is loaded (an engine's own settings: its ``EngineConfig``)."""

    engine: Any = "auto"  # a registered name, or an Engine built earlier
    model: Any = None
    top_k: int = 5
    dtype: Any = None
    device: Any = None
    batch_size: int | None = None
    speculative: dict[str, Any] | None = None
    engine_args: dict[str, Any] | None = None
    deterministic: bool = False
    verbose: bool = False
    progress: bool = True
    checkpoint: str | os.PathLike | None = None
    shard: tuple[int, int] | None = None
    truncate: bool = False
    chunk_size: int | None = None
    checkpoint_every: float = 10.0
    cluster: Any = None  # "ray", a RayCluster, or None

    def __post_init__(self) -> None:
        shard, chunk_size, every = self.shard, self.chunk_size, self.checkpoint_every
        if shard is not None and (not isinstance(shard, (tuple, list)) or len(shard) != 2
                                  or not all(_is_int(x) for x in shard)
                                  or not 0 <= shard[0] < shard[1]):
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
        if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0:
            raise ValueError(f"checkpoint_every must be seconds >= 0, got {every!r}")
        for name in ("truncate", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, (str, os.PathLike)):
            raise ValueError(f"checkpoint must be a folder path, got "
                             f"{type(self.checkpoint).__name__}")

    def engine_settings(self) -> dict[str, Any]:
        """``make_engine``'s keywords beyond the name and model: what starts an engine by
        name here or on each actor of a cluster."""
        return {"dtype": self.dtype, "device": self.device, "batch_size": self.batch_size,
                "top_k": self.top_k, "speculative": self.speculative,
                "engine_args": self.engine_args, "deterministic": self.deterministic,
                "verbose": self.verbose}

    def engine_settings_given(self) -> list[str]:
        """The options that configure an engine set away from their defaults, by name (an
        engine object passed in takes none of them)."""
        default = ReplayOptions()
        given = sorted(name for name in ("model", "dtype", "device", "batch_size",
                                         "speculative", "engine_args")
                       if getattr(self, name) is not None)
        return given + [name for name in ("top_k", "verbose")
                        if getattr(self, name) != getattr(default, name)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
