"""Native online trace replay: a stock vLLM server (>= 0.29) forcing traces itself.

``vllm serve MODEL --enable-trace-replay --enable-scale-out`` replays with nothing of this
package on the server. What vLLM 0.32's own source says (``vllm/entrypoints/scale_out/
token_in_token_out/``, ``vllm/v1/engine/input_processor.py``, ``vllm/sampling_params.py``):

* Only the token-in/token-out endpoint ``/inference/v1/generate`` takes a whole
  ``SamplingParams``, so only it carries ``trace_decode_token_ids``; the OpenAI completions
  and chat requests have no field for it. ``--enable-scale-out`` registers the endpoint
  (without it the server answers 403 "Scale-out endpoints are disabled").
* A server started without ``--enable-trace-replay`` answers such a request with HTTP 400
  ("trace_decode_token_ids is set but trace replay is not enabled. Start the engine with
  --enable-trace-replay to use it."). A vLLM older than 0.29 drops the unknown field and
  samples freely, so only forced tokens coming back prove forcing: :func:`native_refusal`
  sends the start-up probe's two one-token traces of different tokens, which a server that
  samples cannot both return.
* Trace replay needs Model Runner V2. Where vLLM runs the V1 runner (the CPU build, whose
  Triton has no CPU backend), ``--enable-trace-replay`` stops the server at start-up:
  "trace replay requires Model Runner V2".
* The server cuts a trace to ``max_model_len - prompt_len`` tokens, sets ``max_tokens`` to
  at most its length, ignores EOS and clears stops; a request still sends ``max_tokens`` =
  the trace's length (vLLM #56730: left out, it is defaulted).
* Logprobs come back as for any generate request (``responses.generate_steps`` reads both
  forcing paths alike): per token ``token_id``, ``logprob`` (``-inf`` and NaN sent as
  -9999.0), the engine's ``rank`` (``None`` for a NaN logprob) and ``top_logprobs``, the
  emitted token first and then the rest in rank order, as many entries as
  ``sampling_params.logprobs``. Raw logprobs (``--logprobs-mode raw_logprobs``, vLLM's
  default) are those of the forced token under the model's own distribution; ranks are
  exact.
* ``/v1/models`` lists the served name, its folder (``root``) and ``max_model_len``;
  ``/version`` gives ``{"version": "0.32.0"}``; neither says whether trace replay is on,
  hence the probe.
"""

from __future__ import annotations

from collections.abc import Sequence

from trace_replay.engines.base import ReplayRequest
from trace_replay.engines.server.http_client import JsonClient, ServerError
from trace_replay.engines.server.responses import emitted_ids
from trace_replay.engines.vllm_contract import FORCING_PROCESSOR, TRACE_KEY

__all__ = [
    "FORCING",
    "GENERATE",
    "NATIVE_FIELD",
    "NOT_OFFERED",
    "TraceNotForced",
    "engine_path",
    "how_to_start",
    "native_refusal",
    "trace_field",
]

GENERATE = "/inference/v1/generate"
NATIVE_FIELD = "trace_decode_token_ids"  # SamplingParams' field (vLLM >= 0.29)
# how a server forces traces, in the order the start-up check tries them
FORCING = ("native", "logits-processor")
NOT_OFFERED = f"needs {GENERATE}, which the server does not offer (vllm serve --enable-scale-out)"
START_NATIVE = "--enable-trace-replay --enable-scale-out"
START_PROCESSOR = f"--logits-processors {FORCING_PROCESSOR} --logprobs-mode raw_logprobs"


class TraceNotForced(RuntimeError):
    """A server emitted another token than the trace's; ``what`` says which, briefly."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


def trace_field(trace: list[int], forcing: str) -> dict:
    """The ``sampling_params`` entry that carries ``trace`` for a server forcing by
    ``forcing`` (one of :data:`FORCING`)."""
    if forcing == "native":
        return {NATIVE_FIELD: trace}
    return {"extra_args": {TRACE_KEY: trace}}


def engine_path(forcing: str, api: str) -> str:
    """``settings()["engine_path"]`` of a server forcing by ``forcing`` through ``api``."""
    kind = "native-trace-replay" if forcing == "native" else "forcing"
    return f"vllm-server-{kind}[{api}]"


def how_to_start() -> str:
    """The ``vllm serve`` options that make a server force traces, either way."""
    return (
        f"start it with {START_NATIVE} (vLLM >= 0.29 on a GPU: native trace replay, "
        f"nothing of this package on the server), or with {START_PROCESSOR} (the "
        "package's processor, importable by the server: trace-replay serve starts that)"
    )


def native_refusal(client: JsonClient, model: str, probes: Sequence[ReplayRequest]) -> str | None:
    """Why the server does not replay ``probes`` natively; ``None`` when it does.

    Each probe (a one-token trace; two of different tokens) is sent as a generate request
    carrying :data:`NATIVE_FIELD`: the server replays natively when every one comes back as
    its trace. An answer of HTTP 4xx (trace replay not enabled, or a request the server
    refuses) or another token is a refusal, said in the text returned.

    Raises
    ------
    ServerError
        No answer, HTTP 5xx, or an answer without the emitted tokens.
    """
    for probe in probes:
        trace = list(probe.trace_token_ids)
        body = {
            "model": model,
            "token_ids": list(probe.prompt_token_ids),
            "output_mode": "tokens",
            "sampling_params": {
                "max_tokens": len(trace),
                "temperature": 0.0,
                "n": 1,
                "ignore_eos": True,
                "detokenize": False,
                NATIVE_FIELD: trace,
            },
        }
        try:
            answer = client.post(GENERATE, body)
        except ServerError as error:
            if error.status is not None and 400 <= error.status < 500:
                return str(error)
            raise
        try:
            emitted = emitted_ids(answer["choices"][0])
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
            raise ServerError(
                f"{client.root}{GENERATE} answered a native trace replay "
                f"request unreadably ({type(error).__name__}: {error})"
            ) from None
        if emitted != trace:
            return (
                f"{emitted} came back for the one-token trace {trace} ({NATIVE_FIELD} "
                "ignored: vLLM before 0.29?)"
            )
    return None
