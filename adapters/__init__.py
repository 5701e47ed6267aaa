"""Framework adapters: turn a LangGraph graph or an AutoGen team into an Agent Step Graph,
track its runs, and attach hints to its LLM requests.

Each framework is imported only inside its own module (``adapters/langgraph*.py``,
``adapters/autogen*.py``), so a core install needs neither.
"""

from __future__ import annotations

from typing import Any


def _type_path(obj: Any) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def instrument(app: Any, **kwargs: Any) -> Any:
    """Dispatch ``kvflow.instrument(app)`` on the framework that ``app`` comes from."""
    mro = _type_path(app)
    if any(p.startswith("langgraph.") for p in mro):
        from .langgraph import instrument as instrument_langgraph

        return instrument_langgraph(app, **kwargs)
    if any(p.startswith("autogen_agentchat.") for p in mro):
        from .autogen import instrument as instrument_autogen

        return instrument_autogen(app, **kwargs)
    raise TypeError(
        f"kvflow.instrument() does not know {type(app).__module__}.{type(app).__qualname__}: "
        "pass a LangGraph StateGraph / compiled graph, or an AutoGen team "
        "(GraphFlow, RoundRobinGroupChat, SelectorGroupChat, Swarm)")
