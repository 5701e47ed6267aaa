"""A new workflow instance of an app can protect and prefetch an agent's fixed prefix from its
first hint, before that agent has run in the new instance (one PEER question = one workflow)."""

from kvflow_agents.serving.policy import PrefixStatus
from policy_driver import make_manager
from policy_driver import put as _put

APP = "peer"
X = list(range(100, 108))   # agent x's fixed prefix (8 tokens)
Y = list(range(200, 208))   # agent y's fixed prefix


def put(m, tokens, wf, agent, app=APP):
    return _put(m, tokens, wf, agent, app=app)


def test_hint_in_a_new_workflow_binds_the_apps_known_prefix():
    m = make_manager("kvflow", page_size=2, device_pages=8, host_pages=64)
    put(m, X, "q1", "x")
    put(m, Y, "q1", "y")
    m.release_workflow("q1", app=APP)
    # Question 2 starts: x runs, y is next. y has not run in q2, yet its prefix is protected.
    m.update_hints("q2", {"x": 0, "y": 1}, agent="x", app=APP)
    y_node = m.match(Y, record=False).node
    assert m.index.priority(y_node) == 1
    snap = {(a["workflow"], a["agent"]): a for a in m.snapshot()["agents"]}
    assert snap[(f"{APP}/q2", "y")]["priority"] == 1
    m.check_invariants()


def test_new_workflow_prefetches_a_host_only_prefix_it_has_not_used_yet():
    m = make_manager("kvflow", page_size=2, device_pages=8, host_pages=64, link=1.0)
    put(m, X, "q1", "x")
    put(m, Y, "q1", "y")
    m.release_workflow("q1", app=APP)
    # Fill the device with other work: x and y (untagged now) go to host.
    filler = list(range(900, 916))
    pages = m.allocate(8)
    assert pages is not None
    m.insert(filler, pages)
    assert m.status(Y) is PrefixStatus.NEEDS_LOAD
    started = m.update_hints("q2", {"x": 0, "y": 1}, agent="x", app=APP)
    assert (f"{APP}/q2", "y") in started
    m.clock.t += 100
    m.tick()
    assert m.status(Y) is PrefixStatus.READY
    m.check_invariants()


def test_without_an_app_workflows_stay_separate():
    m = make_manager("kvflow", page_size=2, device_pages=8, host_pages=64)
    put(m, Y, "q1", "y", app=None)
    m.release_workflow("q1")
    m.update_hints("q2", {"x": 0, "y": 1}, agent="x")
    assert ("q2", "y") not in {(a["workflow"], a["agent"]) for a in m.snapshot()["agents"]}
    assert m.index.priority(m.match(Y, record=False).node) == float("inf")
