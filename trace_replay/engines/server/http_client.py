"""A small JSON-over-HTTP client for a vLLM server, retrying what the network loses: the one
client every call to a server goes through.

Standard library only (``urllib``), so the server engine adds no dependency. A request is
sent again only when no answer came back: the connection was refused, reset or timed out,
or a proxy answered 502/503/504. Any other HTTP error is the server's answer and is raised
with its message. Only ``http://`` and ``https://`` addresses are taken.

Requests go to the server's own origin (scheme, host, port) and nowhere else: a redirect
there is followed (at most :data:`MAX_REDIRECTS` of them, a POST only through 307/308,
which keep its body), a redirect to another origin is a :class:`ServerError` naming both
addresses, so the API key and the traces never reach a server that was not named.

An answer is read up to a size cap and within ``timeout_s``: a request may pass the cap
its answer can take (the server engine sizes it by the trace asked for,
:func:`~trace_replay.engines.server.responses.answer_bytes`), else ``max_bytes``
(:data:`MAX_ANSWER_BYTES`). A larger answer is a :class:`ServerError` naming the server, once
its ``Content-Length`` says so or once that many bytes came, never after reading the rest;
an error answer's message is read up to 64 KiB.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import numbers
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["MAX_ANSWER_BYTES", "MAX_REDIRECTS", "JsonClient", "ServerError"]

MAX_REDIRECTS = 3  # same-origin redirects followed per request
MAX_ANSWER_BYTES = 16 << 20  # an answer's size, where a request does not say what it may take
_ERROR_BYTES = 64 << 10  # of an error answer's body, for its message
_RETRY_STATUS = {502, 503, 504}  # a gateway or a server still starting: nothing was done
_REDIRECT_STATUS = {301, 302, 303, 307, 308}
_KEEP_BODY = {307, 308}  # redirects that repeat the request as it was, POST body included
_MAX_BACKOFF_S = 30.0
_CHUNK = 1 << 16  # bytes asked per read of an answer


class ServerError(RuntimeError):
    """The server answered with an error, or did not answer after every retry."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class JsonClient:
    """POST and GET JSON under ``root`` (``http://host:port``), thread-safe.

    Parameters
    ----------
    root
        The server's address, ``http://`` or ``https://``, without a path.
    api_key
        Sent as ``Authorization: Bearer …`` (``vllm serve --api-key``).
    timeout_s
        The most one attempt may take, from connecting to the last byte of the answer (a
        server sending its answer slowly is cut off too, then retried); a long trace on a busy
        server needs minutes.
    max_retries
        Attempts after the first one (an integer >= 0) for requests that got no answer;
        waits double from ``backoff_s`` up to 30 s.
    max_bytes
        The most bytes an answer may take, where ``get``/``post`` do not say.

    Raises
    ------
    ValueError
        For an address that is not http(s) or holds credentials (``user:password@``; the
        error does not repeat them), or a bad ``timeout_s``, ``max_retries``,
        ``backoff_s`` or ``max_bytes``, before anything is sent.
    """

    root: str
    headers: dict[str, str]
    timeout_s: float
    max_retries: int
    backoff_s: float
    max_bytes: int
    requests: int
    retries: int
    _lock: threading.Lock

    def __init__(
        self,
        root: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        if _has_credentials(root):  # said without repeating them: errors and logs are read
            raise ValueError(
                "the server's address holds credentials (user:password@host), "
                "which would travel in clear and be repeated in errors: give it "
                "without them, and the key as api_key (--engine-arg api_key=… or "
                "$VLLM_API_KEY; vllm serve --api-key)"
            )
        if not isinstance(root, str) or not root.lower().startswith(("http://", "https://")):
            raise ValueError(
                f"the server's address must start with http:// or https://, got {root!r}"
            )
        if (
            isinstance(max_retries, bool)
            or not isinstance(max_retries, numbers.Integral)
            or max_retries < 0
        ):
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        _check_seconds("timeout_s", timeout_s, zero=False)
        _check_seconds("backoff_s", backoff_s, zero=True)
        _check_bytes(max_bytes)
        self.root = root.rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_bytes = int(max_bytes)
        self.requests = 0
        self.retries = 0
        self._lock = threading.Lock()

    def get(self, path: str, *, max_bytes: int | None = None) -> Any:
        """The JSON answer to ``GET path``; ``max_bytes``: the most it may take
        (``None``: the client's ``max_bytes``)."""
        return self._send(path, None, max_bytes)

    def post(self, path: str, body: dict, *, max_bytes: int | None = None) -> Any:
        """The JSON answer to ``POST path`` with ``body``; ``max_bytes`` as for ``get``."""
        return self._send(path, json.dumps(body).encode(), max_bytes)

    def _send(self, path: str, data: bytes | None, max_bytes: int | None) -> Any:
        limit = self.max_bytes if max_bytes is None else _check_bytes(max_bytes)
        url, hops, attempt = self.root + path, 0, 0
        while True:
            request = urllib.request.Request(
                url, data=data, headers=self.headers, method="GET" if data is None else "POST"
            )
            deadline = time.monotonic() + self.timeout_s
            watchdog = _Watchdog(deadline)
            try:
                with watchdog.opener().open(request, timeout=self.timeout_s) as response:
                    watchdog.cancel()  # the headers came; _read_until bounds the body
                    payload = _read_until(response, deadline, limit, url)
            except urllib.error.HTTPError as error:
                if error.code in _REDIRECT_STATUS and error.headers.get("Location"):
                    url, hops = self._redirect(url, error, data, hops), hops + 1
                    continue  # a redirect is an answer, not a lost attempt
                lost = error.code in _RETRY_STATUS
                problem = f"HTTP {error.code}: {_error_message(error)}"
                if not lost:
                    raise ServerError(f"{url} answered {problem}", error.code) from None
            except (
                urllib.error.URLError,
                ConnectionError,
                TimeoutError,
                http.client.HTTPException,
            ) as error:
                reason = getattr(error, "reason", error)
                problem = f"{type(error).__name__}: {reason}"
                if isinstance(reason, TimeoutError) or watchdog.fired:
                    problem = (
                        f"TimeoutError: {reason}"
                        if isinstance(reason, TimeoutError)
                        else "TimeoutError: cut off at the deadline"
                    )
                    problem += f" (timeout_s={self.timeout_s} for the whole answer)"
            else:
                with self._lock:
                    self.requests += 1
                try:
                    return json.loads(payload)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ServerError(
                        f"{url} answered with something other than JSON: {payload[:200]!r}"
                    ) from None
            finally:
                watchdog.cancel()
            if attempt == self.max_retries:
                break
            with self._lock:
                self.retries += 1
            time.sleep(min(self.backoff_s * 2**attempt, _MAX_BACKOFF_S))
            attempt += 1
        attempts = self.max_retries + 1
        raise ServerError(
            f"no answer from {url} after {attempts} attempt"
            f"{'s' if attempts > 1 else ''} (last: {problem})"
        )

    def _redirect(
        self, url: str, error: urllib.error.HTTPError, data: bytes | None, hops: int
    ) -> str:
        """Where the redirect ``error`` (an answer to ``url``) leads, when it may be followed:
        to this server's origin, within :data:`MAX_REDIRECTS`, a POST only by 307/308
        (the others would drop its body); else a ServerError naming both addresses."""
        error.close()
        target = urllib.parse.urljoin(url, error.headers["Location"].strip())
        if _origin(target) != _origin(self.root):
            raise ServerError(
                f"{url} redirected (HTTP {error.code}) to {target}, on another "
                f"server than {self.root}: refused, so that the API key and "
                "the traces go only to the server named (set base_url to the "
                "server that answers)",
                error.code,
            )
        if hops >= MAX_REDIRECTS:
            raise ServerError(
                f"{url} redirected (HTTP {error.code}) to {target} after "
                f"{MAX_REDIRECTS} redirects already: refused (a loop?)",
                error.code,
            )
        if data is not None and error.code not in _KEEP_BODY:
            raise ServerError(
                f"{url} answered a POST with HTTP {error.code} to {target}, "
                "which would drop its body: refused (only 307 and 308 keep it)",
                error.code,
            )
        return target


def _has_credentials(root: Any) -> bool:
    """Whether ``root`` is an address with a user (and password) before its host."""
    try:
        return isinstance(root, str) and "@" in urllib.parse.urlsplit(root.strip()).netloc
    except ValueError:  # not an address at all: refused as one
        return False


def _origin(url: str) -> tuple[str, str, int | None] | None:
    """The scheme, host and port of ``url`` (a default port filled in); None when its port
    cannot be read, an origin equal to none."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        return None
    return scheme, (parts.hostname or "").lower(), port


def _check_bytes(value: Any) -> int:
    """``value`` as an int when it is a size cap (an integer >= 1), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"max_bytes must be an integer >= 1, got {value!r}")
    return int(value)


