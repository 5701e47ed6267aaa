"""LangGraph's prebuilt multi-agent apps read as Agent Step Graphs, tracked step by step, and
learning their LLM-routed transitions (``create_react_agent``, ``langgraph-supervisor``,
``langgraph-swarm``), with a scripted chat model (deterministic routing, no server)."""

from __future__ import annotations

import json

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool

import kvflow_agents as kvflow
from kvflow_agents.adapters.langgraph_asg import build_asg
from kvflow_agents.graph import INF
from kvflow_agents.graph.learned import TransitionModel

pytest.importorskip("langgraph_supervisor")
pytest.importorskip("langgraph_swarm")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Scripted(GenericFakeChatModel):
    """Replies from a list, in order; ``bind_tools`` is a no-op (the script holds the calls)."""

    def bind_tools(self, tools, **kw):
        return self


def call(name, **args):
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"c-{name}-{len(args)}"}])


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def search(query: str) -> str:
    """Search the notes."""
    return "notes"


def edges(graph):
    doc = json.loads(graph.to_json())["graph"]["edges"]
    return {(e["source"], e["target"], e["conditional"]) for e in doc}


def supervisor_app(script, **kw):
    from langgraph.prebuilt import create_react_agent
    from langgraph_supervisor import create_supervisor

    llm = Scripted(messages=iter(script))
    workers = [create_react_agent(llm, [search], name="research"), create_react_agent(llm, [add], name="math")]
    return kvflow.instrument(create_supervisor(workers, model=llm), app_id="sup-test", **kw)


def supervisor_run(first: str):
    """Supervisor hands off to ``first``, which answers; then the supervisor answers."""
    return [call(f"transfer_to_{first}"), AIMessage(content=f"{first} says hi"), AIMessage(content="done")]


def test_supervisor_graph_inlines_workers_and_hands_off_from_its_tool_node():
    app = supervisor_app([])
    g = app.kvflow_graph
    assert set(g.agents) == {"supervisor/agent", "supervisor/tools", "research/agent", "research/tools",
                             "math/agent", "math/tools"}
    assert not g.is_llm("supervisor/tools") and not g.is_llm("math/tools") and g.is_llm("math/agent")
    e = edges(g)
    # the hand-off happens in the supervisor's ToolNode (Command.PARENT), not from its agent node
    assert {("supervisor/tools", "research/agent", True), ("supervisor/tools", "math/agent", True),
            ("supervisor/tools", "supervisor/agent", True)} <= e
    assert not any(s == "supervisor/agent" and t in ("math/agent", "research/agent") for s, t, _ in e)
    # a worker returns to the supervisor only when it answers (its END is a choice)
    assert ("math/agent", "supervisor/agent", True) in e and ("math/tools", "math/agent", False) in e
    assert ("supervisor/agent", "__end__", True) in e
    ste = g.steps_to_execution({"supervisor/agent"})
    assert ste["supervisor/tools"] == 1 and ste["math/agent"] == ste["research/agent"] == 2


def test_swarm_graph_hands_off_between_tool_nodes_and_may_end_after_any_agent():
    from langgraph.prebuilt import create_react_agent
    from langgraph_swarm import create_handoff_tool, create_swarm

    llm = Scripted(messages=iter([]))
    a = create_react_agent(llm, [add, create_handoff_tool(agent_name="bob")], name="alice")
    b = create_react_agent(llm, [create_handoff_tool(agent_name="alice")], name="bob")
    g = build_asg(create_swarm([a, b], default_active_agent="alice"), "swarm").graph
    e = edges(g)
    assert {("alice/tools", "bob/agent", True), ("bob/tools", "alice/agent", True),
            ("alice/agent", "__end__", True), ("bob/agent", "__end__", True),
            ("__start__", "alice/agent", True), ("__start__", "bob/agent", True)} <= e
    assert ("alice/tools", "alice/agent", True) in e  # a hand-off skips the way back


def test_supervisor_runs_are_tracked_step_by_step_through_the_hand_offs():
    app = supervisor_app(supervisor_run("math"), learn=False)
    app.invoke({"messages": [("user", "hi")]}, {"configurable": {"thread_id": "s1"}})
    hist = [h for h in app.kvflow.tracker("s1").history if h[1] in ("start", "finish", "cancel")]
    assert hist == [(1, "start", "supervisor/agent"), (1, "finish", "supervisor/agent"),
                    (2, "start", "supervisor/tools"), (2, "finish", "supervisor/tools"),  # Command.PARENT
                    (3, "start", "math/agent"), (3, "finish", "math/agent"),
                    (4, "start", "supervisor/agent"), (4, "finish", "supervisor/agent")]


