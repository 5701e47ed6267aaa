"""Out-of-band hints: transitions that send no LLM request (tool nodes, the end of a run).

``POST {server}/kvflow/v1/hints`` with the flat ``custom_params`` dict of :class:`Hints` plus
``kvflow_event`` (``"transition"`` or ``"end"``; ``"end"`` releases the workflow), with the
workflow id in ``x-smg-routing-key``. A gateway (SGLang's ``sglang-router`` / ``smg``) forwards no
such route and answers 404: from then on that server gets the same event as a *hint-only
completion* (:func:`kvflow_agents.protocol.hint_only_completion`, ``POST /v1/completions`` with
the app's model name), which the gateway routes by the routing key to the instance holding the
workflow, and which a kvflow server answers without running the model.

Best effort by design: :meth:`HintReporter.report` only puts the hints on a bounded queue
(dropping them when it is full) and returns at once; one daemon thread posts them (connect
timeout 1 s, answer timeout 10 s) and logs failures at debug level. Nothing here blocks or
fails the user's run.

Where is the server? ``HintReporter(base_url)`` when given (``instrument(graph,
hints_url=...)``); otherwise the server the app's own LLM requests went to, which the transport
and :mod:`kvflow_agents.autopatch` record with :func:`note_server` (per app id, then the last
one seen). ``base_url`` may be the OpenAI base (``http://host:port/v1``) or the server root.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
from typing import Any, Optional

# Imported here, not in the poster thread: openai 3 peeks at sys.modules["httpx"] on every
# request, and a request built while another thread is half-way through importing httpx fails.
import httpx

from .protocol import HEADER_ROUTING_KEY, Hints, hint_only_completion

log = logging.getLogger("kvflow_agents")

HINTS_PATH = "/kvflow/v1/hints"
CARRIER_PATH = "/v1/completions"
QUEUE_SIZE = 1024
# A hint answers in microseconds, but a server (or the gateway before it) on a saturated host can
# take seconds; the thread posts in the background, so waiting costs only queue delay, while a
# give-up loses the event (an ``end`` then leaves the workflow's cache held until it expires).
POST_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 1.0   # a server that is down refuses at once; don't let it stall the queue

_servers: dict[str, str] = {}  # app id (or "" for any) -> server root
_servers_lock = threading.Lock()


def server_root(url: str) -> str:
    """``http://h:p/v1/chat/completions`` or ``http://h:p/v1`` -> ``http://h:p``."""
    url = url.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    for suffix in ("/chat/completions", "/completions", HINTS_PATH):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
            break
    if url.endswith("/v1"):
        url = url[:-3]
    return url.rstrip("/")


_root_cache: dict[str, str] = {}


_auth: dict[str, str] = {}  # server root -> the Authorization header the app's LLM requests use
_models: dict[str, str] = {}  # server root -> a model name its LLM requests use (for carriers)
_carrier_roots: set[str] = set()  # servers without /kvflow/v1/hints (gateways): use carriers


def note_server(hints: Optional[Hints], url: str, authorization: Optional[str] = None,
                model: Optional[str] = None) -> None:
    """Record where an app's LLM requests go (called per hinted request; cheap), how they
    authenticate (a server started with ``--api-key`` requires the key on the hint endpoint
    too) and which model they name (a gateway needs it on a hint-only completion)."""
    root = _root_cache.get(url)
    if root is None:
        root = server_root(url)
        if len(_root_cache) < 1024:
            _root_cache[url] = root
    if authorization and _auth.get(root) != authorization and len(_auth) < 1024:
        _auth[root] = authorization
    if isinstance(model, str) and model and _models.get(root) != model and len(_models) < 1024:
        _models[root] = model
    if hints is not None and hints.app is not None and _servers.get(hints.app) != root:
        with _servers_lock:
            _servers[hints.app] = root
    if _servers.get("") != root:
        with _servers_lock:
            _servers[""] = root


def server_for(app: Optional[str]) -> Optional[str]:
    if app is not None and app in _servers:
        return _servers[app]
    return _servers.get("")