def _check_seconds(name: str, value: Any, *, zero: bool) -> None:
    """Raise a `ValueError` unless ``value`` is a number of seconds a timer can wait."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if (
        number
        and math.isfinite(value)
        and (value > 0 or zero and value == 0)
        and value <= threading.TIMEOUT_MAX
    ):
        return
    too_long = number and math.isfinite(value) and value > threading.TIMEOUT_MAX
    most = f" (at most {threading.TIMEOUT_MAX:.0f})" if too_long else ""
    raise ValueError(
        f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r}{most}"
    )


class _Watchdog:
    """Shuts the sockets of one attempt down when its deadline passes.

    A socket's timeout bounds each read, and restarts with every byte: a server sending its
    status line and headers slowly would stretch an attempt without end. The body is read by
    :func:`_read_until`; this bounds what comes before it (connecting, sending, headers).
    """

    def __init__(self, deadline: float) -> None:
        self.deadline, self.fired = deadline, False
        self._timers: list[threading.Timer] = []

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib's default opener, but for connections watched by this watchdog."""
        watched = functools.partial(_WatchedHTTP, watchdog=self)
        watched_tls = functools.partial(_WatchedHTTPS, watchdog=self)

        class Plain(urllib.request.HTTPHandler):
            def http_open(self, req):
                return self.do_open(watched, req)

        class Tls(urllib.request.HTTPSHandler):
            def https_open(self, req):
                return self.do_open(watched_tls, req, context=self._context)

        return urllib.request.build_opener(Plain, Tls, _Unfollowed)

    def watch(self, sock: socket.socket) -> None:
        timer = threading.Timer(max(self.deadline - time.monotonic(), 0.0), self._cut, (sock,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def cancel(self) -> None:
        for timer in self._timers:
            timer.cancel()

    def _cut(self, sock: socket.socket) -> None:
        self.fired = True
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read, which then sees the end
        except OSError:
            pass  # already closed


class _Unfollowed(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: urllib's own would send the API key to any address a server
    names. A redirect comes back as an ``HTTPError`` for :meth:`JsonClient._redirect`."""

    def http_error_302(self, req, fp, code, msg, headers):  # noqa: ANN001 - urllib's signature
        return None  # urllib then raises the answer as an HTTPError

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


class _Watched(http.client.HTTPConnection):
    """A connection whose socket its watchdog shuts at the attempt's deadline."""

    def __init__(self, *args: Any, watchdog: _Watchdog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watchdog = watchdog

    def connect(self) -> None:
        super().connect()
        self.watchdog.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


def _read_until(response: http.client.HTTPResponse, deadline: float, limit: int, url: str) -> bytes:
    """The whole body of ``response``, or :class:`TimeoutError` once ``deadline`` passes, or
    a :class:`ServerError` naming ``url`` once it says or shows it is over ``limit`` bytes.

    Each read waits at most the time left (the socket's timeout is set to it), so a server
    trickling its answer cannot stretch an attempt past its deadline.
    """

    def too_large(size: str) -> ServerError:
        return ServerError(
            f"{url} answered {size}more than the {limit:,} bytes an answer to "
            "this request may take: refused without reading the rest"
        )

    declared = response.headers.get("Content-Length", "")
    if declared.strip().isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared):,} bytes (its Content-Length), ")
    sock = getattr(getattr(response.fp, "raw", None), "_sock", None)  # the answer's socket
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the whole answer did not come within timeout_s")
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(min(_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise too_large("")


def _error_message(error: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    body = error.read(_ERROR_BYTES)
    try:
        detail = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode(errors="replace") or str(error.reason)
    inner = detail.get("error", detail) if isinstance(detail, dict) else detail
    if isinstance(inner, dict):
        return str(inner.get("message") or inner.get("detail") or inner)
    return str(inner)
