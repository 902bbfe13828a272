"""engine="vllm-server" against a stock vLLM 0.32 server: native trace replay, found at start-up.

The server here is a fake on 127.0.0.1 that speaks vLLM 0.32's own protocol: it validates
each request with vLLM's ``GenerateRequest`` / ``CompletionRequest`` (a request vLLM would
refuse is refused here, HTTP 400), builds every answer from vLLM's response classes and
its own logprob helpers (``append_logprobs_for_next_position``,
``ServingTokens._create_tokens_logprobs``), and refuses a native trace as vLLM does
without ``--enable-trace-replay``. Its "model" is a seeded random distribution per
context, so every number the client reports can be checked against the fake's exactly.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'trace-replay[cpu]')")
pytestmark = pytest.mark.vllm

from pydantic import ValidationError  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import (  # noqa: E402
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (  # noqa: E402
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens  # noqa: E402
from vllm.entrypoints.serve.engine.protocol import (  # noqa: E402
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse  # noqa: E402
from vllm.logprobs import append_logprobs_for_next_position  # noqa: E402

from trace_replay.engines import make_engine  # noqa: E402
from trace_replay.engines.server.http_client import ServerError  # noqa: E402
from trace_replay.engines.validate import ImpossibleResult  # noqa: E402
from trace_replay.engines.vllm_contract import FORCING_PROCESSOR, TRACE_KEY  # noqa: E402
from trace_replay.runs.replay import replay  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's name: the client takes its tokenizer
VOCAB = 49152
# vLLM 0.32's answers, verbatim (input_processor.py, scale_out/factories.py)
NOT_ENABLED = (
    "trace_decode_token_ids is set but trace replay is not enabled. Start the "
    "engine with --enable-trace-replay to use it."
)
NO_SCALE_OUT = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)
TRACES = [
    {"id": "a", "prompt_token_ids": [504, 3575, 282], "trace_token_ids": [4649, 314, 2]},
    {"id": "b", "prompt_token_ids": [1, 9], "trace_token_ids": [77, 78, 79, 80]},
]


def fake_logprobs(context: list[int], weights: int) -> np.ndarray:
    """The fake model's log-softmax after ``context``: seeded by the context and ``weights``."""
    seed = zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()) ^ weights
    logits = 2.0 * np.random.default_rng(seed).standard_normal(VOCAB)
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


