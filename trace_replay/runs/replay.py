"""``replay``: a dataset of traces through an engine, one tidy DataFrame back."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from trace_replay.wording import plural
from trace_replay.runs.checkpoint import Checkpoint
from trace_replay.runs.kept_engines import kept_engine
from trace_replay.engines import ENGINES
from trace_replay.engines.base import Engine, ReplayRequest, check_engine, engine_identity
from trace_replay.engines.moving_weights import MovingWeights
from trace_replay.runs.cluster import RayCluster, as_cluster
from trace_replay.runs.frame import TokenDecoder, run_checked
from trace_replay.runs.stages import (finish_frame, package_versions, prepare_requests,
                                  prepare_run, resuming_message, run_attrs)
from trace_replay.runs.weights_watch import WeightsWatch
from trace_replay.traces.trace import FIELDS
from trace_replay.traces.sets import TraceError, TraceSet, load_traces

# what load_traces reads: a path, a TraceSet, a DataFrame, a Dataset, or records
TraceInput = str | os.PathLike | TraceSet | pd.DataFrame | Iterable[Mapping[str, Any]]
# None (the embedded model), a local folder, a cached model name, or a loaded nn.Module
ModelArg = str | os.PathLike | torch.nn.Module | None

__all__ = ["replay", "prepare_requests", "prepare_run", "finish_frame", "run_attrs",
           "resuming_message", "package_versions"]


def _traces_digest(traces: TraceSet) -> str:
    """A digest of every field of every trace, whatever their order."""
    each = sorted(hashlib.sha256(json.dumps([getattr(trace, name) for name in FIELDS],
                                            sort_keys=True).encode()).digest()
                  for trace in traces)
    return hashlib.sha256(b"".join(each)).hexdigest()[:32]


def replay(traces: TraceInput, model: ModelArg = None, *, engine: str | Engine = "auto",
           top_k: int = 5, dtype: str | torch.dtype | None = None,
           device: str | torch.device | None = None, batch_size: int | None = None,
           speculative: dict[str, Any] | None = None, engine_args: dict[str, Any] | None = None,
           progress: bool = True, checkpoint: str | os.PathLike | None = None,
           shard: tuple[int, int] | None = None, truncate: bool = False,
           chunk_size: int | None = None, checkpoint_every: float = 10.0,
           deterministic: bool = False, verbose: bool = False,
           cluster: str | RayCluster | None = None) -> pd.DataFrame:
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
    _check_arguments(shard=shard, chunk_size=chunk_size, checkpoint_every=checkpoint_every,
                     truncate=truncate, progress=progress, checkpoint=checkpoint)
    if cluster is not None:
        cluster = _cluster_run(cluster, engine, model)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    traceset = load_traces(traces)
    digest = _traces_digest(traceset)  # before sharding: every shard of the set shares it
    if not len(traceset):
        raise TraceError("no traces to replay", location=traceset.source)
    if shard is not None:
        total, traceset = len(traceset), traceset.shard(*shard)
        if not len(traceset):
            warnings.warn(f"shard {shard[0]}/{shard[1]} holds none of the "
                          f"{plural(total, 'trace')} of "
                          f"{traceset.source}: its result is empty on purpose", stacklevel=2)
    if cluster is not None:
        from trace_replay.runs.cluster_replay import replay_on_ray

        options = {"name": engine, "model": model, "dtype": dtype, "device": device,
                   "batch_size": batch_size, "top_k": top_k, "speculative": speculative,
                   "engine_args": engine_args, "deterministic": deterministic,
                   "verbose": verbose}
        return replay_on_ray(traceset, cluster, options, progress=progress,
                             checkpoint=checkpoint, shard=shard, truncate=truncate,
                             chunk_size=chunk_size, checkpoint_every=checkpoint_every,
                             started=started, digest=digest)
    if isinstance(engine, str):  # started once per process, reused by later calls
        with kept_engine(engine, model, dtype=dtype, device=device, batch_size=batch_size,
                         top_k=top_k, speculative=speculative, engine_args=engine_args,
                         deterministic=deterministic, verbose=verbose) as engine_obj:
            return _replay(traceset, engine_obj, progress=progress, checkpoint=checkpoint,
                           shard=shard, truncate=truncate, chunk_size=chunk_size,
                           checkpoint_every=checkpoint_every, started=started, digest=digest)
    try:
        check_engine(engine)
    except TypeError as error:
        raise TypeError(f"engine must be a name ({', '.join(ENGINES)}) or an Engine: "
                        f"{error}") from None
    given = {"model": model, "dtype": dtype, "device": device, "batch_size": batch_size,
             "speculative": speculative, "engine_args": engine_args}
    given = sorted(name for name, value in given.items() if value is not None)
    if top_k != 5:
        given.append("top_k")
    if verbose:
        given.append("verbose")
    if given:
        names = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        verb, them = ("configures", "it") if len(given) == 1 else ("configure", "them")
        raise ValueError(f"{names} {verb} an engine; an engine object was passed, so give "
                         f"{them} to make_engine instead")
    if deterministic and not engine.settings().get("deterministic"):
        raise ValueError("deterministic=True, but the engine passed was built without it; "
                         "build it with make_engine(..., deterministic=True)")
    return _replay(traceset, engine, progress=progress, checkpoint=checkpoint, shard=shard,
                   truncate=truncate, chunk_size=chunk_size, checkpoint_every=checkpoint_every,
                   started=started, digest=digest)


def _check_arguments(*, shard: Any, chunk_size: Any, checkpoint_every: Any, truncate: Any,
                     progress: Any, checkpoint: Any) -> None:
    """Refuse a bad argument before anything is loaded (engine settings: EngineConfig)."""
    if shard is not None:
        if (not isinstance(shard, (tuple, list)) or len(shard) != 2
                or not all(_is_int(x) for x in shard) or not 0 <= shard[0] < shard[1]):
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    if (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, float))
            or not checkpoint_every >= 0):
        raise ValueError(f"checkpoint_every must be seconds >= 0, got {checkpoint_every!r}")
    for name, value in (("truncate", truncate), ("progress", progress)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        raise ValueError(f"checkpoint must be a folder path, got {type(checkpoint).__name__}")


def _cluster_run(cluster: Any, engine: Any, model: Any) -> RayCluster:
    """The cluster a run asks for; refused when its engine cannot be built on each actor."""
    cluster = as_cluster(cluster)
    if not isinstance(engine, str):
        raise ValueError("a cluster run builds one engine per actor: pass engine as a name "
                         f"({', '.join(ENGINES)}), not an engine object")
    if isinstance(model, torch.nn.Module):
        raise ValueError("a cluster run loads the model on each actor: pass model as a "
                         "folder or model name every node can read, not a loaded module")
    return cluster


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _replay(traceset: TraceSet, engine: Engine, *, progress: bool,
            checkpoint: str | os.PathLike | None, shard: tuple[int, int] | None,
            truncate: bool, chunk_size: int | None, checkpoint_every: float,
            started: str, digest: str) -> pd.DataFrame:
    # with the weights' digest, read once: merge and checkpoints refuse other weights
    settings = engine_identity(engine)
    vocab_size = engine.vocab_size
    tokenizer = engine.tokenizer
    traceset, requests, cut_notes = prepare_run(
        traceset, tokenizer=tokenizer, vocab_size=vocab_size,
        max_model_len=engine.max_model_len, top_k=settings.get("top_k", 0), truncate=truncate)
    by_id = {t.id: t for t in traceset}
    decode = TokenDecoder(tokenizer)
    batch = max(engine.batch_size, 1)
    chunk = chunk_size or batch * 4
    resumed = 0
    total = sum(r.trace_len for r in requests)
    with tqdm(total=total, unit="tok", disable=not progress,
              desc=f"replay[{engine.name}]") as bar:
        counted = 0  # tokens shown so far (bar.n stays 0 when the bar is disabled)

        def advance(tokens: int) -> None:
            nonlocal counted
            counted += tokens
            bar.update(tokens)

        limits = {"top_k": settings.get("top_k"), "vocab_size": vocab_size}

        def run(group: list[ReplayRequest],
                keep: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
            target = counted + sum(r.trace_len for r in group)
            frame = run_checked(engine, group, by_id, decode, limits=limits,
                                on_tokens=advance, keep=keep)
            advance(max(target - counted, 0))  # an engine that reported fewer catches up
            return frame

        # an engine whose weights can change under it (a server) is read again before rows
        # are kept: after each engine call, or before each checkpoint part
        watch = None
        if isinstance(engine, MovingWeights) and engine.weights_can_change is True:
            watch = WeightsWatch(engine, settings.get("weights_digest"),
                                 kept_in=checkpoint and f"checkpoint {checkpoint}")
        if checkpoint is None:
            frames = []
            for start in range(0, len(requests), chunk):
                frames.append(run(requests[start:start + chunk]))
                if watch is not None:
                    watch.check([r.trace_id for r in requests[start:start + chunk]])
            result = pd.concat(frames, ignore_index=True) if frames else None
        else:
            with Checkpoint(checkpoint, settings, requests, by_id,
                            batch_size=batch, max_traces=chunk, every_s=checkpoint_every,
                            vocab_size=vocab_size,
                            verify=None if watch is None else watch.check) as store:
                resumed = store.resumed
                advance(store.resumed_tokens)
                if resumed and progress:
                    bar.write(resuming_message(checkpoint, store, len(requests)),
                              file=sys.stderr)
                result = None
                while result is None:
                    group = store.claim()
                    if group:
                        store.add(run(group, keep=store.add))
                    elif not store.waiting():  # other runs hold claims on our traces: wait
                        result = store.read()  # None: a part failed verification, go on
                advance(max(total - counted, 0))  # traces other runs sharing it replayed
    result = finish_frame(result, traceset, decode)
    result.attrs = run_attrs(settings, engine.stats(), traceset=traceset, requests=requests,
                             num_tokens=len(result), vocab_size=vocab_size, resumed=resumed,
                             notes=cut_notes, shard=shard, digest=digest, started=started)
    return result

