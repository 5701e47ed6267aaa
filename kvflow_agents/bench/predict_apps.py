"""Traces of a real ``langgraph-supervisor`` app for ``kvflow bench predict --app supervisor``.

The app is what :mod:`examples.quickstart_supervisor` builds (a supervisor ReAct agent whose
tools are hand-offs, workers that are ReAct agents with their own tools), instrumented with
``kvflow.instrument(..., recorder=...)``: every run's steps are recorded by the adapter's own
tracker, exactly as a user's app would record them. Only the LLMs are scripted, so thousands of
runs take seconds and the routing has a known, seeded structure a learner can find:

* the supervisor's hidden policy: each run delegates to 1-3 workers; the first is the
  ``favourite_first`` worker with probability ``skew``, each next one is the previous worker's
  favourite with probability ``skew`` (else any other), then it answers;
* each worker calls its tool with its own probability (``tool_p``) before answering.

The exact STE puts every worker one hand-off away; the learned STE should find the favourites.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Optional, Sequence

WORKERS = ("research_expert", "math_expert", "writer")
TOOL_P = {"research_expert": 0.8, "math_expert": 0.9, "writer": 0.3}


def _scripted_model(decide: Any) -> Any:
    """A LangChain chat model whose reply is ``decide(messages) -> AIMessage``."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.outputs import ChatGeneration, ChatResult

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kw: Any) -> Any:
            return self

        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
            return ChatResult(generations=[ChatGeneration(message=decide(messages))])

    return Scripted(messages=iter(()))


def supervisor_traces(runs: int = 300, *, seed: int = 0, skew: float = 0.8,
                      app: str = "langgraph-supervisor", progress: Optional[Any] = None
                      ) -> tuple[dict, list]:
    """Run the supervisor app ``runs`` times; ``(graphs, runs)`` as ``read_traces`` returns."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    import kvflow_agents as kvflow
    from kvflow_agents.graph.learned import TraceRecorder, TransitionModel

    rng = random.Random(seed)
    favourite = {w: rng.choice([x for x in WORKERS if x != w]) for w in WORKERS}
    first = WORKERS[0]
    plans: dict[str, list[str]] = {}
    calls = iter(range(1 << 62))

    def plan_for(task: str) -> list[str]:
        if task not in plans:
            n = rng.choice((1, 2, 2, 3))
            cur = first if rng.random() < skew else rng.choice(WORKERS)
            seq = [cur]
            while len(seq) < n:
                cur = favourite[cur] if rng.random() < skew else rng.choice([w for w in WORKERS if w != cur])
                seq.append(cur)
            plans[task] = seq
        return plans[task]

    def task_of(messages: Sequence[Any]) -> str:
        return next(str(m.content) for m in messages if isinstance(m, HumanMessage))

    def supervisor_decides(messages: Sequence[Any]) -> Any:
        plan = plan_for(task_of(messages))
        done = sum(isinstance(m, ToolMessage) and str(m.name).startswith("transfer_back_to") for m in messages)
        if done < len(plan):
            return AIMessage(content="", tool_calls=[{"name": f"transfer_to_{plan[done]}", "args": {},
                                                      "id": f"h{next(calls)}"}])
        return AIMessage(content="done")

    def worker(name: str) -> Any:
        def decides(messages: Sequence[Any]) -> Any:
            own = [m for m in messages if isinstance(m, ToolMessage) and m.name == f"{name}_tool"]
            if not own and isinstance(messages[-1], ToolMessage) and rng.random() < TOOL_P[name]:
                return AIMessage(content="", tool_calls=[{"name": f"{name}_tool", "args": {"x": "q"},
                                                          "id": f"t{next(calls)}"}])
            return AIMessage(content=f"{name} answered")

        @tool(f"{name}_tool")
        def work(x: str) -> str:
            """Do this worker's job."""
            return "ok"

        return create_react_agent(_scripted_model(decides), [work], name=name)

    recorder = TraceRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # create_react_agent moved in LangGraph 1.0
        team = create_supervisor([worker(w) for w in WORKERS], model=_scripted_model(supervisor_decides))
        compiled = kvflow.instrument(team, app_id=app, model=TransitionModel(), learn=False,
                                     recorder=recorder, hints_url="http://127.0.0.1:9/v1")
    for i in range(runs):
        compiled.invoke({"messages": [("user", f"task {i}")]},
                        {"configurable": {"thread_id": f"{app}-{i}"}, "recursion_limit": 100})
        if progress is not None:
            progress(1)
    return dict(recorder.graphs), list(recorder.runs)