class FakeVLLM(BaseHTTPRequestHandler):
    """vLLM 0.32's ``vllm serve`` as the client sees it. Server attributes: ``native``
    (started with ``--enable-trace-replay``; ``"ignored"``: a vLLM before 0.29, which drops
    the unknown field), ``processor`` (the package's processor loaded), ``scale_out``
    (``--enable-scale-out``), ``weights`` (the model's seed), ``spoil`` (edits the
    GenerateTokensResponse of traces longer than one token), ``seen`` (sampling params of
    every generate request, as vLLM parsed them)."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            card = ModelCard(id=MODEL, root=f"/models/{MODEL}", max_model_len=1024)
            self._send(200, ModelList(data=[card]).model_dump())
        elif self.path == "/version":
            self._send(200, {"version": "0.32.0"})
        else:
            self._error(404, "Not Found", "NotFoundError")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        route = {
            "/inference/v1/generate": self._generate,
            "/v1/completions": self._complete,
            "/tokenize": self._tokenize,
        }.get(self.path)
        if route is None:
            self._error(404, "Not Found", "NotFoundError")
            return
        try:
            route(body)
        except ValidationError as error:  # vLLM's validation handler: HTTP 400
            self._error(400, str(error), "Bad Request")

    def _generate(self, body: dict) -> None:
        if not self.server.scale_out:
            self._error(403, NO_SCALE_OUT, "PermissionDeniedError")
            return
        request = GenerateRequest.model_validate(body)
        params = request.sampling_params
        self.server.seen.append(params)
        trace = None
        if params.trace_decode_token_ids:
            if not self.server.native:
                self._error(400, NOT_ENABLED, "BadRequestError")
                return
            if self.server.native is True:
                trace = params.trace_decode_token_ids
        elif self.server.processor:
            trace = (params.extra_args or {}).get(TRACE_KEY)
        tokens, logprobs = self._decode(
            request.token_ids, trace, params.max_tokens, params.logprobs
        )
        answer = GenerateTokensResponse(
            request_id="generate-tokens-fake",
            model=MODEL,
            choices=[
                GenerateTokensChoice(
                    index=0,
                    finish_reason="length",
                    token_ids=tokens,
                    logprobs=None
                    if params.logprobs is None
                    else ServingTokens._create_tokens_logprobs(
                        None, tokens, logprobs, params.logprobs
                    ),
                )
            ],
            usage=UsageInfo(prompt_tokens=len(request.token_ids), completion_tokens=len(tokens)),
        )
        if len(tokens) > 1:
            self.server.spoil(answer)
        self._send(200, answer.model_dump())

    def _complete(self, body: dict) -> None:
        request = CompletionRequest.model_validate(body)
        trace = (request.vllm_xargs or {}).get(TRACE_KEY) if self.server.processor else None
        tokens, logprobs = self._decode(request.prompt, trace, request.max_tokens, request.logprobs)
        placeholder = "token_id:{}".format
        # as OpenAIServingCompletion._create_completion_logprobs: the step's first n + 1
        top = [
            {
                placeholder(t): e.logprob
                for i, (t, e) in enumerate(step.items())
                if i <= request.logprobs
            }
            for step in logprobs
        ]
        answer = CompletionResponse(
            model=MODEL,
            choices=[
                CompletionResponseChoice(
                    index=0,
                    text="",
                    token_ids=tokens,
                    finish_reason="length",
                    logprobs=CompletionLogProbs(
                        tokens=[placeholder(t) for t in tokens],
                        token_logprobs=[s[t].logprob for s, t in zip(logprobs, tokens)],
                        top_logprobs=top,
                    ),
                )
            ],
            usage=UsageInfo(prompt_tokens=len(request.prompt)),
        )
        self._send(200, answer.model_dump())

    def _tokenize(self, body: dict) -> None:
        tokens = list(self.server.tokenizer.encode(body["prompt"]))
        self._send(
            200, TokenizeResponse(count=len(tokens), max_model_len=1024, tokens=tokens).model_dump()
        )

    def _decode(self, prompt, trace, max_tokens, top_n):
        """Greedy decoding, each step's token replaced by the trace's where one is forced
        (vLLM's trace replay and the processor alike: raw logprobs of the emitted token);
        logprob dicts as vLLM's output processor builds them."""
        steps = min(max_tokens, len(trace)) if trace else max_tokens
        context, tokens, logprobs = list(prompt), [], []
        for step in range(steps):
            lp = fake_logprobs(context, self.server.weights)
            token = trace[step] if trace else int(lp.argmax())
            if top_n is not None:
                top = np.argsort(-lp, kind="stable")[:top_n].tolist()
                rank = 1 + int((lp > lp[token]).sum())
                append_logprobs_for_next_position(
                    logprobs,
                    [token, *top],
                    [float(lp[t]) for t in [token, *top]],
                    [None] * (top_n + 1),
                    rank,
                    top_n,
                )
            tokens.append(token)
            context.append(token)
        return tokens, logprobs

    def _error(self, status: int, message: str, kind: str) -> None:
        error = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=status))
        self._send(status, error.model_dump())

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def start_fake(tokenizer):
    """``start_fake(native=, processor=, scale_out=, weights=)``: a fake vLLM 0.32 server
    on a free port of 127.0.0.1, stopped after the test; returns (server, base_url)."""
    started = []

    def start(native=True, processor=False, scale_out=True, weights=0):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
        httpd.native, httpd.processor, httpd.scale_out = native, processor, scale_out
        httpd.weights, httpd.spoil, httpd.seen = weights, lambda answer: None, []
        httpd.tokenizer = tokenizer
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return httpd, f"http://127.0.0.1:{httpd.server_port}/v1"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _expected(trace: dict, top_k: int, weights: int = 0):
    """The fake's logprob, rank, top-k ids and logprobs of each step of ``trace``."""
    context = list(trace["prompt_token_ids"])
    rows = []
    for token in trace["trace_token_ids"]:
        lp = fake_logprobs(context, weights)
        top = np.argsort(-lp, kind="stable")[:top_k]
        rows.append((lp[token], 1 + int((lp > lp[token]).sum()), top, lp[top]))
        context.append(token)
    return [np.array(column) for column in zip(*rows)]


def _replay(base_url, **options):
    return replay(
        TRACES,
        engine="vllm-server",
        top_k=3,
        progress=False,
        engine_args={"base_url": base_url, "max_retries": 0, **options},
    )


def _assert_fake_numbers(df, top_k=3):
    for trace in TRACES:
        rows = df[df.trace_id == trace["id"]]
        logprob, rank, top_ids, top_lps = _expected(trace, top_k)
        assert rows["token_id"].tolist() == trace["trace_token_ids"]
        assert rows["logprob"].tolist() == logprob.tolist()
        assert rows["rank"].tolist() == rank.tolist()
        assert np.stack(rows["top_token_ids"]).tolist() == top_ids.tolist()
        assert np.stack(rows["top_logprobs"]).tolist() == top_lps.tolist()