class _Poster:
    """One daemon thread and one bounded queue shared by every reporter."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple | None] = queue.Queue(QUEUE_SIZE)
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: Optional[str] = None   # the last failure, for diagnostics
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._client: Any = None

    def submit(self, url: str, body: bytes, hints: Optional[Hints] = None, event: str = "transition") -> bool:
        """Queue ``body`` for ``url``; with ``hints``, a server that has no hint endpoint (404)
        gets them as a hint-only completion instead."""
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="kvflow-oob", daemon=True)
                    self._thread.start()
        try:
            self.queue.put_nowait((url, body, hints, event))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        self._client = httpx.Client(timeout=httpx.Timeout(POST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                url, body, hints, event = item
                try:
                    root = server_root(url)
                    headers = {"content-type": "application/json"}
                    auth = _auth.get(root)
                    if auth:
                        headers["authorization"] = auth
                    if hints is not None:
                        headers[HEADER_ROUTING_KEY] = hints.headers()[HEADER_ROUTING_KEY]
                    r = None
                    if hints is None or root not in _carrier_roots:
                        r = self._post(url, content=body, headers=headers)
                    if hints is not None and (r is None or r.status_code in (404, 405)):
                        if r is not None:
                            log.debug("kvflow: %s has no hint endpoint (a gateway?): sending "
                                      "out-of-band hints as hint-only completions", root)
                            _carrier_roots.add(root)
                        carrier = hint_only_completion(hints, event, _models.get(root) or "default")
                        r = self._post(root + CARRIER_PATH, json=carrier, headers=headers)
                    if r.status_code >= 400:
                        self.failed += 1
                        self.last_error = f"{r.request.url} answered {r.status_code}"
                        log.debug("kvflow: hint endpoint %s answered %s", url, r.status_code)
                    else:
                        self.sent += 1
                except Exception as e:  # noqa: BLE001 — best effort
                    self.failed += 1
                    self.last_error = f"{url}: {type(e).__name__}: {e}"
                    log.debug("kvflow: could not post hints to %s", url, exc_info=True)
            finally:
                self.queue.task_done()

    def _post(self, url: str, **kw) -> Any:
        """POST, once more if the connection broke before an answer came (a pooled keep-alive
        connection the server closed, e.g. a gateway after answering 404): hint events are
        idempotent (a transition or an end merged twice changes nothing), so the retry is safe.
        Timeouts are not retried: the server got the request and is slow."""
        try:
            return self._client.post(url, **kw)
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError, httpx.WriteError):
            return self._client.post(url, **kw)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued post was tried (tests, shutdown). ``False`` on timeout."""
        done = threading.Event()

        def wait() -> None:
            self.queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)


_poster = _Poster()
atexit.register(lambda: _poster.flush(1.0))


class HintReporter:
    """Posts out-of-band hints for one app. ``base_url=None``: the server its LLM requests use."""

    def __init__(self, base_url: Optional[str] = None) -> None:
        self.base_url = base_url

    def url(self, app: Optional[str] = None) -> Optional[str]:
        root = server_root(self.base_url) if self.base_url else server_for(app)
        return root + HINTS_PATH if root else None

    def report(self, hints: Hints, event: str = "transition") -> bool:
        """Queue a post; ``False`` when it was dropped (no server known yet, queue full)."""
        try:
            from .context import transform_hints

            hints = transform_hints(hints.model_copy(update={"event": event}))
            if hints is None:  # dropped by a fault-injection transform
                return False
            event = hints.event or event
            url = self.url(hints.app)
            if url is None:
                log.debug("kvflow: no server known for out-of-band hints of %r yet", hints.app)
                return False
            doc = hints.to_custom_params()
            doc["kvflow_event"] = event
            return _poster.submit(url, json.dumps(doc, separators=(",", ":")).encode(), hints, event)
        except Exception:  # noqa: BLE001 — never fail the run
            log.debug("kvflow: could not queue out-of-band hints", exc_info=True)
            return False

    @staticmethod
    def flush(timeout: float = 5.0) -> bool:
        return _poster.flush(timeout)


def flush(timeout: float = 5.0) -> bool:
    """Wait until every queued out-of-band post was tried."""
    return _poster.flush(timeout)
