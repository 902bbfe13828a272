"""``replay``: a dataset of traces through an engine, one tidy DataFrame back."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

import pandas as pd
import torch
from tqdm.auto import tqdm

from trace_replay.engines import ENGINES
from trace_replay.engines.base import Engine, ReplayRequest, check_engine, engine_identity
from trace_replay.engines.moving_weights import MovingWeights
from trace_replay.runs.checkpoint import Checkpoint
from trace_replay.runs.cluster import RayCluster, as_cluster
from trace_replay.runs.frame import TokenDecoder, run_checked
from trace_replay.runs.kept_engines import kept_engine
from trace_replay.runs.stages import (
    ReplayOptions,
    finish_frame,
    package_versions,
    prepare_requests,
    prepare_run,
    resuming_message,
    run_attrs,
)
from trace_replay.runs.weights_watch import WeightsWatch
from trace_replay.traces.sets import TraceError, TraceSet, load_traces
from trace_replay.traces.trace import FIELDS
from trace_replay.wording import plural

# what load_traces reads: a path, a TraceSet, a DataFrame, a Dataset, or records
TraceInput: TypeAlias = str | os.PathLike | TraceSet | pd.DataFrame | Iterable[Mapping[str, Any]]
# None (the embedded model), a local folder, a cached model name, or a loaded nn.Module
ModelArg: TypeAlias = str | os.PathLike | torch.nn.Module | None

__all__ = [
    "ReplayOptions",
    "replay",
    "replay_with",
    "prepare_requests",
    "prepare_run",
    "finish_frame",
    "run_attrs",
    "resuming_message",
    "package_versions",
]


def _traces_digest(traces: TraceSet) -> str:
    """A digest of every field of every trace, whatever their order."""
    each = sorted(
        hashlib.sha256(
            json.dumps([getattr(trace, name) for name in FIELDS], sort_keys=True).encode()
        ).digest()
        for trace in traces
    )
    return hashlib.sha256(b"".join(each)).hexdigest()[:32]


def replay(
    traces: TraceInput,
    model: ModelArg = None,
    *,
    engine: str | Engine = "auto",
    top_k: int = 5,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    batch_size: int | None = None,
    speculative: dict[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    progress: bool = True,
    checkpoint: str | os.PathLike | None = None,
    shard: tuple[int, int] | None = None,
    truncate: bool = False,
    chunk_size: int | None = None,
    checkpoint_every: float = 10.0,
    deterministic: bool = False,
    verbose: bool = False,
    cluster: str | RayCluster | None = None,
) -> pd.DataFrame:
    """Replay every trace through a model's decode path and score each trace token.

    At each decode step the engine computes its normal next-token distribution, the emitted
    token is overwritten with ``trace[step]`` (``TraceReplayState``), and logprob, rank,
    top-k and entropy are read from the unmodified logits of that step. An EOS inside a trace
    never stops the replay; the replay stops exactly at the end of the trace.

    Parameters
    ----------
    traces
        Anything :func:`trace_replay.load_traces` reads (path, DataFrame, list of dicts,
        ``TraceSet``…). Text fields are tokenized with the model's tokenizer.
    model
        ``None`` for the embedded SmolLM2-135M-Instruct, a local folder, or a model name in
        the local Hugging Face cache. With ``"vllm-server"`` the server runs its own model and
        ``model`` only names its tokenizer (``None``: the server's folder, when it is here).
    engine
        ``"auto"``, ``"vllm"``, ``"torch"``, ``"prefill"``, ``"vllm-server"`` (a running vLLM
        server, see ``engine_args``), or an :class:`~trace_replay.engines.Engine` built
        earlier with :func:`~trace_replay.engines.make_engine`; its own settings (model,
        dtype, batch size, top-k) then apply, the arguments that configure an engine are not
        used, and replay never closes it. A name starts an engine the first time and keeps
        it for later calls with the same name, model and settings in this process (a
        warning says so once; :func:`~trace_replay.close_engines` releases kept engines,
        exit closes them; ``vllm-server`` and ``nn.Module`` models are built per call:
        :mod:`~trace_replay.runs.kept_engines`). An engine of your own must have every member of
        the protocol (a TypeError names those it lacks); subclass
        :class:`~trace_replay.engines.base.EngineBase` and write ``run``.
    top_k
        Alternatives recorded per step (``top_token_ids``, ``top_logprobs``, ``top_tokens``).
    dtype, device
        Weights' dtype (default float32) and device (default CUDA when available).
    batch_size
        Request slots (torch/prefill), ``max_num_seqs`` (vLLM), or requests in flight
        (vllm-server, default 32).
    speculative
        ``{"method": "trace" | "ngram", "num_tokens": k}``: the torch engine's verify path.
    engine_args
        Passed through to ``vllm.LLM`` (parallelism, memory, ``max_model_len``…). For
        ``"vllm-server"``: ``base_url`` (``"http://host:port/v1"``, required), ``api``
        (``"auto"``, ``"generate"``, ``"completions"``), ``api_key``, ``timeout_s``,
        ``max_retries``.
    progress
        Show a tqdm bar counting trace tokens as they are scored.
    checkpoint
        Folder for resumable runs: finished traces are written there as checksummed Parquet
        parts, and a rerun skips the traces whose tokens, ``ref_logprobs``, chat labels
        and engine settings are unchanged (and says how many). Runs sharing a folder split
        the traces between them.
    shard
        ``(index, count)``: replay only this deterministic slice (by hash of the trace id).
        A shard holding no trace gives an empty result, with a warning.
    truncate
        Cut traces that do not fit the engine's context instead of raising.
    chunk_size
        Traces handed to the engine at a time, and at most per checkpoint part (default
        4 x ``batch_size``).
    checkpoint_every
        With ``checkpoint``: seconds of compute after which finished traces are written,
        however few (engine calls shrink to whole batches to keep to it).
    deterministic
        Batch-invariant arithmetic (torch and prefill engines): every column of a trace's
        rows is the same bits whatever ``batch_size``, ``chunk_size``, ``shard``, the other
        traces, their order, and interruption and resume; decode replay and prefill then
        agree bitwise too. For vLLM, its batch-invariant mode where the platform has one
        (``df.attrs["deterministic_active"]`` says whether it ran). Recorded in ``df.attrs``.
    verbose
        Show the engine's own start-up logging (vLLM's); by default only its errors.
    cluster
        ``"ray"`` or a :class:`~trace_replay.runs.cluster.RayCluster`: replay on a Ray
        cluster, one engine per actor, each built from these arguments (``engine`` a
        name, ``model`` a folder or name every node reads); the actors write the
        ``checkpoint`` parts (default: a temporary folder). The same frame and attrs, plus
        ``attrs["cluster"]``. Needs the ``[ray]`` extra; see docs/cluster.md.

    Returns
    -------
    pandas.DataFrame
        One row per (trace, step): ``trace_id``, ``step``, ``position``, ``token_id``,
        ``token``, ``logprob``, ``rank``, ``top_token_ids``, ``top_logprobs``,
        ``top_tokens``, ``entropy`` and ``ref_logprob`` (NaN where the trace has none;
        dropped when no trace has one). When chat traces are replayed, ``turn`` (the index
        of the message a token belongs to, nullable) and ``role`` (``"assistant"``, the
        message's role for tokens of other turns, ``"template"`` for the chat template's
        own tokens around an assistant turn; null for non-chat traces). Through a server's
        completions API, ``rank_exact`` flags ranks that are only a lower bound.
        Provenance is in ``df.attrs``: the engine's settings, ``weights_digest`` (of the
        weights scored with, read at the start; ``None`` where the engine cannot read
        them), the trace set's ``traces_digest``, ``num_traces``, ``num_tokens``, package
        ``versions``, the shard and the run's times.

    Examples
    --------
    >>> import trace_replay as tr
    >>> df = tr.replay([{"id": "t", "prompt": "The capital of France is",
    ...                  "completion": " Paris."}], engine="torch", progress=False)
    >>> df[["step", "token", "rank"]].values.tolist()
    [[0, ' Paris', 1], [1, '.', 1]]
    """
    options = ReplayOptions(
        engine=engine,
        model=model,
        top_k=top_k,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        speculative=speculative,
        engine_args=engine_args,
        deterministic=deterministic,
        verbose=verbose,
        progress=progress,
        checkpoint=checkpoint,
        shard=shard,
        truncate=truncate,
        chunk_size=chunk_size,
        checkpoint_every=checkpoint_every,
        cluster=cluster,
    )
    return replay_with(traces, options)


def replay_with(traces: TraceInput, options: ReplayOptions) -> pd.DataFrame:
    """:func:`replay` with its options as one :class:`ReplayOptions` (the CLI's way in)."""
    cluster = None
    if options.cluster is not None:
        cluster = _cluster_run(options.cluster, options.engine, options.model)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    traceset = load_traces(traces)
    digest = _traces_digest(traceset)  # before sharding: every shard of the set shares it
    if not len(traceset):
        raise TraceError("no traces to replay", location=traceset.source)
    shard = options.shard
    if shard is not None:
        total, traceset = len(traceset), traceset.shard(*shard)
        if not len(traceset):
            warnings.warn(
                f"shard {shard[0]}/{shard[1]} holds none of the "
                f"{plural(total, 'trace')} of "
                f"{traceset.source}: its result is empty on purpose",
                stacklevel=3,
            )
    if cluster is not None:
        from trace_replay.runs.cluster_replay import replay_on_ray

        return replay_on_ray(
            traceset,
            cluster,
            {"name": options.engine, "model": options.model, **options.engine_settings()},
            progress=options.progress,
            checkpoint=options.checkpoint,
            shard=shard,
            truncate=options.truncate,
            chunk_size=options.chunk_size,
            checkpoint_every=options.checkpoint_every,
            started=started,
            digest=digest,
        )
    if isinstance(options.engine, str):  # started once per process, reused by later calls
        with kept_engine(options.engine, options.model, **options.engine_settings()) as engine_obj:
            return _replay(traceset, engine_obj, options, started=started, digest=digest)
    _check_engine_object(options)
    return _replay(traceset, options.engine, options, started=started, digest=digest)


def _check_engine_object(options: ReplayOptions) -> None:
    """Refuse an engine object that is not an Engine, or given options that configure one."""
    engine = options.engine
    try:
        check_engine(engine)
    except TypeError as error:
        raise TypeError(
            f"engine must be a name ({', '.join(ENGINES)}) or an Engine: {error}"
        ) from None
    given = options.engine_settings_given()
    if given:
        names = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        verb, them = ("configures", "it") if len(given) == 1 else ("configure", "them")
        raise ValueError(
            f"{names} {verb} an engine; an engine object was passed, so give "
            f"{them} to make_engine instead"
        )
    if options.deterministic and not engine.settings().get("deterministic"):
        raise ValueError(
            "deterministic=True, but the engine passed was built without it; "
            "build it with make_engine(..., deterministic=True)"
        )


def _cluster_run(cluster: Any, engine: Any, model: Any) -> RayCluster:
    """The cluster a run asks for; refused when its engine cannot be built on each actor."""
    cluster = as_cluster(cluster)
    if not isinstance(engine, str):
        raise ValueError(
            "a cluster run builds one engine per actor: pass engine as a name "
            f"({', '.join(ENGINES)}), not an engine object"
        )
    if isinstance(model, torch.nn.Module):
        raise ValueError(
            "a cluster run loads the model on each actor: pass model as a "
            "folder or model name every node can read, not a loaded module"
        )
    return cluster


class _Calls:
    """One replay's engine calls: each checked and made rows, the bar moved as tokens are
    scored (and caught up where an engine reported fewer)."""

    def __init__(
        self, engine: Engine, by_id: dict, decode: TokenDecoder, limits: dict, bar: tqdm
    ) -> None:
        self.engine, self.by_id, self.decode, self.limits, self.bar = (
            engine,
            by_id,
            decode,
            limits,
            bar,
        )
        self.counted = 0  # tokens shown so far (bar.n stays 0 when the bar is disabled)

    def advance(self, tokens: int) -> None:
        self.counted += tokens
        self.bar.update(tokens)

    def catch_up(self, target: int) -> None:
        self.advance(max(target - self.counted, 0))

    def run(
        self, group: list[ReplayRequest], keep: Callable[[pd.DataFrame], None] | None = None
    ) -> pd.DataFrame:
        target = self.counted + sum(r.trace_len for r in group)
        frame = run_checked(
            self.engine,
            group,
            self.by_id,
            self.decode,
            limits=self.limits,
            on_tokens=self.advance,
            keep=keep,
        )
        self.catch_up(target)
        return frame


def _replay(
    traceset: TraceSet, engine: Engine, options: ReplayOptions, *, started: str, digest: str
) -> pd.DataFrame:
    # with the weights' digest, read once: merge and checkpoints refuse other weights
    settings = engine_identity(engine)
    vocab_size = engine.vocab_size
    tokenizer = engine.tokenizer
    traceset, requests, cut_notes = prepare_run(
        traceset,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_model_len=engine.max_model_len,
        top_k=settings.get("top_k", 0),
        truncate=options.truncate,
    )
    decode = TokenDecoder(tokenizer)
    chunk = options.chunk_size or max(engine.batch_size, 1) * 4
    limits = {"top_k": settings.get("top_k"), "vocab_size": vocab_size}
    # an engine whose weights can change under it (a server) is read again before rows
    # are kept: after each engine call, or before each checkpoint part
    watch = None
    if isinstance(engine, MovingWeights) and engine.weights_can_change is True:
        watch = WeightsWatch(
            engine,
            settings.get("weights_digest"),
            kept_in=f"checkpoint {options.checkpoint}" if options.checkpoint else None,
        )
    with tqdm(
        total=sum(r.trace_len for r in requests),
        unit="tok",
        disable=not options.progress,
        desc=f"replay[{engine.name}]",
    ) as bar:
        calls = _Calls(engine, {t.id: t for t in traceset}, decode, limits, bar)
        if options.checkpoint is None:
            result, resumed = _in_memory(calls, requests, chunk, watch), 0
        else:
            result, resumed = _checkpointed(
                calls, requests, settings, options, chunk=chunk, vocab_size=vocab_size, watch=watch
            )
    result = finish_frame(result, traceset, decode)
    result.attrs = run_attrs(
        settings,
        engine.stats(),
        traceset=traceset,
        requests=requests,
        num_tokens=len(result),
        vocab_size=vocab_size,
        resumed=resumed,
        notes=cut_notes,
        shard=options.shard,
        digest=digest,
        started=started,
    )
    return result


def _in_memory(
    calls: _Calls, requests: list[ReplayRequest], chunk: int, watch: WeightsWatch | None
) -> pd.DataFrame | None:
    """Without a checkpoint: ``chunk`` traces per engine call, every frame kept in memory."""
    frames = []
    for start in range(0, len(requests), chunk):
        frames.append(calls.run(requests[start : start + chunk]))
        if watch is not None:
            watch.check([r.trace_id for r in requests[start : start + chunk]])
    return pd.concat(frames, ignore_index=True) if frames else None


def _checkpointed(
    calls: _Calls,
    requests: list[ReplayRequest],
    settings: dict[str, Any],
    options: ReplayOptions,
    *,
    chunk: int,
    vocab_size: int | None,
    watch: WeightsWatch | None,
) -> tuple[pd.DataFrame | None, int]:
    """With a checkpoint: traces claimed from the folder a part at a time, each part written
    as it finishes; the rows read back from the folder (runs sharing it included). Returns
    them and the traces served from the folder."""
    assert options.checkpoint is not None  # the caller's choice of this path
    total = sum(r.trace_len for r in requests)
    with Checkpoint(
        options.checkpoint,
        settings,
        requests,
        calls.by_id,
        batch_size=max(calls.engine.batch_size, 1),
        max_traces=chunk,
        every_s=options.checkpoint_every,
        vocab_size=vocab_size,
        verify=None if watch is None else watch.check,
    ) as store:
        calls.advance(store.resumed_tokens)
        if store.resumed and options.progress:
            calls.bar.write(
                resuming_message(options.checkpoint, store, len(requests)), file=sys.stderr
            )
        result = None
        while result is None:
            group = store.claim()
            if group:
                store.add(calls.run(group, keep=store.add))
            elif not store.waiting():  # other runs hold claims on our traces: wait
                result = store.read()  # None: a part failed verification, go on
        calls.catch_up(total)  # traces other runs sharing it replayed
    return result, store.resumed