def test_a_stock_server_with_trace_replay_replays_natively(start_fake):
    """A stock server started with --enable-trace-replay --enable-scale-out (nothing of the
    package on it) is found native at start-up (attrs server_forcing), every trace goes as
    SamplingParams.trace_decode_token_ids with max_tokens = its length, n = 1 and no
    processor argument, and the numbers are the server's own: logprob, exact rank, top-k."""
    server, url = start_fake(native=True)
    df = _replay(url)
    assert df.attrs["server_forcing"] == "native"
    assert df.attrs["engine_path"] == "vllm-server-native-trace-replay[generate]"
    assert df.attrs["rank"] == "exact" and "rank_exact" not in df
    _assert_fake_numbers(df)
    replayed = [p for p in server.seen if p.logprobs is not None]  # probes and traces
    assert sorted(
        p.trace_decode_token_ids for p in replayed if len(p.trace_decode_token_ids) > 1
    ) == sorted(t["trace_token_ids"] for t in TRACES)
    for params in replayed:
        assert params.max_tokens == len(params.trace_decode_token_ids) and params.n == 1
        assert params.ignore_eos and not params.extra_args


def test_the_package_processor_is_found_where_native_replay_is_off(start_fake):
    """A server refusing native traces (HTTP 400, not started with --enable-trace-replay)
    that loads the package's processor is used through the processor, as before; attrs say
    so, and the numbers are the server's."""
    server, url = start_fake(native=False, processor=True)
    df = _replay(url)
    assert df.attrs["server_forcing"] == "logits-processor"
    assert df.attrs["engine_path"] == "vllm-server-forcing[generate]"
    _assert_fake_numbers(df)
    assert all(p.trace_decode_token_ids is None for p in server.seen[-2:])


@pytest.mark.parametrize(
    "native, refusal",
    [
        (False, NOT_ENABLED),
        ("ignored", r"came back for the one-token trace \[\d+\] \(trace_decode_token_ids ignored"),
    ],
)
def test_a_server_forcing_neither_way_is_a_server_error_saying_how_to_start_it(
    start_fake, native, refusal
):
    """A server without trace replay (HTTP 400) or too old to know it (the field dropped,
    the greedy token returned) and without the processor: a ServerError naming the server,
    what each way answered, and the vllm serve options of both ways."""
    _, url = start_fake(native=native, processor=False)
    with pytest.raises(ServerError, match="does not force traces") as error:
        make_engine("vllm-server", top_k=3, engine_args={"base_url": url, "max_retries": 0})
    message = str(error.value)
    assert message.startswith(f"the server at {url} ")
    assert "--enable-trace-replay --enable-scale-out" in message
    assert f"--logits-processors {FORCING_PROCESSOR}" in message
    assert re.search(refusal, message), message


def test_native_replay_without_the_generate_endpoint_is_named(start_fake):
    """--enable-trace-replay without --enable-scale-out: the completions API cannot carry a
    native trace, so the server does not force traces, and the error says the endpoint is
    missing (api='generate': the server's 403 and the flag)."""
    _, url = start_fake(native=True, scale_out=False)
    with pytest.raises(
        ServerError,
        match=r"native trace replay: needs /inference/v1/generate, "
        r"which the server does not offer \(vllm serve "
        r"--enable-scale-out\)",
    ):
        make_engine("vllm-server", top_k=3, engine_args={"base_url": url, "max_retries": 0})
    with pytest.raises(
        ServerError,
        match=r"does not offer /inference/v1/generate \(HTTP 403\): "
        r"start it with --enable-scale-out",
    ):
        make_engine(
            "vllm-server",
            top_k=3,
            engine_args={"base_url": url, "max_retries": 0, "api": "generate"},
        )


def test_impossible_native_answers_are_refused(start_fake):
    """The checks every engine's output passes apply to native answers unchanged: a forced
    token reported as rank 1 below a likelier alternative is an ImpossibleResult naming
    the trace and step."""
    server, url = start_fake(native=True)

    def spoil(answer):
        answer.choices[0].logprobs.content[1].rank = 1

    server.spoil = spoil
    with pytest.raises(ImpossibleResult, match=r"trace 'a', step 1: .*rank = 1"):
        _replay(url)


def test_the_fingerprint_of_a_native_server_is_its_weights(start_fake):
    """weights_digest (what checkpoints key on) reads the same from one native server
    twice, and differs for a server at the same address serving other weights."""
    server, url = start_fake(native=True)
    with make_engine("vllm-server", top_k=3, engine_args={"base_url": url}) as engine:
        first = engine.weights_digest()
        assert engine.weights_digest() == first
        server.weights = 1
        assert engine.weights_digest() != first
