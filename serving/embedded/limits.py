"""Limits of the embedded HTTP server, and the ASGI/HTTP guards that enforce them.

One bad or slow client must not hurt the others, and memory must stay bounded whatever a client
sends. Defaults are sized like SGLang's / vLLM's servers would need (a body far larger than any
prompt the device pool can hold is refused; nothing a well-behaved OpenAI client sends is):

- ``max_body_bytes`` (8 MiB): ``Content-Length`` above it -> 413 without reading the body; a
  chunked body is counted as it arrives and cut at the limit.
- ``max_json_depth`` (64): deeper JSON -> 400 (Python's parser would raise ``RecursionError``).
- ``timeout_headers_s`` (10 s): a connection must deliver a request's headers this soon after it
  opens or after its previous response (slowloris); then it is closed.
  ``timeout_read_s`` (30 s): the whole body must arrive within this -> else 408, closed.
- header values of every response are made legal (printable ASCII, no surrounding whitespace,
  at most ``MAX_HEADER_VALUE`` characters), so a response is never refused by the HTTP layer;
  an exception that escapes the app before the response started becomes a 500 JSON error.

The per-request token limits (``--max-prompt-tokens``) live in the engine (it owns the
tokenizer); the hint registry's bounds in :class:`~kvflow_agents.serving.policy.hints.HintRegistry`.

Pieces: :class:`ServerLimits` (the numbers), :func:`parse_json_body` (strict UTF-8 JSON, depth,
lone surrogates), :class:`LimitsMiddleware` (pure ASGI: body size and read timeout, header
hygiene, last-resort 500) and :func:`guarded_protocol` (uvicorn's httptools or h11 protocol plus
the header timeout; ``uvicorn.Config(http=guarded_protocol(limits, "auto"))``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

log = logging.getLogger("kvflow.server")

MAX_HEADER_VALUE = 512
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 64
    timeout_headers_s: float = 10.0
    timeout_read_s: float = 30.0

    def validate(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_json_depth < 4:
            raise ValueError("max_json_depth must be >= 4")
        if not (self.timeout_headers_s > 0 and self.timeout_read_s > 0):
            raise ValueError("timeouts must be > 0")


class BodyError(ValueError):
    """A request body the server will not parse: ``status`` 400 / 413, ``param`` the JSON path."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


# ---------------------------------------------------------------- JSON bodies
def parse_json_body(raw: bytes, *, max_depth: int = 64, skip: Iterable[str] = ()) -> Any:
    """Strict JSON: UTF-8 without a byte order mark (as OpenAI's API), at most ``max_depth``
    levels, and no lone surrogate (``"\\ud800"``) in any string or key outside the top-level
    keys in ``skip`` (there, e.g. in hints, the consumer validates). Raises :class:`BodyError`."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raise BodyError("invalid JSON body: it starts with a UTF-8 byte order mark")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"invalid JSON body: not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BodyError(f"invalid JSON body: nested deeper than {max_depth} levels") from None
    except ValueError as e:
        raise BodyError(f"invalid JSON body: {e}") from None
    check_json(body, max_depth=max_depth, skip=skip)
    return body


def check_json(body: Any, *, max_depth: int = 64, skip: Iterable[str] = ()) -> None:
    """Depth and lone-surrogate check of a parsed JSON value, iteratively (no recursion)."""
    skip = set(skip)
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                raise BodyError(f"{_path(path) or 'body'}: a string holds a lone surrogate, which is "
                                "not valid Unicode", param=_path(path) or None)
            continue
        if isinstance(v, (dict, list)):
            if depth > max_depth:
                raise BodyError(f"invalid JSON body: nested deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, x in v.items():
                    if not path and k in skip:
                        continue
                    if not k.isascii() and _SURROGATE.search(k):
                        raise BodyError(f"{_path(path + (k.encode('ascii', 'backslashreplace').decode(),))}"
                                        ": a key holds a lone surrogate", param=_path(path) or None)
                    if isinstance(x, (str, dict, list)):
                        stack.append((x, path + (k,), depth + 1))
            else:
                for i, x in enumerate(v):
                    if isinstance(x, (str, dict, list)):
                        stack.append((x, path + (i,), depth + 1))


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def json_bytes(obj: Any) -> bytes:
    """JSON that always encodes: a stray lone surrogate becomes a ``\\udXXX`` escape."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8", "backslashreplace")


# ---------------------------------------------------------------- headers
_BAD_HEADER_CHARS = re.compile(r"[^\x21-\x7e ]")


