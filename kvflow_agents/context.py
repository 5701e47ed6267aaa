"""Which hints apply to the LLM request being sent right now.

Two sources, checked in order:
1. an explicit ``with kvflow.hints(...)`` block (a contextvar, so it follows asyncio tasks and
   ``contextvars.copy_context()`` as LangGraph's executor uses it);
2. *providers* registered by adapters (LangGraph, AutoGen): callables that look at the
   framework's own context (the running node) and return hints or ``None``.

Transports call :func:`current_hints` once per request. A provider that raises is logged and
skipped: hints are advisory and must never fail the user's request.

:func:`set_hint_transform` installs one process-wide function that every outgoing hint passes
through (request hints and out-of-band posts); returning ``None`` drops the hint. It exists for
fault injection: ``kvflow bench … --hints random|reversed|stale|none`` measures what a server does
with wrong or missing hints (``kvflow_agents.bench.hint_modes``).

Which body fields carry the hints is :func:`hint_channel`: ``both`` (default: ``custom_params``
for direct connections and ``metadata["kvflow"]``, the form SGLang's gateway forwards),
``metadata`` or ``custom_params``. Set it with :func:`set_hint_channel` or the environment
variable ``KVFLOW_HINT_CHANNEL``.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from .protocol import CHANNELS, Hints

log = logging.getLogger("kvflow_agents")

HintProvider = Callable[[], Optional[Hints]]

_explicit: contextvars.ContextVar[Optional[Hints]] = contextvars.ContextVar("kvflow_hints", default=None)
_providers: list[HintProvider] = []
_providers_lock = threading.Lock()
_transform: Optional[Callable[[Hints], Optional[Hints]]] = None


@contextmanager
def hints(h: Hints | None = None, /, **fields: Any) -> Iterator[Hints]:
    """Attach hints to every LLM request sent inside the block::

        with kvflow.hints(workflow="w1", agent="planner", ste={"planner": 0, "coder": 1}):
            client.chat.completions.create(...)
    """
    if h is None:
        h = Hints(**fields)
    elif fields:
        h = h.model_copy(update=fields)
    token = _explicit.set(h)
    try:
        yield h
    finally:
        _explicit.reset(token)


def register_hint_provider(provider: HintProvider) -> HintProvider:
    """Add a provider (idempotent). Returns it, so it can be used as a decorator."""
    with _providers_lock:
        if provider not in _providers:
            _providers.append(provider)
    return provider


def unregister_hint_provider(provider: HintProvider) -> None:
    with _providers_lock:
        if provider in _providers:
            _providers.remove(provider)


def set_hint_transform(fn: Optional[Callable[[Hints], Optional[Hints]]]) -> None:
    """Pass every outgoing hint through ``fn`` (``None``: drop it); ``None`` removes it."""
    global _transform
    _transform = fn


def transform_hints(h: Optional[Hints]) -> Optional[Hints]:
    """``h`` after the installed transform (unchanged when none is installed)."""
    fn = _transform
    if fn is None or h is None:
        return h
    try:
        return fn(h)
    except Exception:  # noqa: BLE001 — a broken transform must not fail the request
        log.debug("kvflow hint transform %r failed", fn, exc_info=True)
        return h


def current_hints() -> Optional[Hints]:
    """The hints for a request sent from the current context, or ``None``."""
    h = _explicit.get()
    if h is not None:
        return transform_hints(h)
    for provider in tuple(_providers):
        try:
            h = provider()
        except Exception:  # noqa: BLE001 — a broken provider must not fail the request
            log.debug("kvflow hint provider %r failed", provider, exc_info=True)
            continue
        if h is not None:
            return transform_hints(h)
    return None


_channel: Optional[str] = None


def set_hint_channel(channel: Optional[str]) -> None:
    """``"both"`` | ``"metadata"`` | ``"custom_params"``; ``None``: back to the default
    (``KVFLOW_HINT_CHANNEL``, else ``both``)."""
    global _channel
    if channel is not None and channel not in CHANNELS:
        raise ValueError(f"hint channel must be one of {', '.join(CHANNELS)}, not {channel!r}")
    _channel = channel


def hint_channel() -> str:
    if _channel is not None:
        return _channel
    env = os.environ.get("KVFLOW_HINT_CHANNEL", "").strip().lower()
    if env in CHANNELS:
        return env
    if env:
        log.warning("KVFLOW_HINT_CHANNEL=%r is not one of %s; using 'both'", env, ", ".join(CHANNELS))
    return "both"
