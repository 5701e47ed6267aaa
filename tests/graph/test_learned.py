import io
import math

import pytest

from kvflow_agents.graph import END, START, AgentStepGraph, GraphError, next_agents
from kvflow_agents.graph.examples import cycle_graph, peer_graph, random_graph
from kvflow_agents.graph.learned import (
    LearnedTracker,
    TraceRecorder,
    TraceRun,
    TransitionModel,
    guaranteed_ste,
    read_traces,
    ste_between_steps,
    wire_ste,
    write_traces,
)
from kvflow_agents.graph.prediction import evaluate_predictions, selector_graph, synthetic_selector_traces, train

INF = math.inf


def router_graph() -> AgentStepGraph:
    g = AgentStepGraph("router")
    g.add_edge(START, "router")
    for t in ("math", "code", "chat"):
        g.add_edge("router", t, conditional=True)
        g.add_edge(t, "writer")
    g.add_edge("writer", END)
    return g


def test_deterministic_graphs_expected_equals_exact():
    m = TransitionModel()
    for g in (cycle_graph(5), peer_graph(3), random_graph(30, seed=3)):
        for running in ({START}, {g.agents[0]}, set(g.agents[:3])):
            exact = g.steps_to_execution(running)
            if not any(a.get("conditional") for *_, a in g.nx_graph.edges(data=True)):
                assert m.expected_ste(g, running) == exact
            # never below the exact STE, infinite exactly where it is
            exp = m.expected_ste(g, running)
            for a in g.agents:
                assert exp[a] >= exact[a] and (math.isinf(exp[a]) == math.isinf(exact[a]))


def test_probabilities_prior_and_expected_distance():
    g = router_graph()
    m = TransitionModel(prior=1.0)
    assert m.probability("router", g, "router", "math") == pytest.approx(1 / 3)
    assert m.probability("router", g, "math", "writer") == 1.0
    assert m.probability("router", g, "math", "code") == 0.0
    exp = m.expected_ste(g, {"router"})
    assert exp == {"router": 0, "math": 3, "code": 3, "chat": 3, "writer": 4}
    for _ in range(7):
        m.observe("router", "router", "math")
    m.observe("router", "router", "code")
    # P(math) = 8/11, P(code) = 2/11, P(chat) = 1/11
    exp = m.expected_ste(g, {"router"})
    assert exp["math"] == pytest.approx(11 / 8) and exp["chat"] == pytest.approx(11)
    assert exp["writer"] == pytest.approx(1 + 11 / 8)  # via the likeliest branch
    wire = m.wire_ste(g, {"router"})
    assert wire == {"router": 0, "math": 1, "code": 6, "chat": 11, "writer": 2}
    assert next_agents(wire) == ["math"]
    # other apps do not share counts
    assert m.expected_ste(g, {"router"}, app="other")["math"] == 3
    with pytest.raises(GraphError):
        TransitionModel(prior=0)


def test_and_join_takes_the_slowest_member_and_arrivals():
    g = AgentStepGraph("j")
    g.add_edge(START, "a")
    g.add_edge("a", "b", conditional=True)
    g.add_edge("a", "c", conditional=True)
    g.add_edge("a", "d")
    g.add_join(["b", "d"], "e")
    m = TransitionModel()
    m.observe("j", "a", "b", 3)  # P(b) = 4/5, P(c) = 1/5
    exp = m.expected_ste(g, {"a"})
    assert exp["e"] == pytest.approx(5 / 4 + 1)  # max(b = 1.25, d = 1) + 1
    assert m.expected_ste(g, {"d"}, {"e": {"b"}})["e"] == 1  # b arrived: d holds the barrier
    assert guaranteed_ste(g, {"a"}) == {"a": 0, "b": INF, "c": INF, "d": 1, "e": INF}


def test_wire_ste_rounds_half_up_and_keeps_exact_floor_and_nulls():
    assert wire_ste({"a": 1, "b": 2, "c": INF, "d": 0}, {"a": 1.4, "b": 2.5, "c": INF, "d": 0}) == \
        {"a": 1, "b": 3, "c": INF, "d": 0}
    assert wire_ste({"a": 3}, {"a": 1.0}) == {"a": 3}  # never below exact