def test_supervisor_routing_is_learned_per_app_and_persisted(tmp_path):
    """Exact STE puts both workers two steps from the supervisor; after runs that always route
    to ``math``, the learned (wire) STE keeps ``math`` close and pushes ``research`` away — and
    a new process reading the transitions file starts from what was learned."""
    path = tmp_path / "transitions.json"
    model = TransitionModel()
    script = [m for _ in range(4) for m in supervisor_run("math")]
    app = supervisor_app(script, model=model, transitions=path)
    for i in range(4):
        app.invoke({"messages": [("user", "hi")]}, {"configurable": {"thread_id": f"r{i}"}})
    counts = model.counts("sup-test")
    assert counts[("supervisor/tools", "math/agent")] == 4 and ("supervisor/tools", "research/agent") not in counts
    tr = app.kvflow.tracker("r3")
    tr.start("supervisor/agent")  # a new run: the supervisor is deciding
    exact, wire = tr.ste(), tr.wire_ste()
    assert exact["math/agent"] == exact["research/agent"] == 2
    # supervisor/agent -> tools: 4 of 8 decisions (then it answered: -> END), but at a run's
    # start (reached from START) all 4 went to the tool: P = (4 + 2 x 1/6) / 6, 1.38 steps
    # (first order: 1/P = 2); tools -> math 4 of 4: P = (4+1)/(4+3), 1.4 steps; -> research
    # never: P = 1/7, 7 steps
    assert wire["math/agent"] == 3 and wire["research/agent"] == 8
    assert tr.predicted_next() == ["supervisor/tools"]
    # persisted at each run's end; another model bound to the file starts from it
    again = TransitionModel().bind_file(path)
    assert again.counts("sup-test") == counts
    assert json.loads(path.read_text())["kvflow_transitions"] == 1


def test_react_agent_tool_node_takes_a_step_and_the_choice_is_learned():
    from langgraph.prebuilt import create_react_agent

    model = TransitionModel()
    script = [call("add", a=1, b=2), AIMessage(content="3")] * 3
    app = kvflow.instrument(create_react_agent(Scripted(messages=iter(script)), [add]), app_id="react-test",
                            model=model)
    for i in range(3):
        app.invoke({"messages": [("user", "1+2?")]}, {"configurable": {"thread_id": f"t{i}"}})
    starts = [a for _s, ev, a in app.kvflow.tracker("t2").history if ev == "start"]
    assert starts[-3:] == ["agent", "tools", "agent"]
    # agent -> tools and agent -> END were each taken 3 times: a 50/50 choice
    assert model.count("react-test", "agent", "tools") == 3 and model.count("react-test", "agent", "__end__") == 3
    assert model.probability("react-test", app.kvflow_graph, "agent", "tools") == pytest.approx(0.5)
    assert app.kvflow_graph.steps_to_execution({"agent"})["tools"] == 1
    assert app.kvflow.tracker("t2").ste()["agent"] == INF  # the run ended: nothing will run


def test_bench_predict_on_a_real_supervisor_app_learns_its_routing():
    """``kvflow bench predict --app supervisor``: the runs are recorded by the adapter's own
    tracker on a real langgraph-supervisor app; learning beats the graph's best case."""
    from typer.testing import CliRunner

    from kvflow_agents.bench.predict_apps import supervisor_traces
    from kvflow_agents.cli.main import app as cli
    from kvflow_agents.graph.learned import conditional_successors
    from kvflow_agents.graph.prediction import evaluate_predictions, train

    graphs, runs = supervisor_traces(60, seed=3, skew=0.9)
    (g,) = graphs.values()
    assert len(runs) == 60 and all(r.steps[0] == ["supervisor/agent"] and r.steps[1] == ["supervisor/tools"]
                                   for r in runs)
    for r in runs:  # every recorded step follows an edge of the Agent Step Graph
        for (a,), (b,) in zip(r.steps, r.steps[1:]):
            assert b in {d for _s, d in g.nx_graph.out_edges(a)}, (a, b)
    assert set(conditional_successors(g, "supervisor/tools")) >= {"research_expert/agent", "math_expert/agent"}
    before = evaluate_predictions(graphs, runs[30:], TransitionModel(), learn=False)
    model = TransitionModel()
    train(model, graphs, runs[:30])
    after = evaluate_predictions(graphs, runs[30:], model, learn=False)
    assert after.learned_accuracy > before.exact_accuracy + 0.05
    r = CliRunner().invoke(cli, ["bench", "predict", "--app", "supervisor", "--runs", "20", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    assert doc["source"].startswith("langgraph-supervisor app") and len(doc["results"]) == 4


def test_tool_steps_are_timed_and_the_transition_says_when_the_agent_resumes(recording_server):
    """The first run times the tool; from the second run on, the out-of-band transition of the
    tool step carries kvflow_tool_s = {the agent it returns to: its expected seconds}."""
    import time

    from langgraph.prebuilt import create_react_agent

    from kvflow_agents import oob

    @tool
    def slow_lookup(q: str) -> str:
        """A slow lookup."""
        time.sleep(0.15)
        return "found"

    script = [call("slow_lookup", q="x"), AIMessage(content="ok")] * 2
    app = kvflow.instrument(create_react_agent(Scripted(messages=iter(script)), [slow_lookup]), app_id="gap-test",
                            hints_url=recording_server.base_url, learn=False)
    for i in range(2):
        app.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": f"g{i}"}})
    oob.flush(5)
    posts = [p.body for p in recording_server.hint_posts() if p.body.get("kvflow_event") == "transition"]
    assert [p["kvflow_agent"] for p in posts] == ["tools", "tools"]
    assert "kvflow_tool_s" not in posts[0]  # nothing timed yet
    assert set(posts[1]["kvflow_tool_s"]) == {"agent"} and 0.12 <= posts[1]["kvflow_tool_s"]["agent"] < 1.0
    assert posts[1]["kvflow_ste"]["agent"] == 1
    assert 0.12 <= app.kvflow.tool_times.by_tool["slow_lookup"] < 1.0
