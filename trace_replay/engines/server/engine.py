"""Replay through a running vLLM server (``engine="vllm-server"``), over HTTP only.

The server forces traces one of two ways, found at start-up and recorded in
``settings()["server_forcing"]``: ``"native"``, a stock vLLM >= 0.29 started with
``--enable-trace-replay --enable-scale-out``, each request carrying its trace in
``SamplingParams.trace_decode_token_ids`` (:mod:`~trace_replay.engines.server.native`), or
``"logits-processor"``, the package's processor (``vllm serve --logits-processors`` with
:data:`~trace_replay.engines.vllm_contract.FORCING_PROCESSOR`, which ``trace-replay serve``
starts), each request carrying its trace in ``vllm_xargs``. Either way the prompt goes as
token ids and ``max_tokens`` = the trace length. Two of the server's APIs are used:

* ``"generate"`` — ``/inference/v1/generate`` (``vllm serve --enable-scale-out``), token ids in
  and out, each logprob with its exact rank;
* ``"completions"`` — ``/v1/completions``, on every vLLM server, with the processor only
  (its request has no field for a native trace). It returns logprobs but no
  rank: the rank is counted among the top 20 alternatives it returns, exact when it lists a
  token no more likely than the trace token (so every likelier one is listed) and else a
  lower bound, which the ``rank_exact`` column flags — also where a server returns fewer
  alternatives than asked for (:func:`~trace_replay.engines.server.responses.completion_steps`).

``"auto"`` takes generate when the server offers it. At start-up the engine checks that the
server's tokenizer encodes like the local one, how it forces traces (natively where it
returns a native probe, else through the processor: two one-token traces of different
tokens must both come back; neither is a ServerError saying how to start it), and that its
logprobs are raw (two forced tokens cannot both be likely); a server failing a check (an HTTP error, no answer, an answer that
cannot be read) is a :class:`~trace_replay.engines.server.http_client.ServerError` naming
its address. A checkpoint keys on the server's address and its scores of that probe
(:mod:`~trace_replay.engines.server.probe`), so rows computed against one server are never
served for another. This module never imports vllm.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import Any

import numpy as np
import torch

from trace_replay.engines.base import (
    BatchFailed,
    EngineBase,
    EngineConfig,
    ReplayRequest,
    TraceResult,
)
from trace_replay.engines.distributions import tail_from_top
from trace_replay.engines.server.http_client import JsonClient, ServerError
from trace_replay.engines.server.native import (
    NOT_OFFERED,
    TraceNotForced,
    engine_path,
    how_to_start,
    native_refusal,
    trace_field,
)
from trace_replay.engines.server.probe import PROBE_TEXT, Fingerprints, probe_requests
from trace_replay.engines.server.responses import (
    RANK_DEPTH,
    answer_bytes,
    completion_steps,
    emitted_ids,
    generate_steps,
    model_card,
)
from trace_replay.engines.validate import ImpossibleResult, check_results
from trace_replay.engines.vllm_contract import TRACE_KEY
from trace_replay.models.load import EMBEDDED_MODEL, ModelNotFoundError, hf_folder

__all__ = ["APIS", "SERVER_OPTIONS", "ServerEngine"]

APIS = ("auto", "generate", "completions")
# engine_args this engine takes
SERVER_OPTIONS = ("base_url", "api", "api_key", "timeout_s", "max_retries")
# sampling settings a server's generation_config could otherwise change; with forcing they
# cannot change the emitted token, and raw logprobs are computed before any of them
_NEUTRAL = {
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": True,
    "stop": [],
    "stop_token_ids": [],
    "n": 1,
}


class ServerEngine(EngineBase):
    """Replay through a vLLM server that loads the forcing logits processor.

    Parameters
    ----------
    config
        ``model`` names the tokenizer (a local folder or cached name of the server's model);
        ``None`` takes the server's model folder when it is on this machine, or the embedded
        model's tokenizer when the server serves it. ``batch_size`` is the number of requests
        in flight (default 32); ``top_k`` the alternatives recorded. ``dtype``, ``device``
        and ``deterministic`` are the server's and cannot be set here (``settings()`` gives
        ``None`` for dtype and device: the client does not know them).
    engine_args
        ``base_url`` (``"http://host:port/v1"`` or https, required), ``api`` (``"auto"``,
        ``"generate"``, ``"completions"``), ``api_key`` (default ``$VLLM_API_KEY``),
        ``timeout_s`` the most one attempt of a request may take, answer included (600),
        ``max_retries`` for requests that got no answer (an integer >= 0, default 5).

    A short logprob list or a malformed rank is an error naming the trace; an impossible
    score is refused by :func:`~trace_replay.runs.replay`, which checks every engine's results
    (:func:`~trace_replay.engines.validate.check_results`) and keeps the batch's possible
    ones, as the start-up probes here are checked.
    """

    name = "vllm-server"
    weights_can_change = True  # a server may load other weights while it serves: MovingWeights
    _pool: ThreadPoolExecutor | None = None  # None until started, and once closed

    def __init__(
        self, config: EngineConfig | None = None, *, engine_args: dict[str, Any] | None = None
    ) -> None:
        config = config or EngineConfig()
        options = dict(engine_args or {})
        unknown = sorted(set(options) - set(SERVER_OPTIONS))
        if unknown:
            raise ValueError(
                f"engine 'vllm-server' does not take engine_args {unknown} "
                f"(it takes {', '.join(SERVER_OPTIONS)})"
            )
        if options.get("api", "auto") not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {options['api']!r}")
        if not options.get("base_url"):
            raise ValueError(
                "engine 'vllm-server' needs the server's address: "
                "engine_args={'base_url': 'http://host:port/v1'}"
            )
        for setting in ("dtype", "device"):
            if getattr(config, setting) is not None:
                raise ValueError(
                    f"{setting} is the server's: set it where the server starts "
                    f"(vllm serve --{setting} …), not in the client"
                )
        if config.deterministic:
            raise ValueError(
                "deterministic is the server's: start it with "
                "VLLM_BATCH_INVARIANT=1 where vLLM supports it (NVIDIA, sm80+)"
            )
        if isinstance(config.model, torch.nn.Module):
            raise TypeError(
                "engine 'vllm-server' runs the server's model: pass model= only "
                "to name its tokenizer (a folder or a cached name)"
            )
        self.base_url = str(options["base_url"]).rstrip("/")
        self._fingerprints = Fingerprints(self.base_url)
        self.engine_path = "vllm-server-forcing"
        self.client = JsonClient(
            self.base_url.removesuffix("/v1"),
            api_key=options.get("api_key") or os.environ.get("VLLM_API_KEY"),
            timeout_s=options.get("timeout_s", 600.0),
            max_retries=options.get("max_retries", 5),
        )
        card = self._model_card()
        self.served_model = card["id"]
        self.model_label = self.served_model
        self.max_model_len = card.get("max_model_len")
        self.tokenizer_source = _tokenizer_source(config.model, card)
        self._vocab_size = _config_vocab_size(self.tokenizer_source)
        self.dtype = self.device = None  # the server's, which it does not report
        self.top_k = config.top_k
        self.batch_size = config.batch_size or 32
        self.api = self._choose_api(options.get("api", "auto"))
        self.forcing = "logits-processor"  # until the start-up check finds native replay
        self.engine_path = engine_path(self.forcing, self.api)
        self.vllm_version = self._server_version()
        self._pool = ThreadPoolExecutor(self.batch_size, thread_name_prefix="trace-replay-http")
        try:
            self._check_tokenizer()
            self._check_forcing()
        except BaseException:
            self.close()
            raise

    # --- the Engine protocol ------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        rank = (
            "exact"
            if self.api == "generate"
            else (
                f"exact where the server lists a token no more likely than the trace's among the "
                f"{max(self.top_k, RANK_DEPTH)} asked for, else a lower bound (rank_exact is False)"
            )
        )
        return {
            **super().settings(),
            "server_api": self.api,
            "vllm_version": self.vllm_version,
            "logprobs_mode": "raw_logprobs",
            "rank": rank,
            "server_forcing": self.forcing,
        }

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary of the local model folder named for the tokenizer (``None``: none)."""
        return self._vocab_size

    def weights_digest(self) -> str:
        """What the server serves, read now: a digest of ``base_url`` and of the scores it
        gives the fixed probe, rounded (:func:`~trace_replay.engines.server.probe.
        fingerprint`). A checkpoint keys on it, so rows computed against another server, or
        against this address before a restart with other weights, are never served. Read
        again, it stands while the probe's numbers move less than 0.005 nats
        (:class:`~trace_replay.engines.server.probe.Fingerprints`); ``replay`` reads it
        before it keeps rows, since a server's weights can change while it serves
        (``weights_can_change``)."""
        return self._fingerprints(self._score_probe())

    def stats(self) -> dict[str, Any]:
        return {
            "server_url": self.base_url,
            "server_requests": self.client.requests,
            "server_retries": self.client.retries,
        }

    def run(
        self, requests: Sequence[ReplayRequest], *, on_tokens: Callable[[int], None] | None = None
    ) -> list[TraceResult]:
        """Replay ``requests`` with ``batch_size`` in flight; results in the order given.

        Each request is sent until it gets an answer, and each answer fills its own slot, so
        a retried request yields exactly one result. ``on_tokens`` hears of each answered
        trace, from this thread. Results are not checked here: ``replay()`` checks each,
        so an impossible one does not lose the possible ones beside it. A request that
        fails (``ServerError``), or whose answer holds an impossible logprob that its result
        would not keep (an alternative past the top-k:
        :class:`~trace_replay.engines.validate.ImpossibleResult`), raises
        :class:`~trace_replay.engines.base.BatchFailed` once every other request of the
        call that was in flight has finished, with their results: the first ``batch_size``
        requests are in flight, whether or not their threads had started when the error came
        (none is dropped because its thread started late); requests past them stay unsent.
        """
        pool = self._pool
        assert pool is not None, "a closed engine runs nothing (EngineClosed first)"
        futures = [pool.submit(self._replay_one, r) for r in requests]
        try:
            for future in as_completed(futures):
                if on_tokens is not None:
                    on_tokens(len(future.result().token_ids))
            return [future.result() for future in futures]
        except BaseException as error:
            if not isinstance(error, (ServerError, ImpossibleResult)):
                for future in futures:  # interrupted: requests not sent yet stay unsent
                    future.cancel()
                raise
            # the first batch_size requests are in flight (the pool is that wide and takes them
            # in order), whether or not a thread had picked one up when the error came: they
            # are all asked and kept; requests past them stay unsent
            for future in futures[self.batch_size :]:
                future.cancel()
            wait([f for f in futures if not f.cancelled()])
            raise BatchFailed(error, [_finished(f) for f in futures]) from error

    def close(self) -> None:
        """Stop the request threads (the server keeps running)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    # --- one request --------------------------------------------------------------------------

    def _replay_one(self, request: ReplayRequest) -> TraceResult:
        trace = list(request.trace_token_ids)
        alternatives = self.top_k + 1 if self.api == "generate" else max(self.top_k, RANK_DEPTH)
        most = answer_bytes(request.prompt_len, len(trace), alternatives)
        try:
            if self.api == "generate":
                path, body = (
                    "/inference/v1/generate",
                    {
                        "model": self.served_model,
                        "token_ids": list(request.prompt_token_ids),
                        "output_mode": "tokens",
                        "sampling_params": {
                            **_NEUTRAL,
                            "max_tokens": len(trace),
                            # the endpoint drops the k-th alternative when the
                            # token is outside the top k; k + 1 keeps the top k
                            "logprobs": alternatives,
                            "detokenize": False,
                            **trace_field(trace, self.forcing),
                        },
                    },
                )
            else:
                path, body = (
                    "/v1/completions",
                    {
                        **_NEUTRAL,
                        "model": self.served_model,
                        "prompt": list(request.prompt_token_ids),
                        "max_tokens": len(trace),
                        "logprobs": alternatives,
                        "return_token_ids": True,
                        "return_tokens_as_token_ids": True,
                        "vllm_xargs": {TRACE_KEY: trace},
                    },
                )
            answer = self.client.post(path, body, max_bytes=most)  # sized by what was asked
            choice = answer["choices"][0]
            emitted = emitted_ids(choice)
            self._check_emitted(request, emitted)
            if self.api == "generate":
                steps = generate_steps(choice["logprobs"]["content"], self.top_k, len(trace))
            else:
                steps = completion_steps(
                    choice["logprobs"], self.top_k, len(trace), token_ids=emitted
                )
        except ImpossibleResult as error:  # a number no distribution gives, kept or not
            raise ImpossibleResult(
                f"trace {request.trace_id!r}, {error}",
                trace_id=request.trace_id,
                step=error.step,
                field=error.field,
            ) from None
        except (
            ServerError,
            AttributeError,
            KeyError,
            IndexError,
            OverflowError,
            TypeError,
            ValueError,
        ) as error:
            raise ServerError(
                f"trace {request.trace_id!r}: {type(error).__name__}: {error}",
                getattr(error, "status", None),
            ) from None
        logprob, rank, top_ids, top_lps, exact = steps
        extra = {} if self.api == "generate" else {"rank_exact": exact}
        return TraceResult(
            trace_id=request.trace_id,
            prompt_len=request.prompt_len,
            token_ids=np.asarray(emitted, dtype=np.int64),
            logprob=logprob,
            rank=rank,
            top_token_ids=top_ids,
            top_logprobs=top_lps,
            entropy=np.full(len(emitted), np.nan),
            tail_logmass=tail_from_top(top_lps),
            extra=extra,
        )

    def _check_emitted(self, request: ReplayRequest, emitted: list[int]) -> None:
        trace = list(request.trace_token_ids)
        if emitted == trace:
            return
        step = next(
            (i for i, (a, b) in enumerate(zip(emitted, trace)) if a != b),
            min(len(emitted), len(trace)),
        )
        what = (
            f"token {emitted[step]} where the trace has {trace[step]}"
            if step < min(len(emitted), len(trace))
            else f"{len(emitted)} tokens for a trace of {len(trace)}"
        )
        raise TraceNotForced(
            f"trace {request.trace_id!r}: the server at {self.base_url} emitted {what} "
            f"(step {step}), so it does not force traces: {how_to_start()}",
            what,
        )

    # --- start-up -----------------------------------------------------------------------------

    def _model_card(self) -> dict:
        """The served model's card; a ServerError naming the server (and the field, for an
        answer that is not a model list)."""
        try:
            answer = self.client.get("/v1/models")
        except ServerError as error:
            raise ServerError(
                f"cannot list the models of the server at {self.base_url} "
                f"(is it a vLLM server, with /v1 in base_url?): {error}"
            ) from None
        try:
            return model_card(answer)
        except ValueError as error:
            raise ServerError(
                f"the server at {self.base_url} answered /v1/models with "
                f"{error} (is it a vLLM server?)"
            ) from None

    def _server_version(self) -> str | None:
        try:
            version = self.client.get("/version").get("version")
        except (ServerError, AttributeError):
            return None
        return version if isinstance(version, str) else None

    def _choose_api(self, api: str) -> str:
        if api == "completions":
            return api
        try:
            self.client.post("/inference/v1/generate", {})  # empty: refused as invalid when there
            status = 200
        except ServerError as error:
            if error.status is None or error.status >= 500:  # no answer, or a broken server
                raise ServerError(
                    f"the server at {self.base_url} failed its start-up check "
                    f"(is /inference/v1/generate offered?): {error}",
                    error.status,
                ) from None
            status = error.status
        if status in (400, 422):
            return "generate"
        if api == "generate":
            raise ServerError(
                f"the server at {self.base_url} does not offer "
                f"/inference/v1/generate (HTTP {status}): start it with "
                "--enable-scale-out, or use api='completions'"
            )
        return "completions"

    def _check_tokenizer(self) -> None:
        """The server's tokenizer must encode text as the local one does."""
        try:
            theirs = self.client.post(
                "/tokenize", {"model": self.served_model, "prompt": PROBE_TEXT}
            )["tokens"]
        except ServerError as error:
            if error.status == 404:
                return  # no tokenize endpoint: nothing to compare with
            raise
        except (KeyError, TypeError) as error:
            raise ServerError(
                f"the server at {self.base_url} answered /tokenize without a "
                f"list of tokens ({type(error).__name__}: {error})"
            ) from None
        ours = list(self.tokenizer.encode(PROBE_TEXT))
        if theirs != ours:
            local = self.tokenizer_source or EMBEDDED_MODEL
            raise ValueError(
                f"the server's model {self.served_model!r} tokenizes text unlike "
                f"the local tokenizer of {str(local)!r} ({theirs[:8]} vs "
                f"{ours[:8]}): pass model= naming the server's model"
            )

    def _score_probe(self) -> list[TraceResult]:
        """The server's scores of the probe, checked possible; a request that fails is a
        ServerError naming the server."""
        probes = probe_requests(self.tokenizer)
        try:  # one at a time: on an idle server each runs alone in its batch, the same bits
            results = [self.run([probe])[0] for probe in probes]
        except BatchFailed as failed:
            raise ServerError(
                f"the server at {self.base_url} failed its check on the fixed "
                f"one-token probe traces: {failed.error}",
                getattr(failed.error, "status", None),
            ) from None
        check_results(probes, results, top_k=self.top_k, vocab_size=self.vocab_size)
        return results

    def _check_forcing(self) -> None:
        """How the server forces traces: natively where it returns the probe's native
        requests, else the processor must; then the two forced tokens must not both be
        likely (raw logprobs)."""
        try:
            refusal = (
                native_refusal(self.client, self.served_model, probe_requests(self.tokenizer))
                if self.api == "generate"
                else NOT_OFFERED
            )
        except ServerError as error:
            raise ServerError(
                f"the server at {self.base_url} failed its start-up check (a "
                f"native trace replay request): {error}",
                error.status,
            ) from None
        self.forcing = "native" if refusal is None else "logits-processor"
        self.engine_path = engine_path(self.forcing, self.api)
        try:
            results = self._score_probe()
        except TraceNotForced as error:
            if refusal is None:  # native replay took the probe, then did not follow it
                raise
            raise ServerError(
                f"the server at {self.base_url} does not force traces (native "
                f"trace replay: {refusal}; the package's processor: "
                f"{error.what} for a one-token trace): {how_to_start()}"
            ) from None
        if all(r.logprob[0] > math.log(0.5) for r in results):
            raise RuntimeError(
                f"the server at {self.base_url} reports logprobs after forcing "
                "(two different forced tokens both came back with probability > 0.5): "
                "start it with --logprobs-mode raw_logprobs"
            )


def _config_vocab_size(source: Any) -> int | None:
    """``vocab_size`` in the config of the model folder ``source`` names, when there is one."""
    try:
        config = json.loads((hf_folder(source) / "config.json").read_text())
    except (ModelNotFoundError, OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def _tokenizer_source(model: Any, card: dict) -> Any:
    """What ``load_tokenizer`` reads for the server's model (``None``: the embedded one)."""
    if model is not None:
        return model
    root = card.get("root") or card["id"]
    try:
        hf_folder(root)
        return root
    except ModelNotFoundError:
        pass
    if card["id"] == EMBEDDED_MODEL or os.path.basename(root).startswith(f"{EMBEDDED_MODEL}-f32-"):
        return None
    raise ModelNotFoundError(
        f"the server serves {card['id']!r} ({root}), which is not on this "
        "machine: pass model= (a local folder or cached name of the same "
        "model) for its tokenizer"
    )


def _finished(future: Future) -> TraceResult | None:
    """A done future's result; None for one cancelled or failed."""
    if future.cancelled() or future.exception() is not None:
        return None
    return future.result()
