"""Quickstart: LangGraph's prebuilt ReAct agent with two tools, instrumented, on ``kvflow serve``.

    python examples/quickstart_react_agent.py                      # starts kvflow serve (SmolLM2-135M)
    python examples/quickstart_react_agent.py --base-url http://127.0.0.1:30000/v1 --model M

``create_react_agent(model, tools=[get_weather, convert_temperature])`` is the graph
``agent -> tools -> agent -> END``: the ``tools`` node (a prebuilt ``ToolNode``) runs the calls
the model makes and takes a step of its own, so while it runs the agent is one step away.
``kvflow.instrument`` reads that from the graph; every request carries the agent, the step and
the steps-to-execution of every node, and where the model chooses (call a tool, or answer) the
STE becomes the *expected* one once the app has run a few times (learned transitions).

The server constrains tool calls with a grammar (xgrammar), so even a 135M model returns valid
``tool_calls``; it is too small to decide *when* to call one, so the agent asks for a tool on the
user's turn (``tool_choice="required"``) and lets the model answer after (see
``agents_common.tools_first``).
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

CITIES = {"paris": (18, "light rain"), "rome": (27, "sunny"), "oslo": (9, "cloudy"), "tokyo": (22, "humid")}


@tool
def get_weather(city: str) -> str:
    """Current weather in a city: temperature in Celsius and the sky."""
    t, sky = CITIES.get(city.strip().lower(), (20, "clear"))
    time.sleep(0.2)  # a real weather API takes a while: the tool gap kvflow plans around
    return f"{city}: {t} °C, {sky}"


@tool
def convert_temperature(celsius: float) -> str:
    """Convert a temperature from Celsius to Fahrenheit."""
    return f"{celsius} °C = {celsius * 9 / 5 + 32:.1f} °F"


TOOLS = [get_weather, convert_temperature]
SYSTEM = "You are a weather assistant. Use the tools, then answer in one sentence."


def build(llm: Any) -> Any:
    from langgraph.prebuilt import create_react_agent

    return create_react_agent(tools_first(llm, TOOLS), TOOLS, prompt=SYSTEM, name="weather_agent")


def run(base_url: str, model: str, question: str = "What is the weather in Paris?", *, api_key: str = "none",
        max_tokens: int = 64, thread: str = "react-1", echo: bool = True) -> dict:
    """Run one question; returns ``{"messages", "log" (CallLog), "app"}``."""
    import warnings

    log = CallLog(echo=echo)
    llm = chat_model(base_url, model, log, api_key=api_key, max_tokens=max_tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # create_react_agent moved in LangGraph 1.0
        app = kvflow.instrument(build(llm), app_id="quickstart-react")  # <- the one line
    out = app.invoke({"messages": [("user", question)]}, {"configurable": {"thread_id": thread}, "recursion_limit": 40})
    return {"messages": out["messages"], "log": log, "app": app}


def main(argv: Optional[list[str]] = None) -> int:
    return common_main(__doc__, run, 'What is the weather in Paris?', argv)


if __name__ == "__main__":
    sys.exit(main())
