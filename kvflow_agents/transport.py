"""httpx / httpx2 transports that add hints v1 to OpenAI-style LLM requests.

``openai`` < 3 sends through ``httpx``; ``openai`` 3.x through ``httpx2`` (same API, another
module). A transport must come from the same library as the client it is mounted in, so the
classes are built for each library from one core (:func:`rewrite_body`): sync and async twins
that only differ in how they call the wrapped transport.

Only ``POST …/chat/completions`` and ``POST …/completions`` with a JSON object body are
touched: the hints are merged into ``custom_params`` (keys the caller set explicitly win) and/or
``metadata["kvflow"]`` (:func:`kvflow_agents.context.hint_channel`, :func:`hint_fields`) and
mirrored in ``X-KVFlow-Workflow`` / ``X-KVFlow-Agent`` / ``x-smg-routing-key``. Everything else passes unchanged, and
so does every request sent while no hints apply.
"""

from __future__ import annotations

import importlib
import json
import logging
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable, Optional

from .context import current_hints, hint_channel
from .protocol import METADATA_KEY, Hints, metadata_value

log = logging.getLogger("kvflow_agents")

HINTED_PATH_SUFFIXES = ("/chat/completions", "/completions")
HINTED_EXTENSION = "kvflow_hinted"  # request extension set by autopatch: do not hint twice

HintSource = Callable[[], Optional[Hints]]


def is_llm_request(method: str, path: str) -> bool:
    return method.upper() == "POST" and path.rstrip("/").endswith(HINTED_PATH_SUFFIXES)


def hint_fields(flat: dict[str, Any], doc: dict[str, Any], channel: Optional[str] = None
                ) -> Optional[dict[str, Any]]:
    """The top-level body fields that carry ``flat`` (the merged ``kvflow_*`` dict) on
    ``channel``, merged with what ``doc`` (the body as the caller wrote it) already has there:
    the caller's ``custom_params`` keys win, and its ``metadata`` entries are kept. ``None``
    when the caller set one of those fields to something that is not an object (then nothing
    is added). One home for the transports and :mod:`kvflow_agents.autopatch`."""
    channel = channel or hint_channel()
    cp, md = doc.get("custom_params"), doc.get("metadata")
    if (cp is not None and not isinstance(cp, dict)) or (md is not None and not isinstance(md, dict)):
        return None
    merged = {**flat, **(cp or {})}  # explicit caller keys win over automatic hints
    out: dict[str, Any] = {}
    if channel in ("both", "custom_params"):
        out["custom_params"] = merged
    if channel in ("both", "metadata") and METADATA_KEY not in (md or {}):
        hinted = {k: v for k, v in merged.items() if k.startswith("kvflow_")}
        out["metadata"] = {**(md or {}), METADATA_KEY: metadata_value(hinted)}
    return out