def test_learned_tracker_counts_conditional_transitions_and_records_runs():
    g = peer_graph(2)  # reviewer -> expresser | END, conditional
    m = TransitionModel()
    rec = TraceRecorder()
    tr = LearnedTracker(g, m, workflow_id="w", recorder=rec)
    assert tr.wire_ste()["planner"] == 1 and tr.predicted_next() == ["planner"]

    def step(*agents):
        for a in list(tr.running):
            tr.finish(a)
        for a in agents:
            tr.start(a)

    step("planner"); step("executor_1", "executor_2"); step("expresser"); step("reviewer")
    assert tr.wire_ste()["expresser"] == 2  # 50/50 before learning
    step("expresser"); step("reviewer")
    for a in list(tr.running):
        tr.finish(a)
    tr.end()
    assert m.counts("peer") == {("reviewer", "expresser"): 1, ("reviewer", END): 1}
    assert rec.runs[0].steps == [["planner"], ["executor_1", "executor_2"], ["expresser"], ["reviewer"],
                                 ["expresser"], ["reviewer"]]
    assert set(tr.wire_ste().values()) == {INF}
    # a new run on the same tracker starts a new trace
    tr.start("planner")
    assert tr.steps == [["planner"]]


def test_between_steps_view():
    g = selector_graph(["a", "b", "c"], app="s")
    m = TransitionModel()
    exact, exp = ste_between_steps(g, m, ["a"], app="s")
    assert exact == {"a": 2, "b": 1, "c": 1}
    assert exp == {"a": pytest.approx(6), "b": pytest.approx(3), "c": pytest.approx(3)}


def test_model_json_round_trip(tmp_path):
    m = TransitionModel(prior=0.5)
    m.observe("app", START, "x", 2)
    m.observe("app", "x", END)
    p = tmp_path / "m.json"
    m.save(p)
    m2 = TransitionModel.load(p)
    assert m2.prior == 0.5 and m2.counts("app") == m.counts("app")
    with pytest.raises(GraphError, match=r"^not a transition model JSON document \(missing kvflow_transitions: 1\)$"):
        TransitionModel.from_json('{"nope": 1}')  # said once, not wrapped in "cannot read"
    for bad in ("[1, 2]", "not json", '{"kvflow_transitions": 2}'):
        with pytest.raises(GraphError, match="transition model"):
            TransitionModel.from_json(bad)


def test_traces_jsonl_round_trip_and_errors(tmp_path):
    graphs, runs = synthetic_selector_traces(4, 5, seed=1)
    buf = io.StringIO()
    write_traces(buf, graphs, runs)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6 and '"type": "graph"' in lines[0]
    g2, r2 = read_traces(io.StringIO(buf.getvalue()))
    assert [r.steps for r in r2] == [r.steps for r in runs]
    assert g2["selector"].to_json() == graphs["selector"].to_json()
    rec = TraceRecorder(tmp_path / "t.jsonl")
    rec.add_graph("selector", graphs["selector"])
    rec.add_run(runs[0])
    rec.add_run(runs[1])
    g3, r3 = read_traces(tmp_path / "t.jsonl")
    assert list(g3) == ["selector"] and len(r3) == 2
    with pytest.raises(GraphError, match="line 1"):
        read_traces(io.StringIO('{"type": "run", "app": "x", "steps": "abc"}\n'))
    with pytest.raises(GraphError, match="line 2"):
        read_traces(io.StringIO(lines[0] + "\nnot json\n"))


def test_synthetic_traces_are_seeded():
    a = synthetic_selector_traces(5, 20, seed=7)[1]
    b = synthetic_selector_traces(5, 20, seed=7)[1]
    c = synthetic_selector_traces(5, 20, seed=8)[1]
    assert [r.steps for r in a] == [r.steps for r in b] != [r.steps for r in c]


def test_prediction_improves_after_learning():
    graphs, runs = synthetic_selector_traces(5, 300, seed=0, skew=0.7)
    train_runs, test_runs = runs[:150], runs[150:]
    before = evaluate_predictions(graphs, test_runs, TransitionModel(), learn=False)
    m = TransitionModel()
    train(m, graphs, train_runs)
    after = evaluate_predictions(graphs, test_runs, m, learn=False)
    assert before.decisions == after.decisions > 0
    assert before.exact_accuracy == pytest.approx(before.learned_accuracy)  # uniform prior = ties
    assert 0.2 < before.exact_accuracy < 0.3  # 1 in 4 candidates
    assert after.learned_accuracy > 0.7 and after.learned_unique > 0.6 * after.decisions
    online = evaluate_predictions(graphs, runs, TransitionModel(), learn=True)
    assert online.learned_accuracy > 0.7


def test_evaluate_rejects_unknown_app():
    with pytest.raises(GraphError):
        evaluate_predictions({}, [TraceRun("nope", [["a"]])], TransitionModel())


