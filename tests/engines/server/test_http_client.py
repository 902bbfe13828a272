"""The JSON client of the server engine (trace_replay.engines.server.http_client) against a real
``http.server`` on 127.0.0.1: requests that got no answer are sent again, answers never are,
and an error answer's own message reaches the caller."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trace_replay.engines.server.http_client import JsonClient, ServerError


class Handler(BaseHTTPRequestHandler):
    """Answers by path; ``server.script[path]`` lists what to do on successive requests."""

    def do_GET(self) -> None:
        self._answer(None)

    def do_POST(self) -> None:
        self._answer(self.rfile.read(int(self.headers["Content-Length"])))

    def _answer(self, body: bytes | None) -> None:
        seen = self.server.seen.setdefault(self.path, [])
        seen.append({"method": self.command, "body": body, "auth": self.headers["Authorization"]})
        script = self.server.script[self.path]
        status, payload = script[min(len(seen), len(script)) - 1]
        if status is None:  # hang up without answering
            self.close_connection = True
            return
        if isinstance(payload, (Trickle, Redirect, Swell)):
            payload.send(self)
            return
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # keep the test output clean
        pass


class Redirect:
    """A redirect answer: ``status`` with ``Location: location`` (``{port}`` filled in with
    the server's own port)."""

    def __init__(self, status: int, location: str) -> None:
        self.status, self.location = status, location

    def send(self, handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(self.status)
        handler.send_header("Location", self.location.format(port=handler.server.server_port))
        handler.send_header("Content-Length", "0")
        handler.end_headers()


class Swell:
    """An answer of ``status`` that never stops: 64 KiB pieces until the client hangs up or
    ``most`` bytes went out; ``declared`` sends that Content-Length. ``sent`` counts the
    bytes written, ``done`` is set at the end."""

    def __init__(
        self, status: int = 200, *, declared: int | None = None, most: int = 64 << 20
    ) -> None:
        self.status, self.declared, self.most = status, declared, most
        self.sent, self.done = 0, threading.Event()

    def send(self, handler: BaseHTTPRequestHandler) -> None:
        piece = b'{"x": "' + b"a" * (64 << 10)
        handler.send_response(self.status)
        if self.declared is not None:
            handler.send_header("Content-Length", str(self.declared))
        handler.end_headers()
        try:
            while self.sent < self.most:
                handler.wfile.write(piece)
                self.sent += len(piece)
        except OSError:  # the client hung up: what the test expects
            pass
        finally:
            self.done.set()


class Trickle:
    """A JSON answer sent in ``pieces`` pieces, ``gap_s`` apart."""

    def __init__(self, pieces: int, gap_s: float) -> None:
        self.pieces, self.gap_s = pieces, gap_s

    def send(self, handler: BaseHTTPRequestHandler) -> None:
        data = json.dumps({"n": list(range(100))}).encode()
        size = -(-len(data) // self.pieces)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        try:
            for start in range(0, len(data), size):
                handler.wfile.write(data[start : start + size])
                handler.wfile.flush()
                time.sleep(self.gap_s)
        except OSError:  # the client hung up: what the test expects
            pass


class TrickleHeaders(Trickle):
    """A JSON answer whose ``pieces`` header lines come ``gap_s`` apart; ``sent`` counts
    the lines sent before the client hung up, and ``done`` is set when the answer ends."""

    def __init__(self, pieces: int, gap_s: float) -> None:
        super().__init__(pieces, gap_s)
        self.sent, self.done = 0, threading.Event()

    def send(self, handler: BaseHTTPRequestHandler) -> None:
        data = json.dumps({"n": 1}).encode()
        handler.send_response(200)
        try:
            for i in range(self.pieces):
                handler.send_header(f"X-Slow-{i}", "x")
                handler.flush_headers()
                self.sent += 1
                time.sleep(self.gap_s)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:  # the client hung up: what the test expects
            pass
        finally:
            self.done.set()


def _serve() -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.script, httpd.seen = {}, {}
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture(scope="module")
def server():
    """A threaded HTTP server on a free port; tests set ``script`` and read ``seen``."""
    httpd = _serve()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def other_server():
    """A second server, on another port: another origin than ``server``."""
    httpd = _serve()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def client_for(server, script: dict, **options) -> JsonClient:
    """A client of ``server`` with fast retries, the server answering by ``script``."""
    server.script, server.seen = script, {}
    return JsonClient(f"http://127.0.0.1:{server.server_port}/", backoff_s=0.01, **options)


def test_post_sends_json_and_the_api_key(server):
    """post() sends the body as JSON with the bearer key and returns the parsed answer;
    get() sends a GET."""
    client = client_for(server, {"/v1/x": [(200, {"ok": [1, 2]})]}, api_key="secret")
    assert client.post("/v1/x", {"prompt": [5, 6]}) == {"ok": [1, 2]}
    assert client.get("/v1/x") == {"ok": [1, 2]}
    first, second = server.seen["/v1/x"]
    assert (first["method"], json.loads(first["body"]), first["auth"]) == (
        "POST",
        {"prompt": [5, 6]},
        "Bearer secret",
    )
    assert second["method"] == "GET"
    assert (client.requests, client.retries) == (2, 0)


def test_lost_requests_are_sent_again(server):
    """A hang-up without an answer and a gateway's 503 are retried until an answer comes."""
    client = client_for(server, {"/v1/x": [(None, None), (503, b"starting"), (200, {"n": 3})]})
    assert client.post("/v1/x", {}) == {"n": 3}
    assert len(server.seen["/v1/x"]) == 3
    assert (client.requests, client.retries) == (1, 2)


def test_an_error_answer_is_never_retried(server):
    """A 4xx/500 is the server's answer: raised at once with its status and the message of
    an OpenAI-style error body."""
    body = {"object": "error", "message": "max_tokens must be at least 1", "code": 400}
    client = client_for(server, {"/v1/x": [(400, {"error": body})]})
    with pytest.raises(
        ServerError,
        match=r"/v1/x answered HTTP 400: max_tokens must be at "
        r"least 1$",
    ) as error:
        client.post("/v1/x", {})
    assert error.value.status == 400
    assert len(server.seen["/v1/x"]) == 1 and client.retries == 0


@pytest.mark.parametrize(
    "status, body, message",
    [
        (422, {"detail": "Field required: model"}, "HTTP 422: Field required: model"),
        (500, b"Internal Server Error", "HTTP 500: Internal Server Error"),
        (404, {"error": "no such route"}, "HTTP 404: no such route"),
    ],
)
def test_error_text_is_the_bodys_message(server, status, body, message):
    """FastAPI's ``detail``, a plain-text body and a bare ``error`` string each become the
    error's text."""
    client = client_for(server, {"/v1/x": [(status, body)]})
    with pytest.raises(ServerError, match=message):
        client.get("/v1/x")


def test_an_answer_that_is_not_json_is_an_error(server):
    """A 200 whose body is not JSON is refused, quoting the start of the body."""
    client = client_for(server, {"/v1/x": [(200, b"<html>login</html>")]})
    with pytest.raises(ServerError, match=r"something other than JSON: b'<html>login"):
        client.get("/v1/x")


def test_no_server_is_an_error_after_every_retry():
    """Nothing listening: every attempt is made, then the error names the address, the
    attempts and the last problem."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = JsonClient(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01)
    with pytest.raises(
        ServerError,
        match=rf"no answer from http://127.0.0.1:{port}/v1/models "
        r"after 3 attempts \(last: URLError: .*refused",
    ):
        client.get("/v1/models")
    assert (client.requests, client.retries) == (0, 2)


def test_timeout_is_for_the_whole_answer(server):
    """timeout_s bounds an attempt from connecting to the answer's last byte: an answer
    trickled in pieces that each come well within timeout_s, but take longer in all, is cut
    off and counts as no answer (it was accepted when the timeout was per read)."""
    client = client_for(
        server, {"/v1/slow": [(200, Trickle(pieces=12, gap_s=0.25))]}, timeout_s=1.0, max_retries=0
    )
    with pytest.raises(ServerError, match=r"no answer .* after 1 attempt \(last: TimeoutError"):
        client.get("/v1/slow")


def test_timeout_covers_headers_sent_slowly(server):
    """timeout_s bounds the status line and headers too: a server sending header lines well
    within timeout_s of each other, but past it in all, is cut off at the deadline and the
    attempt counts as no answer (it was accepted when only each read was bounded)."""
    slow = TrickleHeaders(pieces=40, gap_s=0.25)
    client = client_for(server, {"/v1/slow": [(200, slow)]}, timeout_s=1.0, max_retries=0)
    with pytest.raises(ServerError, match=r"no answer .* after 1 attempt \(last: TimeoutError"):
        client.get("/v1/slow")
    assert slow.done.wait(30)
    assert slow.sent < slow.pieces  # the client hung up mid-headers, not after all of them


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"max_retries": -1}, "max_retries must be an integer >= 0, got -1"),
        ({"timeout_s": float("nan")}, "timeout_s must be a finite number of seconds > 0"),
        (
            {"timeout_s": 1e300},
            r"timeout_s must be .* > 0, got 1e\+300 \(at most \d+\)",
        ),  # overflowed
        ({"backoff_s": -1}, "backoff_s must be a finite number of seconds >= 0"),
        ({"max_bytes": 0}, "max_bytes must be an integer >= 1, got 0"),
    ],
)
def test_bad_options_are_refused(options, problem):
    """A negative retry count (an UnboundLocalError before), a NaN timeout or a negative
    backoff is refused when the client is built."""
    with pytest.raises(ValueError, match=problem):
        JsonClient("http://127.0.0.1:9", **options)


def test_numpy_numbers_are_taken_as_options():
    """A NumPy integer retry count and NumPy float seconds are numbers like Python's (they
    were refused as 'must be an integer >= 0, got np.int64(2)'), stored as int and float."""
    import numpy as np

    client = JsonClient(
        "http://127.0.0.1:9",
        max_retries=np.int64(2),
        timeout_s=np.float32(5.0),
        backoff_s=np.int64(1),
    )
    assert (client.max_retries, client.timeout_s, client.backoff_s) == (2, 5.0, 1.0)
    assert type(client.max_retries) is int and type(client.timeout_s) is float


@pytest.mark.parametrize("root", ["ftp://127.0.0.1:21", "file:///etc", "localhost:8000"])
def test_only_http_addresses_are_taken(root):
    """An ftp:// (which hung), file:// or scheme-less address is refused, quoted."""
    with pytest.raises(ValueError, match=f"must start with http:// or https://, got '{root}'"):
        JsonClient(root)


def test_a_redirect_to_another_origin_is_refused(server, other_server):
    """A server redirecting to another address (here another port) is refused with an error
    naming both; the other server receives nothing, so not the bearer key (urllib followed
    the redirect with the Authorization header)."""
    other_server.script, other_server.seen = {"/v1/models": [(200, {"data": []})]}, {}
    elsewhere = f"http://127.0.0.1:{other_server.server_port}/v1/models"
    client = client_for(server, {"/v1/models": [(302, Redirect(302, elsewhere))]}, api_key="sk-x")
    with pytest.raises(
        ServerError,
        match=rf"127.0.0.1:{server.server_port}/v1/models "
        rf"redirected \(HTTP 302\) to {elsewhere}, on another "
        "server than",
    ):
        client.get("/v1/models")
    assert other_server.seen == {}


@pytest.mark.parametrize(
    "location",
    [
        "https://127.0.0.1:{port}/v1/y",  # another scheme
        "http://localhost:{port}/v1/y",
    ],
)  # another host name
def test_another_scheme_or_host_is_another_origin(server, location):
    """Same port, but https or another spelling of the host: another origin, refused."""
    client = client_for(server, {"/v1/x": [(301, Redirect(301, location))]}, api_key="sk-x")
    with pytest.raises(ServerError, match="on another server than"):
        client.get("/v1/x")


def test_a_same_origin_redirect_is_followed_with_the_key(server):
    """A redirect within the server (a relative Location, or its own address) is followed,
    the key sent along; a POST is repeated with its body through 307 and 308."""
    client = client_for(
        server,
        {
            "/v1/a": [(302, Redirect(302, "/v1/b"))],
            "/v1/b": [(308, Redirect(308, "http://127.0.0.1:{port}/v1/c"))],
            "/v1/c": [(200, {"ok": 1})],
        },
        api_key="sk-x",
    )
    assert client.get("/v1/a") == {"ok": 1}
    assert client.post("/v1/b", {"n": 2}) == {"ok": 1}
    posted = server.seen["/v1/c"][-1]
    assert (posted["method"], json.loads(posted["body"]), posted["auth"]) == (
        "POST",
        {"n": 2},
        "Bearer sk-x",
    )
    assert client.retries == 0


def test_redirects_are_limited(server):
    """A redirect loop stops after a few hops with an error saying so (not a retry)."""
    client = client_for(server, {"/v1/loop": [(307, Redirect(307, "/v1/loop"))]})
    with pytest.raises(ServerError, match=r"after 3 redirects already: refused \(a loop\?\)"):
        client.get("/v1/loop")
    assert len(server.seen["/v1/loop"]) == 4


def test_a_post_redirected_without_its_body_is_refused(server):
    """A POST answered 302/303 would be repeated as a GET without its body: refused."""
    client = client_for(server, {"/v1/p": [(303, Redirect(303, "/v1/q"))]})
    with pytest.raises(
        ServerError,
        match=r"answered a POST with HTTP 303 to .*/v1/q, which "
        "would drop its body",
    ):
        client.post("/v1/p", {"n": 1})
    assert "/v1/q" not in server.seen


@pytest.mark.parametrize("declared", [None, 300 << 20], ids=["streamed", "declared"])
def test_an_answer_past_its_size_cap_is_refused_unread(server, declared):
    """An answer larger than max_bytes is a ServerError naming the server, once its
    Content-Length says so or once that many bytes came: the client hangs up after reading
    about the cap (it read a swelling answer to its end, 300 MiB held in memory)."""
    swell = Swell(declared=declared)
    client = client_for(
        server, {"/v1/big": [(200, swell)]}, max_retries=0, timeout_s=60, max_bytes=1 << 20
    )
    with pytest.raises(
        ServerError,
        match=rf"127.0.0.1:{server.server_port}/v1/big answered "
        r".*more than the 1,048,576 bytes an answer to this "
        "request may take",
    ):
        client.get("/v1/big")
    assert swell.done.wait(30)
    assert swell.sent < 16 << 20  # the cap, and what the sockets' buffers held


def test_a_request_may_set_its_own_cap(server):
    """post/get take the cap of their own answer: an answer within the client's cap but
    past the request's is refused; the same answer passes the client's cap."""
    client = client_for(server, {"/v1/x": [(200, {"n": list(range(100))})]})
    with pytest.raises(ServerError, match="more than the 100 bytes"):
        client.post("/v1/x", {}, max_bytes=100)
    assert client.post("/v1/x", {})["n"][-1] == 99


def test_an_error_answer_is_read_in_part(server):
    """An HTTP 500 with an endless body gives an error quoting its start, and its body is
    read only in part (it was read to its end)."""
    swell = Swell(500)
    client = client_for(server, {"/v1/err": [(500, swell)]}, max_retries=0, timeout_s=60)
    with pytest.raises(ServerError, match=r"answered HTTP 500: \{\"x\": \"aaa"):
        client.get("/v1/err")
    assert swell.done.wait(30)
    assert swell.sent < 16 << 20


@pytest.mark.parametrize(
    "root", ["http://user:s3cret@127.0.0.1:9", "https://s3cret@host/v1", "ftp://user:s3cret@host"]
)
def test_credentials_in_the_address_are_refused_unrepeated(root):
    """An address with user:password@ (or a bare key@) is refused, and the error does not
    repeat the credentials (it quoted the whole address)."""
    with pytest.raises(ValueError, match="holds credentials") as error:
        JsonClient(root)
    assert "s3cret" not in str(error.value)
