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
    with pytest.raises(GraphError):
        TransitionModel.from_json('{"nope": 1}')


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
