"""Quickstart: a ``langgraph-supervisor`` team (a supervisor routing to two ReAct workers),
instrumented, on ``kvflow serve``.

    python examples/quickstart_supervisor.py                       # starts kvflow serve (SmolLM2-135M)
    python examples/quickstart_supervisor.py --base-url http://127.0.0.1:30000/v1 --model M

The graph ``create_supervisor`` builds: the supervisor is a ReAct agent whose tools are
hand-offs (``transfer_to_<worker>``, each returning ``Command(goto=worker,
graph=Command.PARENT)``); each worker is a ReAct agent with its own tools and always returns to
the supervisor. ``kvflow.instrument`` reads it as the agents ``supervisor/agent``,
``supervisor/tools``, ``<worker>/agent``, ``<worker>/tools``, with the hand-offs as conditional
edges out of ``supervisor/tools``. Which worker comes next is the supervisor LLM's choice: the
exact STE puts every worker one step away; run the app a few times and the hints carry the
*expected* STE learned from its routing (``kvflow bench predict --app supervisor`` measures it).

Small-model settings (SmolLM2-135M): the supervisor must call a hand-off tool
(``tool_choice="required"``, valid by the server's grammar) and a ``post_model_hook`` ends the
run once every worker it routed to has answered (a 135M model would otherwise hand off forever).
With a capable model, pass the ``ChatOpenAI`` as ``model=`` and drop the hook.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langchain_core.messages import AIMessage
from langchain_core.tools import tool

import kvflow_agents as kvflow
from examples.agents_common import CallLog, chat_model, tools_first
from examples.agents_common import main as common_main

FACTS = {"population of france": "68 million", "population of italy": "59 million",
         "capital of france": "Paris", "capital of italy": "Rome"}


@tool
def lookup(topic: str) -> str:
    """Look a fact up in the team's reference notes (a population, a capital)."""
    time.sleep(0.2)  # a search backend takes a while: the tool gap kvflow plans around
    key = topic.strip().lower().rstrip("?")
    return next((f"{k}: {v}" for k, v in FACTS.items() if k in key or key in k), f"no note on {topic!r}")


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


WORKERS = {"research_expert": ([lookup], "You are a researcher. Look facts up, then state them briefly."),
           "math_expert": ([multiply], "You are a mathematician. Compute with the tools, then state the result.")}
HANDOFF_DESCRIPTIONS = {"research_expert": "Ask the researcher for facts: populations, capitals.",
                        "math_expert": "Ask the mathematician to multiply or compute numbers."}
SUPERVISOR_PROMPT = ("You are a team supervisor. For facts, call transfer_to_research_expert; "
                     "for arithmetic, call transfer_to_math_expert.")


def finish_when_every_worker_answered(state: dict) -> dict:
    """A ``post_model_hook`` for small models: a hand-off to a worker that already answered
    this request ends the run instead, with the last worker's answer as the supervisor's."""
    msgs = state["messages"]
    last = msgs[-1]
    if not isinstance(last, AIMessage) or not last.tool_calls:
        return {}
    answered = {m.name for m in msgs if isinstance(m, AIMessage) and m.name in WORKERS and not m.tool_calls}
    wanted = {c["name"].removeprefix("transfer_to_") for c in last.tool_calls}
    if not wanted <= answered:
        return {}
    reply = next((m for m in reversed(msgs) if isinstance(m, AIMessage) and m.name in WORKERS
                  and not m.tool_calls and not str(m.content).startswith("Transferring back")), None)
    return {"messages": [AIMessage(id=last.id, name=last.name,
                                   content=str(reply.content) if reply is not None else "")]}


def build(llm: Any) -> Any:
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    workers = [create_react_agent(tools_first(llm, tools), tools, prompt=prompt, name=name)
               for name, (tools, prompt) in WORKERS.items()]
    handoffs = handoff_tools()
    return create_supervisor(workers, model=llm.bind_tools(handoffs, tool_choice="required",
                                                           parallel_tool_calls=False),
                             tools=handoffs, prompt=SUPERVISOR_PROMPT,
                             post_model_hook=finish_when_every_worker_answered)


def handoff_tools() -> list:
    from langgraph_supervisor import create_handoff_tool

    return [create_handoff_tool(agent_name=name, description=HANDOFF_DESCRIPTIONS[name]) for name in WORKERS]


def all_tools() -> list:
    return [t for tools, _ in WORKERS.values() for t in tools] + handoff_tools()


def run(base_url: str, model: str, question: str = "What is the population of France?", *,
        api_key: str = "none", max_tokens: int = 64, thread: str = "supervisor-1", echo: bool = True,
        app: Any = None, log: Optional[CallLog] = None) -> dict:
    """Run one question (on ``app`` when given, to reuse one instrumented app and its learning)."""
    import warnings

    if app is None:
        log = log or CallLog(echo=echo)
        llm = chat_model(base_url, model, log, api_key=api_key, max_tokens=max_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # create_react_agent moved in LangGraph 1.0
            app = kvflow.instrument(build(llm), app_id="quickstart-supervisor")  # <- the one line
    out = app.invoke({"messages": [("user", question)]}, {"configurable": {"thread_id": thread},
                                                          "recursion_limit": 40})
    return {"messages": out["messages"], "log": log, "app": app}


def main(argv: Optional[list[str]] = None) -> int:
    return common_main(__doc__, run, 'What is the population of France?', argv)


if __name__ == "__main__":
    sys.exit(main())