def rewrite_body(body: bytes, hints: Hints) -> Optional[bytes]:
    """The request body with hints added (:func:`hint_fields`); ``None`` to leave it as is
    (not a JSON object, or ``custom_params`` / ``metadata`` set to something not an object)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    doc = _hinted_doc(doc, hints)
    return None if doc is None else json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _hinted_doc(doc: Any, hints: Hints) -> Optional[dict]:
    if not isinstance(doc, dict):
        return None
    flat = hints.to_custom_params()
    if hints.fixed_messages is None:  # boundary from the messages (markers are stripped)
        from .fixed_prefix import apply as _fixed_prefix

        fixed = _fixed_prefix(doc)
        if fixed is not None:
            flat["kvflow_fixed_messages"] = fixed
    fields = hint_fields(flat, doc)
    if fields is None:
        return None
    doc.update(fields)
    return doc


def _rewrite_request(lib: ModuleType, request: Any, source: HintSource) -> Any:
    if not is_llm_request(request.method, request.url.path):
        return request
    if request.extensions.get(HINTED_EXTENSION):  # already hinted by kvflow_agents.autopatch
        return request
    try:
        hints = source()
        if hints is None:
            return request
        from .oob import note_server

        try:
            body = request.content
        except lib.RequestNotRead:  # a streaming upload: not an OpenAI JSON body
            return request
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            doc = None
        model = doc.get("model") if isinstance(doc, dict) else None
        note_server(hints, str(request.url), request.headers.get("authorization"), model=model)
        doc = _hinted_doc(doc, hints)
        if doc is None:
            return request
        new_body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        present = {k.lower() for k, _ in headers}
        headers += [(k, v) for k, v in hints.headers().items() if k.lower() not in present]
        return lib.Request(request.method, request.url, headers=headers, content=new_body,
                           extensions=request.extensions)
    except Exception:  # noqa: BLE001 — hints are advisory; never fail the user's request
        log.debug("kvflow: could not attach hints; sending the request unchanged", exc_info=True)
        return request


@lru_cache(maxsize=None)
def transports_for(lib_name: str) -> tuple[type, type]:
    """``(KVFlowTransport, AsyncKVFlowTransport)`` for ``"httpx"`` or ``"httpx2"``."""
    lib = importlib.import_module(lib_name)

    class KVFlowTransport(lib.BaseTransport):  # type: ignore[name-defined, misc]
        """Adds hints v1 to LLM requests, then hands them to ``transport``."""

        library = lib_name

        def __init__(self, transport: Any = None, *, hints: HintSource | None = None,
                     **transport_kwargs: Any) -> None:
            self.inner = transport if transport is not None else lib.HTTPTransport(**transport_kwargs)
            self._source = hints or current_hints

        def handle_request(self, request: Any) -> Any:
            return self.inner.handle_request(_rewrite_request(lib, request, self._source))

        def close(self) -> None:
            self.inner.close()

    class AsyncKVFlowTransport(lib.AsyncBaseTransport):  # type: ignore[name-defined, misc]
        """Async twin of :class:`KVFlowTransport`."""

        library = lib_name

        def __init__(self, transport: Any = None, *, hints: HintSource | None = None,
                     **transport_kwargs: Any) -> None:
            self.inner = transport if transport is not None else lib.AsyncHTTPTransport(**transport_kwargs)
            self._source = hints or current_hints

        async def handle_async_request(self, request: Any) -> Any:
            return await self.inner.handle_async_request(_rewrite_request(lib, request, self._source))

        async def aclose(self) -> None:
            await self.inner.aclose()

    KVFlowTransport.__qualname__ = KVFlowTransport.__name__ = f"KVFlowTransport[{lib_name}]"
    AsyncKVFlowTransport.__qualname__ = AsyncKVFlowTransport.__name__ = f"AsyncKVFlowTransport[{lib_name}]"
    return KVFlowTransport, AsyncKVFlowTransport


def default_http_library() -> str:
    """The HTTP library the installed ``openai`` SDK uses: ``httpx2`` for openai >= 3."""
    try:
        import openai

        major = int(openai.__version__.split(".")[0])
    except Exception:  # noqa: BLE001 — no openai: plain httpx
        major = 0
    if major >= 3:
        try:
            importlib.import_module("httpx2")
            return "httpx2"
        except ImportError:
            pass
    return "httpx"


def http_client(*, library: str | None = None, hints: HintSource | None = None, **client_kwargs: Any) -> Any:
    """A sync HTTP client that attaches hints; pass it as ``openai.OpenAI(http_client=...)`` or
    ``ChatOpenAI(http_client=...)``. ``library`` defaults to what the installed openai uses."""
    lib_name = library or default_http_library()
    lib = importlib.import_module(lib_name)
    transport_cls, _ = transports_for(lib_name)
    inner = client_kwargs.pop("transport", None)
    client_kwargs.setdefault("timeout", lib.Timeout(600.0, connect=10.0))
    return lib.Client(transport=transport_cls(inner, hints=hints), **client_kwargs)


def async_http_client(*, library: str | None = None, hints: HintSource | None = None, **client_kwargs: Any) -> Any:
    """Async twin of :func:`http_client` (``AsyncOpenAI(http_client=...)``)."""
    lib_name = library or default_http_library()
    lib = importlib.import_module(lib_name)
    _, transport_cls = transports_for(lib_name)
    inner = client_kwargs.pop("transport", None)
    client_kwargs.setdefault("timeout", lib.Timeout(600.0, connect=10.0))
    return lib.AsyncClient(transport=transport_cls(inner, hints=hints), **client_kwargs)


def __getattr__(name: str) -> Any:  # KVFlowTransport / AsyncKVFlowTransport for plain httpx
    if name in ("KVFlowTransport", "AsyncKVFlowTransport"):
        return transports_for("httpx")[name.startswith("Async")]
    raise AttributeError(name)
