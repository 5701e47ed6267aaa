"""A workflow that goes quiet for longer than its lease and grace is forgotten (memory follows
the live workflows), but when it hints again its agents' own fixed prefixes are tagged at once:
its next agent is protected and prefetched before it has run again, and it does not bind
another instance's prefix of the same app and agent (serving/policy/tags.py, ``dormant``)."""

from kvflow_agents.serving.policy import PrefixStatus
from policy_driver import make_manager
from policy_driver import put

APP = "bench"
X_A = list(range(100, 108))   # workflow a's agent x
Y_A = list(range(200, 208))   # workflow a's agent y
Y_B = list(range(300, 308))   # workflow b's agent y: same app and agent name, its own prompt
QUIET_S = 100.0               # past the 60 s lease, then past the 60 s grace


def _forget_the_quiet(m):
    for _ in range(2):            # the lease runs out, then the grace
        m.clock.t += QUIET_S
        m.tick()


def _a_and_b_then_a_forgotten(app):
    m = make_manager("kvflow", page_size=2, device_pages=12, host_pages=64, link=1.0)
    m.update_hints("a", {"x": 0, "y": 1}, agent="x", app=app)
    put(m, X_A, "a", "x", app=app)
    m.update_hints("a", {"x": 1, "y": 0}, agent="y", app=app)
    put(m, Y_A, "a", "y", app=app)
    m.update_hints("b", {"y": 0}, agent="y", app=app)
    put(m, Y_B, "b", "y", app=app)   # b ran y last: the app's remembered y is b's
    m.release_workflow("b", app=app)  # b ended
    _forget_the_quiet(m)              # a's lease and grace ran out: forgotten
    assert m.snapshot()["agents"] == []
    filler = list(range(900, 924))    # other work fills the device: a's prefixes go to host
    pages = m.allocate(12)
    assert pages is not None
    m.insert(filler, pages)
    assert m.status(Y_A) is PrefixStatus.NEEDS_LOAD
    return m


def test_a_forgotten_workflow_prefetches_its_own_next_agent_when_it_resumes():
    m = _a_and_b_then_a_forgotten(APP)
    started = m.update_hints("a", {"x": 0, "y": 1}, agent="x", app=APP)
    assert (f"{APP}/a", "y") in started
    assert m.index.priority(m.match(Y_A, record=False).node) == 1
    m.clock.t += 100
    m.tick()
    assert m.status(Y_A) is PrefixStatus.READY       # a's own y ...
    assert m.status(Y_B) is PrefixStatus.NEEDS_LOAD  # ... not b's, the app's last y
    m.check_invariants()


def test_without_an_app_a_forgotten_workflow_gets_its_tags_back():
    m = _a_and_b_then_a_forgotten(None)
    started = m.update_hints("a", {"x": 0, "y": 1}, agent="x")
    assert ("a", "y") in started
    m.clock.t += 100
    m.tick()
    assert m.status(Y_A) is PrefixStatus.READY
    m.check_invariants()


def test_an_ended_workflow_is_not_restored():
    """``release_workflow`` (the client's "end" event) forgets for good: the same key hinting
    later is a new workflow."""
    m = make_manager("kvflow", page_size=2, device_pages=12, host_pages=64, link=1.0)
    put(m, Y_A, "a", "y")
    m.release_workflow("a")
    m.update_hints("a", {"x": 0, "y": 1}, agent="x")
    assert ("a", "y") not in {(a["workflow"], a["agent"]) for a in m.snapshot()["agents"]}


def test_a_tool_gaps_resume_tag_is_not_remembered():
    """A resume tag belongs to its tool gap, which goes with the forgotten workflow."""
    from kvflow_agents.serving.policy.toolgap import resume_agent

    m = make_manager("kvflow", page_size=2, device_pages=64, host_pages=256)
    m.update_hints("a", {"y": 0}, agent="y")
    put(m, Y_A, "a", "y")
    m.tags.tag_fixed_prefix(Y_A + [7, 8], 10, "a", resume_agent("y"), remember=False)
    _forget_the_quiet(m)
    assert list(m.tags._dormant["a"]) == ["y"]


def test_the_remembered_prefixes_are_bounded():
    m = make_manager("kvflow", page_size=2, device_pages=64, host_pages=256)
    m.tags.max_dormant_prefixes = 3
    for i in range(4):                # four workflows, one agent each
        m.update_hints(f"w{i}", {"y": 0}, agent="y")
        put(m, list(range(1000 + 10 * i, 1008 + 10 * i)), f"w{i}", "y")
    _forget_the_quiet(m)
    assert list(m.tags._dormant) == ["w1", "w2", "w3"]  # the oldest went first
    assert m.tags._dormant_prefixes == 3
