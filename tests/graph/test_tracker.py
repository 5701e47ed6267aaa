import math
import threading

import pytest

from kvflow_agents.graph import END, START, AgentStepGraph, GraphError
from kvflow_agents.graph.examples import peer_graph

INF = math.inf


def test_tracker_walks_peer_and_consumes_barrier_arrivals():
    g = peer_graph(2)
    tr = g.tracker("w1")
    assert tr.ste()["planner"] == 1 and tr.next_agents() == ["planner"]
    tr.start("planner")
    assert tr.step == 1 and tr.next_agents() == ["executor_1", "executor_2"]
    tr.finish("planner")
    tr.start("executor_1")
    tr.start("executor_2")
    assert tr.step == 2  # parallel agents share a step
    tr.finish("executor_1")
    assert tr.arrived == {"expresser": frozenset({"executor_1"})}
    assert tr.ste()["expresser"] == 1 and tr.ste()["executor_1"] == INF
    tr.finish("executor_2")
    assert tr.ste()["expresser"] == 1  # every member arrived: fires next step
    tr.start("expresser")
    assert tr.step == 3 and tr.arrived == {}  # consumed when the joined agent starts
    assert tr.ste() == {"planner": INF, "executor_1": INF, "executor_2": INF, "expresser": 0, "reviewer": 1}
    tr.finish("expresser")
    tr.start("reviewer")
    assert tr.ste()["expresser"] == 1  # the review loop
    tr.finish("reviewer")
    tr.end()
    assert set(tr.ste().values()) == {INF} and tr.next_agents() == []


def test_send_fanout_instances_count_until_last_finishes():
    g = AgentStepGraph()
    g.add_edge(START, "plan")
    g.add_edge("plan", "worker")
    g.add_edge("worker", "write")
    tr = g.tracker()
    tr.start("plan"); tr.finish("plan")
    for _ in range(3):
        tr.start("worker")
    tr.finish("worker"); tr.finish("worker")
    assert tr.ste()["worker"] == 0 and tr.running == {"worker"}
    tr.finish("worker")
    assert tr.running == set()
    with pytest.raises(GraphError):
        tr.finish("worker")


def test_explicit_steps_and_errors():
    g = AgentStepGraph()
    g.add_edge("a", "b")
    tr = g.tracker()
    tr.start("a", step=4)
    assert tr.step == 4
    with pytest.raises(GraphError):
        tr.start("b", step=3)
    with pytest.raises(GraphError):
        tr.start("nobody")


def test_tracker_is_thread_safe_under_concurrent_transitions():
    g = AgentStepGraph()
    for i in range(8):
        g.add_edge("hub", f"w{i}")
    tr = g.tracker()

    def work(i):
        for _ in range(200):
            tr.start(f"w{i}")
            tr.ste()
            tr.finish(f"w{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tr.running == set()


def test_cancel_drops_a_running_agent_without_arriving():
    """An interrupted node (LangGraph ``interrupt()``) runs again from the start on resume: it
    leaves the running set but does not arrive at its barrier."""
    g = peer_graph(2)
    tr = g.tracker("w")
    tr.start("planner")
    tr.finish("planner")
    tr.start("executor_1")
    tr.start("executor_2")
    tr.finish("executor_1")
    tr.cancel("executor_2")
    assert tr.running == set() and tr.arrived == {"expresser": frozenset({"executor_1"})}
    assert tr.ste()["expresser"] == INF   # executor_2 has not arrived and cannot run again
    tr.cancel("executor_2")               # not running: nothing happens
    assert tr.history[-1] == (2, "cancel", "executor_2")
