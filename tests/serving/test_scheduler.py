"""The engine's ``Scheduler`` without an engine: the status-aware skip and its age rule, the
skip scope (who may run ahead of a request whose prefix is loading) and the first looks that
start, or hold back, demand loads; the policy core's sessions decide readiness."""

from __future__ import annotations

import pytest

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.embedded.scheduler import Request, RequestState, SamplingParams, Scheduler


def test_scheduler_status_aware_skip_and_age_rule():
    now = [100.0]
    s = Scheduler(max_batch=4, status_aware=True, max_skip_s=5.0, clock=lambda: now[0])
    reqs = [Request([1] * 10, SamplingParams(max_tokens=1), lambda ev: None, arrival=100.0 - i)
            for i in range(3)]
    for r in reqs:
        s.add(r)
    ready = {reqs[1].rid, reqs[2].rid}
    assert [r.rid for r in s.admission_plan(lambda r: r.rid in ready)] == [reqs[1].rid, reqs[2].rid]
    now[0] = 106.0                                   # reqs[0] waited > max_skip_s: it blocks
    assert list(s.admission_plan(lambda r: r.rid in ready)) == []
    s2 = Scheduler(max_batch=4, status_aware=False)   # head-of-line without status awareness
    for r in reqs:
        s2.add(r)
    assert list(s2.admission_plan(lambda r: r.rid in ready)) == []


@pytest.mark.parametrize("scope,first,loading,want", [
    ("all", "a1", True, ["a2", "b1", "c1"]),       # the paper's skip: anyone behind it goes
    ("workflow", "a1", True, ["a2", "c1"]),        # its sibling and a request without hints
                                                   # go; workflow B's call keeps its place
    ("workflow", "c0", True, ["a1", "a2", "b1"]),  # a loading request without hints holds no one
    ("workflow", "a1", False, ["a2", "b1", "c1"]),  # nor does one whose load waits for room
])
def test_skip_scope_decides_who_runs_ahead_of_a_loading_request(scope, first, loading, want):
    """The first request (``first``) is not ready: its load is in flight (``loading``) or
    could not start; the others are ready. Sessions and admission keys come from the policy
    core (workflow order: A's calls, then B's)."""
    from kvflow_agents.serving.policy import KVCacheManager

    mgr = KVCacheManager("kvflow", device_pages=64, host_pages=64)
    sched = Scheduler(max_batch=8, status_aware=True, skip_scope=scope, clock=lambda: 100.0)
    names = ["c0"] if first == "c0" else []
    names += ["a1", "a2", "b1"] + (["c1"] if first != "c0" else [])
    for name in names:
        wf = {"a": "A", "b": "B"}.get(name[0])
        req = Request([1] * 10, SamplingParams(max_tokens=1), lambda ev: None, rid=name, arrival=100.0)
        hints = Hints(workflow=wf, agent=name, step=1, ste={name: 0}) if wf else None
        req.session = mgr.arrive(req.prompt_ids, hints)
        sched.add(req)
    assert [r.rid for r in sched.waiting][0] == first
    if loading:
        sched.waiting[0].state = RequestState.LOADING     # as Request.poll leaves it
    assert [r.rid for r in sched.admission_plan(lambda r: r.rid != first)] == want
    with pytest.raises(ValueError, match="skip scope"):
        Scheduler(skip_scope="nobody")


@pytest.mark.parametrize("scope", ["workflow", "all"])
def test_first_looks_start_no_load_for_a_request_the_skip_scope_passes_over(scope):
    """Workflow A's call finds its prefix on host only; so does workflow B's call behind it.
    The engine's first look (``first_looks`` + ``Request.poll``) starts A's demand load. Under
    ``workflow`` B's first look pins and counts it but starts no load (B may not run before A's
    call, and its load would share the FIFO link with A's); the admission plan starts it once
    A's call is in. Under ``all`` both loads go on the link at once."""
    from kvflow_agents.serving.policy import KVCacheManager, NullTransferBackend

    clock = [0.0]
    link = NullTransferBackend(bytes_per_page=1, link_bytes_per_s=3.0, clock=lambda: clock[0])
    mgr = KVCacheManager("kvflow", page_size=1, device_pages=12, host_pages=64, backend=link)
    for toks in ([10] * 3, [11] * 3):          # A's and B's prefixes, left by earlier calls
        mgr.insert(toks, mgr.allocate(3))
    mgr.free(mgr.allocate(mgr.device.num_free + mgr.evictable_device_pages))  # all to host
    assert mgr.match([10] * 3, record=False).needs_load and mgr.match([11] * 3, record=False).needs_load
    sched = Scheduler(max_batch=8, status_aware=True, skip_scope=scope, clock=lambda: 0.0)
    for rid, wf, toks in [("a1", "A", [10] * 3 + [1]), ("b1", "B", [11] * 3 + [2]),
                          ("c1", None, [12] * 4)]:
        req = Request(toks, SamplingParams(max_tokens=1), lambda ev: None, rid=rid, arrival=0.0)
        hints = Hints(workflow=wf, agent=rid, step=1, ste={rid: 0}) if wf else None
        req.session = mgr.arrive(req.prompt_ids, hints, kv_tokens=5)
        sched.add(req)
    looks = []
    for req, start_load in sched.first_looks():
        looks.append((req.rid, start_load))
        req.poll(start_load)
    state = {r.rid: r.state.value for r in sched.waiting}
    if scope == "workflow":
        assert looks == [("a1", True), ("b1", False), ("c1", True)]
        assert state == {"a1": "loading", "b1": "waiting", "c1": "waiting"}
        assert mgr.metrics.demand_loads == 1
    else:
        assert looks == [("a1", True), ("b1", True), ("c1", True)]
        assert state == {"a1": "loading", "b1": "loading", "c1": "waiting"}
        assert mgr.metrics.demand_loads == 2
    assert mgr.metrics.hit_tokens_host == 6                 # both first looks counted their hit
    def plan() -> list:                                     # one admission pass, as the engine does it
        took = []
        for r in sched.admission_plan(lambda r: r.session.looked and r.poll()):
            sched.admitted(r)
            took.append(r.rid)
        return took
    assert plan() == ["c1"]
    assert sched.passes == {"skipped": 1 + (scope == "all"),
                            "held_for_workflow": int(scope == "workflow")}
    clock[0] = 1.5             # A's 3-page load has landed (and B's, under all: this backend's
    mgr.tick(clock[0])         # loads do not queue; the embedded pool's emulated link does)
    assert plan() == ["a1"] + (["b1"] if scope == "all" else [])
    assert mgr.metrics.demand_loads == 2                     # B's: at its first look, or now
    if scope == "workflow":
        clock[0] = 2.5
        mgr.tick(clock[0])
        assert plan() == ["b1"]
