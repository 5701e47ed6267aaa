"""Zero-config hints for every ``openai`` client (hence ``ChatOpenAI``, AutoGen's
``OpenAIChatCompletionClient``, and the raw SDK), created the ordinary way.

    from kvflow_agents import autopatch
    autopatch.enable()      # idempotent; kvflow.instrument(...) calls it for you

How: the SDK builds every HTTP request in ``BaseClient._build_request(options)`` (one method
shared by the sync and async clients, in openai 1.x, 2.x and 3.x; the Azure client calls it
through ``super()``). The patch wraps it: for ``POST …/chat/completions`` and
``POST …/completions`` sent while :func:`kvflow_agents.current_hints` returns hints, it merges
them into ``options.extra_json`` — ``custom_params`` and/or ``metadata["kvflow"]`` as
:func:`kvflow_agents.context.hint_channel` says (keys the caller set win) — counts the
fixed-prefix boundary from ``messages`` (:mod:`kvflow_agents.fixed_prefix`, markers stripped)
and adds the ``X-KVFlow-*`` headers — all before the SDK serializes the body, so nothing is
parsed twice. Any HTTP client works, a user-supplied ``http_client`` included, since this runs
above it. Never twice: a client whose HTTP client already has a kvflow transport
(:func:`kvflow_agents.http_client`) is left to that transport (and its own hint source), and
every request hinted here is tagged (``request.extensions["kvflow_hinted"]``) so no kvflow
transport further down hints it again.

Requests sent while no hints apply pass through untouched (one contextvar read and one call to
the registered providers). Framework-agnostic: adapters only register hint providers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from .context import current_hints
from .protocol import Hints
from .transport import HINTED_EXTENSION, hint_fields, is_llm_request

log = logging.getLogger("kvflow_agents")

_lock = threading.Lock()
_patched: list[tuple[type, Any]] = []  # (class, original _build_request)
_enabled = False


def is_enabled() -> bool:
    return _enabled


def _hint_fields(options: Any, hints: Hints) -> Optional[dict[str, Any]]:
    """The body fields carrying ``hints`` (:func:`kvflow_agents.transport.hint_fields`), merged
    with what the caller put in ``custom_params`` / ``metadata`` (as a named argument or in
    ``extra_body``; ``extra_body`` wins as it does in the SDK). ``None``: leave the body alone."""
    from . import fixed_prefix

    flat = hints.to_custom_params()
    json_data = options.json_data if isinstance(options.json_data, dict) else {}
    extra = options.extra_json if isinstance(options.extra_json, dict) else {}
    if hints.fixed_messages is None and json_data:
        fixed, cleaned = fixed_prefix.analyze(json_data.get("messages"))
        if fixed is not None:
            flat["kvflow_fixed_messages"] = fixed
        if cleaned is not None:  # never mutate the caller's dict (it is reused on retry)
            options.json_data = {**json_data, "messages": cleaned}
    view: dict[str, Any] = {}
    for key in ("custom_params", "metadata"):
        a, b = json_data.get(key), extra.get(key)
        if a is not None and b is not None and isinstance(a, dict) and isinstance(b, dict):
            view[key] = {**a, **b}
        elif b is not None or a is not None:
            view[key] = b if b is not None else a
    return hint_fields(flat, view)


def _has_kvflow_transport(client: Any) -> bool:
    transport = getattr(getattr(client, "_client", None), "_transport", None)
    return (transport is not None and hasattr(transport, "_source") and hasattr(transport, "inner")
            and type(transport).__name__.split("[", 1)[0] in ("KVFlowTransport", "AsyncKVFlowTransport"))


def _strip_markers_only(options: Any) -> None:
    """No hints apply: still never send kvflow's own marker key to a server."""
    json_data = options.json_data
    if isinstance(json_data, dict) and isinstance(json_data.get("messages"), list):
        from .fixed_prefix import strip_markers

        cleaned = strip_markers(json_data["messages"])
        if cleaned is not None:
            options.json_data = {**json_data, "messages": cleaned}


def _inject(client: Any, options: Any) -> Optional[Hints]:
    """Add the current hints to ``options`` (a per-attempt copy); the hints, or ``None``."""
    method = getattr(options, "method", "")
    url = getattr(options, "url", "")
    if not isinstance(method, str) or not isinstance(url, str) or not is_llm_request(method, url.split("?", 1)[0]):
        return None
    if _has_kvflow_transport(client):
        return None  # kvflow.http_client() on this client hints it (with its own source)
    hints = current_hints()
    if hints is None:
        _strip_markers_only(options)
        return None
    if options.json_data is not None and not isinstance(options.json_data, dict):
        return None  # not a JSON object body: leave it alone
    fields = _hint_fields(options, hints)
    if fields is None:  # the caller's custom_params / metadata is not an object
        return None
    options.extra_json = {**(options.extra_json or {}), **fields}
    headers = options.headers if isinstance(options.headers, dict) else {}
    present = {k.lower() for k in headers}
    default_headers = getattr(client, "_custom_headers", None) or {}
    present.update(k.lower() for k in default_headers)
    added = {k: v for k, v in hints.headers().items() if k.lower() not in present}
    if added:
        options.headers = {**headers, **added}
    try:
        from .oob import note_server

        key = getattr(client, "api_key", None)
        model = options.json_data.get("model") if isinstance(options.json_data, dict) else None
        note_server(hints, str(client.base_url), f"Bearer {key}" if isinstance(key, str) and key else None,
                    model=model)
    except Exception:  # noqa: BLE001
        pass
    return hints


def _make_wrapper(original: Any) -> Any:
    def _build_request(self: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        hinted = None
        if _enabled:
            try:
                hinted = _inject(self, options)
            except Exception:  # noqa: BLE001 — hints are advisory; never fail the request
                log.debug("kvflow: could not attach hints; sending the request unchanged", exc_info=True)
        request = original(self, options, *args, **kwargs)
        if hinted is not None:
            try:
                request.extensions[HINTED_EXTENSION] = True
            except Exception:  # noqa: BLE001
                pass
        return request

    _build_request._kvflow_original = original  # type: ignore[attr-defined]
    _build_request.__wrapped__ = original  # type: ignore[attr-defined]
    _build_request.__doc__ = original.__doc__
    return _build_request


def enable() -> bool:
    """Patch the installed ``openai`` SDK (idempotent, thread-safe). ``False`` when ``openai``
    is not installed or its internals are not the expected ones (nothing is patched then; use
    :func:`kvflow_agents.http_client` instead)."""
    global _enabled
    with _lock:
        if _patched:
            _enabled = True
            return True
        try:
            from openai import _base_client as bc
        except Exception:  # noqa: BLE001 — no openai installed
            return False
        owners = [c for c in vars(bc).values()
                  if isinstance(c, type) and "_build_request" in vars(c) and c.__module__ == bc.__name__]
        if not owners:
            log.warning("kvflow: this openai version has no BaseClient._build_request; "
                        "zero-config hints are off (use kvflow.http_client())")
            return False
        for cls in owners:
            original = vars(cls)["_build_request"]
            if getattr(original, "_kvflow_original", None) is not None:
                continue  # patched by another copy of this module (reload)
            setattr(cls, "_build_request", _make_wrapper(original))
            _patched.append((cls, original))
        _enabled = True
        return True


def disable() -> None:
    """Stop adding hints and restore the SDK's own method (idempotent)."""
    global _enabled
    with _lock:
        _enabled = False
        while _patched:
            cls, original = _patched.pop()
            current = vars(cls).get("_build_request")
            if getattr(current, "_kvflow_original", None) is original:
                setattr(cls, "_build_request", original)