def header_value(value: "str | bytes", limit: int = MAX_HEADER_VALUE) -> bytes:
    """A header value h11 accepts: printable ASCII, inner spaces only, bounded. Non-ASCII is
    escaped (``\\xNN``, ``\\uNNNN``) so it stays readable."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    s = value.encode("ascii", "backslashreplace").decode("ascii")
    s = _BAD_HEADER_CHARS.sub(" ", s)
    if len(s) > limit:
        s = s[:limit - 3].rstrip() + "..."
    return s.strip().encode("ascii")


def _is_legal(value: bytes) -> bool:
    return (len(value) <= 8 * MAX_HEADER_VALUE and value == value.strip()
            and not re.search(rb"[^\x20-\x7e\x80-\xff\t]", value))


# ---------------------------------------------------------------- ASGI middleware
class LimitsMiddleware:
    """Pure ASGI middleware (no ``BaseHTTPMiddleware``: streams pass straight through).

    For requests with a body: refuses ``Content-Length`` over the limit (413) before reading;
    reads the body with the size limit (413) and ``timeout_read_s`` (408), then replays it to
    the app, whose later ``receive`` calls (disconnect detection) go to the client as usual.
    For every response: header values are made legal; an exception before the response started
    becomes a 500 with OpenAI's error shape (after it started, the connection is closed)."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def guarded_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = message.get("headers") or []
                if not all(_is_legal(bytes(v)) for _, v in headers):
                    message = {**message, "headers": [
                        (k, bytes(v) if _is_legal(bytes(v)) else header_value(bytes(v)))
                        for k, v in headers]}
            await send(message)

        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, guarded_send)
            if body is None:
                return
            receive = replay_body(body, receive)
        try:
            await self.app(scope, receive, guarded_send)
        except Exception:  # noqa: BLE001 - the app's own handlers missed it
            log.exception("unhandled error on %s", scope.get("path"))
            if not started:
                await _error(guarded_send, 500, "internal server error", "server_error")

    async def _read_body(self, scope, receive, send) -> Optional[bytes]:
        lim = self.limits
        length = None
        for k, v in scope.get("headers") or ():
            if k == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    await _error(send, 400, "invalid Content-Length header", close=True)
                    return None
        if length is not None and length > lim.max_body_bytes:
            await _error(send, 413, f"request body is {length} bytes; this server takes at most "
                         f"{lim.max_body_bytes} (--max-body-bytes)", close=True)
            return None
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.timeout_read_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _error(send, 408, f"request body not received within {lim.timeout_read_s:g} s",
                             close=True)
                return None
            if msg["type"] == "http.disconnect":
                return None
            part = msg.get("body", b"")
            size += len(part)
            if size > lim.max_body_bytes:
                await _error(send, 413, f"request body is over {lim.max_body_bytes} bytes "
                             "(--max-body-bytes)", close=True)
                return None
            chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)


def replay_body(body: bytes, receive):
    """An ASGI ``receive`` that first returns ``body`` whole (read already), then defers to
    ``receive`` (disconnect detection)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _error(send, status: int, message: str, type: str = "invalid_request_error",
                 close: bool = False) -> None:
    body = json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- uvicorn protocol
HTTP_IMPLEMENTATIONS = ("auto", "httptools", "h11")


def resolve_http(http: str) -> str:
    """``auto`` as uvicorn resolves it: httptools (C parser, llhttp) when installed, else h11
    (pure Python). Raises ``ValueError`` for an unknown name or httptools asked for and missing."""
    import importlib.util

    if http not in HTTP_IMPLEMENTATIONS:
        raise ValueError(f"{http!r}: use {', '.join(HTTP_IMPLEMENTATIONS)}")
    installed = importlib.util.find_spec("httptools") is not None
    if http == "httptools" and not installed:
        raise ValueError("httptools is not installed (pip install httptools, or h11)")
    return "httptools" if http == "httptools" or (http == "auto" and installed) else "h11"


def guarded_protocol(limits: ServerLimits, http: str = "auto"):
    """uvicorn's HTTP/1.1 protocol class (``http``: see :func:`resolve_http`) with the header
    timeout: a connection that has not sent a complete request head ``timeout_headers_s`` after
    it opened (or after its last response) is closed. ``uvicorn.Config(http=...)``.

    httptools is the default where it is installed: the event loop shares the GIL with the
    engine thread, and every CPU second it spends parsing requests and framing SSE chunks in
    Python (h11) is one the engine waits (bench/RESULTS.md 6.36, 6.38)."""
    impl = resolve_http(http)
    return guarded_httptools_protocol(limits) if impl == "httptools" else guarded_h11_protocol(limits)


class _HeadTimer:
    """The header-timeout timer both protocol classes share (mixed in before uvicorn's class:
    uses its ``loop`` and ``transport``). ``_head_pending()`` says whether the connection still
    owes a complete request head when the timer fires."""

    _head_timer: Optional[asyncio.TimerHandle] = None
    _head_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:  # a new connection owes its first head
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_timeout)  # type: ignore[attr-defined]

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if self._head_pending() and not transport.is_closing():
            # no request head in time (slow or idle client): close, as a keep-alive timeout
            transport.close()

    def _head_pending(self) -> bool:
        raise NotImplementedError


def guarded_h11_protocol(limits: ServerLimits):
    """uvicorn's h11 protocol class with the header timeout (see :func:`guarded_protocol`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(_HeadTimer, H11Protocol):
        _head_timeout_s = limits.timeout_headers_s

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state in (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()

        def _head_pending(self) -> bool:
            return self.conn.their_state is h11.IDLE

    return GuardedH11Protocol


def guarded_httptools_protocol(limits: ServerLimits):
    """uvicorn's httptools protocol class with the header timeout (see :func:`guarded_protocol`).
    The timer is disarmed when a request's head is complete (``on_headers_complete``) and armed
    again when a response completes with no pipelined request waiting."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_HeadTimer, HttpToolsProtocol):
        _head_timeout_s = limits.timeout_headers_s
        _head_done = False  # the current request's head is complete

        def on_message_begin(self) -> None:
            self._head_done = False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_done = True
            self._disarm_head_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # a waiting request's head is already complete
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._head_done = False
                self._arm_head_timer()

        def _head_pending(self) -> bool:
            return not self._head_done

    return GuardedHttpToolsProtocol
