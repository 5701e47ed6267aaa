"""kvflow-agents: workflow-aware KV-cache management for multi-agent LLM apps (KVFlow).

    import kvflow_agents as kvflow
    app = kvflow.instrument(graph)        # a LangGraph StateGraph / compiled graph

Public API: the Agent Step Graph (:class:`AgentStepGraph`), hints v1 (:class:`Hints`), the
``with kvflow.hints(...)`` context and the hint-carrying HTTP clients.
"""

from __future__ import annotations

from typing import Any

from .context import current_hints, hints, register_hint_provider, unregister_hint_provider
from .graph import END, START, AgentStepGraph, GraphError, WorkflowTracker
from .protocol import PROTOCOL_VERSION, HintError, Hints
from .transport import async_http_client, http_client

__version__ = "0.1.0"

__all__ = [
    "AgentStepGraph", "WorkflowTracker", "GraphError", "START", "END",
    "Hints", "HintError", "PROTOCOL_VERSION",
    "hints", "current_hints", "register_hint_provider", "unregister_hint_provider",
    "http_client", "async_http_client", "instrument", "__version__",
]


def instrument(app: Any, **kwargs: Any) -> Any:
    """Instrument a multi-agent app so each LLM request carries STE hints.

    Dispatches on the app's type to the framework adapters in ``kvflow_agents.adapters``.
    """
    from .adapters import instrument as _instrument

    return _instrument(app, **kwargs)
