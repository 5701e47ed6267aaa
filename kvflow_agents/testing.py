"""A recording OpenAI-compatible stub server on 127.0.0.1, for tests and overhead benchmarks.

It speaks just enough of the OpenAI API for real clients (``openai``, ``ChatOpenAI``, AutoGen's
``OpenAIChatCompletionClient``): ``POST /v1/chat/completions`` (plain and ``stream=true``),
``POST /v1/completions``, ``GET /v1/models`` and the kvflow out-of-band ``POST /kvflow/v1/hints``.
Every request is recorded (path, headers, JSON body) so tests can assert what was *sent over
the wire*, not what a mock saw.

    with RecordingOpenAIServer() as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        ...
        srv.requests[0].body["custom_params"]["kvflow_agent"]

The reply can be chosen per request with ``reply=callable(body)``: a ``str`` (the content), or a
``dict`` message (``{"content": ..., "tool_calls": [...]}``, non-streamed chat only) for replies
that call tools (``finish_reason`` is then ``"tool_calls"``).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
               what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy and return that; ``AssertionError``
    after ``timeout`` seconds (for tests that wait on a server's background work)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    time: float = field(default_factory=time.monotonic)

    @property
    def hints(self) -> Optional[dict[str, Any]]:
        """The ``kvflow_*`` keys of ``custom_params`` (or of the body, for the hint endpoint)."""
        src = self.body if self.path.startswith("/kvflow/") else (self.body or {}).get("custom_params")
        if not isinstance(src, dict):
            return None
        got = {k: v for k, v in src.items() if k.startswith("kvflow_")}
        return got or None


def _default_reply(body: dict[str, Any]) -> str:
    return "ok"


class RecordingOpenAIServer:
    def __init__(self, reply: Callable[[dict[str, Any]], str] = _default_reply,
                 host: str = "127.0.0.1", port: int = 0, record: bool = True) -> None:
        self.reply = reply
        self.record = record
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms to every keep-alive reply

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _read_json(self) -> Any:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    return json.loads(raw) if raw else None
                except ValueError:
                    return {"_raw": raw.decode("utf-8", "replace")}

            def _send(self, code: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                server._log("GET", self.path, dict(self.headers), None)
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "kvflow"}]})
                elif self.path == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def do_POST(self) -> None:  # noqa: N802
                body = self._read_json()
                server._log("POST", self.path, dict(self.headers), body)
                path = self.path.rstrip("/")
                if path.endswith("/kvflow/v1/hints"):
                    self._send(200, {"accepted": True})
                    return
                if not isinstance(body, dict):
                    self._send(400, {"error": {"message": "body must be a JSON object", "type": "invalid_request_error"}})
                    return
                text = server.reply(body)
                model = body.get("model", "stub")
                if path.endswith("/chat/completions"):
                    if body.get("stream"):
                        self._stream_chat(text if isinstance(text, str) else text.get("content") or "", model, body)
                    else:
                        msg = {"role": "assistant", **text} if isinstance(text, dict) else \
                            {"role": "assistant", "content": text}
                        self._send(200, {
                            "id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()),
                            "model": model,
                            "choices": [{"index": 0, "finish_reason": "tool_calls" if msg.get("tool_calls") else "stop",
                                         "message": msg}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                elif path.endswith("/completions"):
                    self._send(200, {
                        "id": "cmpl-stub", "object": "text_completion", "created": int(time.time()),
                        "model": model, "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def _stream_chat(self, text: str, model: str, body: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()

                def chunk(delta: dict[str, Any], finish: Optional[str] = None) -> None:
                    doc = {"id": "chatcmpl-stub", "object": "chat.completion.chunk",
                           "created": int(time.time()), "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    self._chunk(f"data: {json.dumps(doc)}\n\n".encode())

                chunk({"role": "assistant", "content": ""})
                for word in text.split(" "):
                    chunk({"content": word + " "})
                chunk({}, "stop")
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    def _log(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        if self.record:
            with self._lock:
                self.requests.append(RecordedRequest(method, path, {k.lower(): v for k, v in headers.items()}, body))

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def llm_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.path.rstrip("/").endswith("completions")]

    def hint_posts(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.path.startswith("/kvflow/")]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def start(self) -> "RecordingOpenAIServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kvflow-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "RecordingOpenAIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
