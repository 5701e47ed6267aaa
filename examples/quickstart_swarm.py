"""Quickstart: a ``langgraph-swarm`` of two ReAct agents that hand off to each other,
instrumented, on ``kvflow serve``.

    python examples/quickstart_swarm.py                            # starts kvflow serve (SmolLM2-135M)
    python examples/quickstart_swarm.py --base-url http://127.0.0.1:30000/v1 --model M

``create_swarm([flights, hotels], default_active_agent="flights")``: each agent is a ReAct
agent whose tools include ``transfer_to_<other>`` (``Command(goto=other,
graph=Command.PARENT)``); the swarm starts with the active agent and ends when an agent answers
without calling a tool. ``kvflow.instrument`` reads the agents ``flights/agent``,
``flights/tools``, ``hotels/agent``, ``hotels/tools``, with the hand-offs as conditional edges
out of each ``tools`` node; which way the run goes is the model's choice, learned per app.

Small-model setting: each agent's first turn must call a tool (``tool_choice="required"``,
valid by the server's grammar), its next turn answers (``"none"``); see
``agents_common.tools_first``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langchain_core.tools import tool

import kvflow_agents as kvflow
from examples.agents_common import CallLog, chat_model, tools_first
from examples.agents_common import main as common_main


@tool
def search_flights(origin: str, destination: str) -> str:
    """Find flights between two cities."""
    time.sleep(0.3)  # an airline API takes a while: the tool gap kvflow plans around
    return f"{origin} -> {destination}: 08:10 (EUR 120), 17:45 (EUR 95)"


@tool
def search_hotels(city: str, nights: int) -> str:
    """Find hotel rooms in a city for a number of nights."""
    time.sleep(0.3)
    return f"{city}, {nights} nights: Hotel Lumen (EUR 90/night), Garden Inn (EUR 70/night)"


def build(llm: Any) -> Any:
    from langgraph.prebuilt import create_react_agent
    from langgraph_swarm import create_handoff_tool, create_swarm

    to_hotels = create_handoff_tool(agent_name="hotels", description="Hand the user to the hotel agent.")
    to_flights = create_handoff_tool(agent_name="flights", description="Hand the user to the flight agent.")
    flights_tools = [search_flights, to_hotels]
    hotels_tools = [search_hotels, to_flights]
    flights = create_react_agent(tools_first(llm, flights_tools), flights_tools, name="flights",
                                 prompt="You book flights. For hotels, hand off to the hotel agent.")
    hotels = create_react_agent(tools_first(llm, hotels_tools), hotels_tools, name="hotels",
                                prompt="You book hotels. For flights, hand off to the flight agent.")
    return create_swarm([flights, hotels], default_active_agent="flights")


def all_tools() -> list:
    from langgraph_swarm import create_handoff_tool

    return [search_flights, search_hotels, create_handoff_tool(agent_name="hotels"),
            create_handoff_tool(agent_name="flights")]


def run(base_url: str, model: str, question: str = "I need a hotel in Rome for 3 nights.", *,
        api_key: str = "none", max_tokens: int = 64, thread: str = "swarm-1", echo: bool = True) -> dict:
    import warnings

    from langgraph.checkpoint.memory import InMemorySaver

    log = CallLog(echo=echo)
    llm = chat_model(base_url, model, log, api_key=api_key, max_tokens=max_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # create_react_agent moved in LangGraph 1.0
        app = kvflow.instrument(build(llm), app_id="quickstart-swarm",  # <- the one line
                                checkpointer=InMemorySaver())       # (the swarm remembers who is active)
    out = app.invoke({"messages": [("user", question)]}, {"configurable": {"thread_id": thread}, "recursion_limit": 40})
    return {"messages": out["messages"], "active": out.get("active_agent"), "log": log, "app": app}


def main(argv: Optional[list[str]] = None) -> int:
    return common_main(__doc__, run, 'I need a hotel in Rome for 3 nights.', argv)


if __name__ == "__main__":
    sys.exit(main())