def test_bench_predict_cli(tmp_path):
    import json as _json

    from typer.testing import CliRunner

    from kvflow_agents.cli.main import app

    out = tmp_path / "t.jsonl"
    r = CliRunner().invoke(app, ["bench", "predict", "--runs", "60", "--json", "--write-traces", str(out)])
    assert r.exit_code == 0, r.output
    doc = _json.loads(r.output)
    acc = {row["predictor"].split(",")[-1].strip(): row["accuracy"] for row in doc["results"]}
    assert acc["after 30 runs"] > acc["before learning"]
    r2 = CliRunner().invoke(app, ["bench", "predict", "--traces", str(out), "--json"])
    assert r2.exit_code == 0 and _json.loads(r2.output)["results"] == doc["results"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert CliRunner().invoke(app, ["bench", "predict", "--traces", str(bad)]).exit_code != 0


def test_saves_from_many_threads_at_once_all_land(tmp_path):
    """Runs ending on several threads flush the same file at once: every save lands whole
    (each thread writes its own temp file before the atomic replace)."""
    import threading

    from kvflow_agents.graph.learned import TransitionModel

    model = TransitionModel()
    model.observe("app", "a", "b", 3)
    path = tmp_path / "transitions.json"
    errors = []

    def save_many():
        for _ in range(20):
            try:
                model.save(path)
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=save_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transitions.json"]
    assert TransitionModel.from_json(path.read_text()).counts("app") == model.counts("app")


# ---------------------------------------------------------------------------- context (second order)
def react_graph() -> AgentStepGraph:
    """A planner fans out to a ReAct agent (agent -> tools -> agent), then a writer: the agent's
    choice (tools or on to the writer) depends on where it came from, not on the agent alone."""
    g = AgentStepGraph("react")
    g.add_edge(START, "planner")
    g.add_edge("planner", "agent")
    g.add_edge("agent", "tools", conditional=True)
    g.add_edge("agent", "writer", conditional=True)
    g.add_edge("tools", "agent")
    g.add_edge("writer", END)
    return g


def _replay(tr: LearnedTracker, *steps) -> None:
    for agents in steps:
        for a in list(tr.running):
            tr.finish(a)
        for a in agents:
            tr.start(a)


def _brute_expected(g: AgentStepGraph, m: TransitionModel, app: str, start: str, came_from,
                    horizon: int = 8) -> dict[str, float]:
    """Reference: shortest expected distance by enumerating every path of up to ``horizon``
    edges from ``start`` (reached from ``came_from``), each edge 1 / P(v | u, reached from)."""
    best = {a: INF for a in g.agents}
    best[start] = 0.0
    stack = [(start, came_from, 0.0, 0)]
    while stack:
        u, w, d, k = stack.pop()
        if k == horizon:
            continue
        for v in g.successors(u):
            p = m.probability(app, g, u, v, after=w)
            if p > 0:
                nd = d + 1.0 / p
                best[v] = min(best[v], nd)
                stack.append((v, u, nd, k + 1))
    return best


def test_context_tells_a_react_agents_first_turn_from_its_answer():
    g = react_graph()
    m = TransitionModel()
    tr = LearnedTracker(g, m)
    for _ in range(6):
        _replay(tr, ["planner"], ["agent"], ["tools"], ["agent"], ["writer"])
        for a in list(tr.running):
            tr.finish(a)
        tr.end()
    # first order: from "agent" it is 50/50 tools or writer, whichever turn it is
    assert m.counts("react") == {("agent", "tools"): 6, ("agent", "writer"): 6}
    assert m.probability("react", g, "agent", "writer") == pytest.approx(0.5)
    # second order: after the planner it calls the tool, after the tool it answers
    assert m.context_counts("react") == {("planner", "agent", "tools"): 6, ("tools", "agent", "writer"): 6}
    p_tools = m.probability("react", g, "agent", "tools", after="planner")
    # backed off to what the other context saw (tools never after a tool): (0 + 1) / (6 + 2)
    assert p_tools == pytest.approx((6 + 2 * (1 / 8)) / (6 + 2))
    assert m.probability("react", g, "agent", "writer", after="tools") == pytest.approx(p_tools)

    q = LearnedTracker(g, m, learn=False)
    _replay(q, ["planner"], ["agent"])
    assert q.contexts() == {"agent": {"planner"}}
    first_turn = q.expected_ste()
    assert first_turn["tools"] == pytest.approx(1 / p_tools)
    assert first_turn["writer"] == pytest.approx(1 / p_tools + 1 + 1 / p_tools)  # tool, back, answer
    assert q.wire_ste()["writer"] == 4                  # 3.56 after 6 runs: 3 is the truth
    _replay(q, ["tools"], ["agent"])
    assert q.contexts() == {"agent": {"tools"}}
    answering = q.expected_ste()
    assert answering["writer"] == pytest.approx(1 / p_tools)
    assert q.wire_ste()["writer"] == 1                  # first order said 2 on both turns
    assert m.wire_ste(g, {"agent"})["writer"] == 2
    # the pass over (agent, reached from) states equals enumerating every path
    for ctx, got in (("planner", first_turn), ("tools", answering)):
        assert got == pytest.approx(_brute_expected(g, m, "react", "agent", ctx))


def test_context_of_fanned_out_instances_and_backoff_without_evidence():
    g = react_graph()
    m = TransitionModel()
    # no context evidence: the context distribution is the first-order one
    m.observe("react", "agent", "tools", 3)
    first = m.distribution("react", "agent", ["tools", "writer"])
    assert m.distribution("react", "agent", ["tools", "writer"], after="planner") == first
    # ... and an agent always reached from one predecessor: that context says nothing new
    m.observe_after("react", "planner", "agent", "tools", 3)
    assert m.distribution("react", "agent", ["tools", "writer"], after="planner") == pytest.approx(first)
    tr = LearnedTracker(g, m, learn=False)
    tr.start("planner", step=1)
    tr.finish("planner")
    tr.start("agent", step=2)                         # a Send fan-out: two instances
    tr.start("agent", step=2)
    tr.finish("agent")                                # one calls its tool first
    tr.start("tools", step=3)
    tr.finish("tools")
    tr.start("agent", step=4)                         # ... and is back while the other still runs
    assert tr.contexts() == {"agent": {"planner", "tools"}}
    ste = tr.expected_ste()
    assert ste == tr.model.expected_ste(g, {"agent"}, after={"agent": {"planner", "tools"}})
    tr.finish("agent")                                # the oldest instance goes first
    assert tr.contexts() == {"agent": {"tools"}}
    tr.cancel("agent")
    assert tr.contexts() == {}
    # an agent whose start followed none of its predecessors has no context (first order)
    tr2 = LearnedTracker(g, m, learn=False)
    _replay(tr2, ["planner"], ["writer"])
    assert tr2.contexts() == {"writer": {None}}


def test_context_counts_round_trip_merge_and_old_files(tmp_path):
    m = TransitionModel()
    m.observe("react", "agent", "tools", 2)
    m.observe_after("react", "planner", "agent", "tools", 2)
    p = tmp_path / "m.json"
    m.save(p)
    m2 = TransitionModel.load(p)
    assert m2.context_counts("react") == {("planner", "agent", "tools"): 2}
    m2.merge(m)
    assert m2.count("react", "agent", "tools", after="planner") == 4
    old = TransitionModel.from_json('{"kvflow_transitions": 1, "prior": 1.0, "counts": {"a": {"x": {"y": 1}}}}')
    assert old.counts("a") == {("x", "y"): 1} and old.context_counts("a") == {}
    with pytest.raises(GraphError):
        TransitionModel.from_json('{"kvflow_transitions": 1, "counts": {}, "after": {"a": {"x": 3}}}')
    m2.reset("react")
    assert m2.context_counts("react") == {} and m2.counts("react") == {}


def test_replayed_react_runs_are_predicted_better_with_context():
    g = react_graph()
    runs = [TraceRun("react", [["planner"], ["agent"], ["tools"], ["agent"], ["writer"]]) for _ in range(20)]
    rep = evaluate_predictions({"react": g}, runs, TransitionModel(), learn=True)
    # the agent's two decisions per run: first order ties them (credit 1/2 each), the context
    # row gets both right once learned
    assert rep.learned_accuracy > 0.9 > 0.75 >= rep.exact_accuracy


def test_a_fan_outs_exit_is_counted_once_per_instance():
    """Three instances of a ReAct agent (a Send fan-out) each call the tool once and then all
    leave for the one writer: 3 tool calls and 3 exits, not 3 and 1."""
    g = react_graph()
    m = TransitionModel()
    tr = LearnedTracker(g, m)
    for agents in (["planner"], ["agent"] * 3, ["tools"] * 3, ["agent"] * 3, ["writer"]):
        for a in list(tr.running):
            while a in tr.running:
                tr.finish(a)
        for a in agents:
            tr.start(a)
    assert m.count("react", "agent", "writer") == 1   # the writer's start: one so far
    tr.finish("writer")
    tr.end()                                           # its step is complete: topped up
    assert m.counts("react") == {("agent", "tools"): 3, ("agent", "writer"): 3}
    assert m.context_counts("react") == {("planner", "agent", "tools"): 3, ("tools", "agent", "writer"): 3}
    # a fan-out into as many successors as instances is counted start by start, not topped up
    m2 = TransitionModel()
    tr2 = LearnedTracker(g, m2)
    for agents in (["planner"], ["agent"] * 2, ["tools"] * 2, ["agent"]):
        for a in list(tr2.running):
            while a in tr2.running:
                tr2.finish(a)
        for a in agents:
            tr2.start(a)
    assert m2.counts("react") == {("agent", "tools"): 2}
