"""Admission order (serving/policy/admission.py): the key every engine sorts its waiting
requests by. kvflow: the oldest workflow's call first, ties by workflow, bounded age; the
baselines: request arrival (SGLang's FCFS). The engines' use of it is tested with them
(tests/sim/test_simulator.py, tests/serving/test_serving_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvflow_agents.serving.policy import KVFlowPolicy, get_policy
from kvflow_agents.serving.policy.admission import AdmissionOrder
from policy_driver import make_manager


def hint(wf, agent):
    return SimpleNamespace(workflow=wf, agent=agent, ste={agent: 0}, step=0, app=None, event=None)


def arrive(m, wf, agent, t):
    m.clock.t = t
    return m.arrive([1, 2, 3, 4], hint(wf, agent) if wf else None, kv_tokens=8)


def order(sessions):
    return [name for name, s in sorted(sessions.items(), key=lambda kv: kv[1].admission_key)]


def test_policies_declare_their_admission_order():
    assert get_policy("kvflow").admission == "workflow"
    assert {get_policy(p).admission for p in ("lru", "hicache", "oracle")} == {"fcfs"}
    assert KVFlowPolicy(admission="fcfs").admission == "fcfs"
    with pytest.raises(ValueError, match="admission"):
        KVFlowPolicy(admission="lifo")
    with pytest.raises(ValueError, match="unknown admission order"):
        AdmissionOrder("sjf")


def test_workflow_order_puts_an_old_workflows_next_call_first():
    m = make_manager("kvflow")
    s = {"A1": arrive(m, "A", "a", 0.0), "B1": arrive(m, "B", "a", 1.0),
         "solo": arrive(m, None, None, 2.0), "C1": arrive(m, "C", "a", 3.0),
         "A2": arrive(m, "A", "b", 4.0), "B2": arrive(m, "B", "b", 5.0)}
    # A started first, then B; a request without hints is a one-call workflow of its own
    assert order(s) == ["A1", "A2", "B1", "B2", "solo", "C1"]
    fcfs = make_manager("hicache")
    f = {k: arrive(fcfs, *args) for k, args in (("A1", ("A", "a", 0.0)), ("B1", ("B", "a", 1.0)),
                                                 ("A2", ("A", "b", 4.0)))}
    assert order(f) == ["A1", "B1", "A2"]
    over = make_manager("kvflow", admission="fcfs")   # the engine's override
    o = {k: arrive(over, *args) for k, args in (("A1", ("A", "a", 0.0)), ("B1", ("B", "a", 1.0)),
                                                 ("A2", ("A", "b", 4.0)))}
    assert order(o) == ["A1", "B1", "A2"]


def test_workflows_started_together_keep_their_own_order():
    """Workflows arriving at the same instant (the simulator's t=0) are ordered by their first
    request, not interleaved call by call."""
    m = make_manager("kvflow")
    s = {f"{w}{i}": arrive(m, w, f"x{i}", 0.0) for i in (1, 2) for w in "PQR"}
    assert order(s) == ["P1", "P2", "Q1", "Q2", "R1", "R2"]


def test_age_cap_bounds_how_long_a_newer_request_waits():
    """An old workflow counts as at most ``max_age_s`` older than its request: a request that
    arrived more than that before it goes first (no starvation by a workflow id kept forever)."""
    m = make_manager("kvflow", admission_max_age_s=10.0)
    s = {"old1": arrive(m, "old", "a", 0.0), "new1": arrive(m, "new", "a", 100.0),
         "old2": arrive(m, "old", "b", 105.0), "old3": arrive(m, "old", "c", 115.0)}
    assert order(s) == ["old1", "old2", "new1", "old3"]


def test_ended_workflow_starts_over_and_reserve_follows_admission_order():
    m = make_manager("kvflow", device_pages=64, reserve_window=1)
    a = arrive(m, "A", "a", 0.0)
    m.apply_hints(SimpleNamespace(workflow="A", agent="a", ste={}, step=None, app=None, event="end"))
    b = arrive(m, "B", "a", 1.0)
    a2 = arrive(m, "A", "b", 2.0)       # A was released: a new workflow, younger than B
    assert b.admission_key < a2.admission_key and a.admission_key < b.admission_key
    big = m.arrive(list(range(40)), hint("C", "a"), kv_tokens=40)
    for s in (a, b, a2):
        s.finish(cache=False)           # aborted while waiting
    m.clock.t = 3.0
    small = arrive(m, "B", "b", 3.0)     # B is older than C: its request is the one reserved
    assert m._session_reserve() == small.reserve_pages() < big.reserve_pages()
