"""A small JSON-over-HTTP client for a vLLM server, retrying what the network loses.

Standard library only (``urllib``), so the server engine adds no dependency. A request is
sent again only when no answer came back: the connection was refused, reset or timed out,
or a proxy answered 502/503/504. Any other HTTP error is the server's answer and is raised
with its message.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["JsonClient", "ServerError"]

_RETRY_STATUS = {502, 503, 504}  # a gateway or a server still starting: nothing was done
_MAX_BACKOFF_S = 30.0


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
        The server's address, without a path.
    api_key
        Sent as ``Authorization: Bearer …`` (``vllm serve --api-key``).
    timeout_s
        Per attempt; a long trace on a busy server needs minutes.
    max_retries
        Attempts after the first one for requests that got no answer; waits double from
        ``backoff_s`` up to 30 s.
    """

    def __init__(self, root: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 max_retries: int = 5, backoff_s: float = 0.5) -> None:
        self.root = root.rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.requests = 0
        self.retries = 0
        self._lock = threading.Lock()

    def get(self, path: str) -> Any:
        return self._send(path, None)

    def post(self, path: str, body: dict) -> Any:
        return self._send(path, json.dumps(body).encode())

    def _send(self, path: str, data: bytes | None) -> Any:
        url = self.root + path
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(url, data=data, headers=self.headers,
                                             method="GET" if data is None else "POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    payload = response.read()
            except urllib.error.HTTPError as error:
                lost = error.code in _RETRY_STATUS
                problem = f"HTTP {error.code}: {_error_message(error)}"
                if not lost:
                    raise ServerError(f"{url} answered {problem}", error.code) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError,
                    http.client.HTTPException) as error:
                problem = f"{type(error).__name__}: {getattr(error, 'reason', error)}"
            else:
                with self._lock:
                    self.requests += 1
                try:
                    return json.loads(payload)
                except json.JSONDecodeError:
                    raise ServerError(f"{url} answered with something other than JSON: "
                                      f"{payload[:200]!r}") from None
            if attempt == self.max_retries:
                break
            with self._lock:
                self.retries += 1
            time.sleep(min(self.backoff_s * 2 ** attempt, _MAX_BACKOFF_S))
        raise ServerError(f"no answer from {url} after {self.max_retries + 1} attempts "
                          f"(last: {problem})")


def _error_message(error: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-style error body, else the body's start."""
    body = error.read()
    try:
        detail = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode(errors="replace") or str(error.reason)
    inner = detail.get("error", detail) if isinstance(detail, dict) else detail
    if isinstance(inner, dict):
        return str(inner.get("message") or inner.get("detail") or inner)
    return str(inner)
