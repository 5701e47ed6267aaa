"""Quickstart: a small LangGraph multi-agent graph, instrumented with one line.

    python examples/quickstart_langgraph.py --base-url http://127.0.0.1:30000/v1 --model my-model
    python examples/quickstart_langgraph.py            # no server? a local stub answers

The graph: a planner fans out to a researcher and a coder (in parallel), a writer waits for both
(an AND join), then a reviewer either sends the draft back to the writer or ends the run; a
``tools`` node (no LLM call) runs between the coder and the join. Every node uses an ordinary
``ChatOpenAI``: ``kvflow.instrument()`` makes each request carry the workflow id, the agent,
the step and the steps-to-execution (STE) of every agent — nothing else changes.

Printed per LLM call: the agent, the step, the STE map (``·`` = never again) and the agents
expected next, read from the request as it leaves the client.
"""

import argparse
import operator
import sys
from typing import Annotated, TypedDict

from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

import kvflow_agents as kvflow


class State(TypedDict, total=False):
    task: str
    notes: Annotated[list, operator.add]
    reviews: int


def build(llm: ChatOpenAI, rounds: int) -> StateGraph:
    def agent(name: str, prompt: str):
        def node(state: State) -> State:
            reply = llm.invoke([("system", f"You are the {name}. {prompt}"),
                                ("human", f"Task: {state['task']}\nNotes so far: {state.get('notes', [])}")])
            return {"notes": [f"{name}: {str(reply.content)[:60]}"]}

        return node

    def reviewer(state: State) -> State:
        llm.invoke([("system", "You are the reviewer. Approve or ask for changes."),
                    ("human", "\n".join(state.get("notes", [])))])
        return {"reviews": state.get("reviews", 0) + 1}

    def tools(state: State) -> State:  # a tool step: no LLM request, still a step
        return {"notes": ["tools: ran the unit tests"]}

    g = StateGraph(State)
    g.add_node("planner", agent("planner", "Split the task into research and code."))
    g.add_node("researcher", agent("researcher", "Find the facts."))
    g.add_node("coder", agent("coder", "Write the code."))
    g.add_node("tools", tools, metadata={"kvflow": {"llm": False}})
    g.add_node("writer", agent("writer", "Write the answer from the notes."))
    g.add_node("reviewer", reviewer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "researcher")
    g.add_edge("planner", "coder")
    g.add_edge("coder", "tools")
    g.add_edge(["researcher", "tools"], "writer")  # AND: the writer waits for both branches
    g.add_edge("writer", "reviewer")
    g.add_conditional_edges("reviewer", lambda s: "writer" if s["reviews"] < rounds else END,
                            {"writer": "writer", END: END})
    return g


def _fmt_ste(ste: dict) -> str:
    return " ".join(f"{a}={'·' if v is None else v}" for a, v in ste.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="any OpenAI-compatible server, e.g. http://127.0.0.1:30000/v1 "
                                       "(default: start a local stub)")
    ap.add_argument("--model", default="default", help="model name sent to the server")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--rounds", type=int, default=2, help="review rounds")
    ap.add_argument("--thread", default="quickstart-1", help="thread_id = the workflow id")
    args = ap.parse_args(argv)

    stub = None
    base_url = args.base_url
    if base_url is None:
        from kvflow_agents.testing import RecordingOpenAIServer

        stub = RecordingOpenAIServer(reply=lambda body: "Looks good.").start()
        base_url = stub.base_url
        print(f"(no --base-url: using a local stub server at {base_url})")

    # Show what each request carries, as it leaves the client (an httpx event hook).
    import importlib

    from kvflow_agents.transport import default_http_library

    lib = importlib.import_module(default_http_library())
    rows: list[tuple] = []

    def show(request) -> None:
        if not request.url.path.endswith("/chat/completions"):
            return
        import json

        hints = (json.loads(request.content).get("custom_params") or {})
        if "kvflow_agent" in hints:
            rows.append((hints["kvflow_agent"], hints["kvflow_step"], hints["kvflow_ste"], hints["kvflow_next"]))
            print(f"step {hints['kvflow_step']:>2}  {hints['kvflow_agent']:<10}  "
                  f"STE {_fmt_ste(hints['kvflow_ste'])}   next {hints['kvflow_next']}")

    # An ordinary ChatOpenAI: the hook above only prints; the hints are added with no config.
    llm = ChatOpenAI(model=args.model, base_url=base_url, api_key=args.api_key, max_retries=1,
                     http_client=lib.Client(event_hooks={"request": [show]}))

    app = kvflow.instrument(build(llm, args.rounds))  # <- the one line
    print("Agent Step Graph:", ", ".join(app.kvflow_graph.agents))
    try:
        out = app.invoke({"task": "Explain KV-cache eviction in two sentences.", "notes": []},
                         {"configurable": {"thread_id": args.thread}})
    finally:
        if stub is not None:
            from kvflow_agents import oob

            oob.flush(2)  # let the out-of-band posts (tool step, end of run) reach the stub
            for post in stub.hint_posts():
                b = post.body
                print(f"out of band: {b['kvflow_event']:<10} step {b['kvflow_step']:>2}  "
                      f"{b['kvflow_agent']:<10}  STE {_fmt_ste(b['kvflow_ste'])}")
            stub.stop()
    print(f"done: {len(rows)} LLM calls, {out['reviews']} review round(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
