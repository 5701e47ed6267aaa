"""The three policy-core fixes the simulator asked for:

1. prefetch admission budget (``reserve_pages`` / ``set_reserved_pages``): a prefetch never
   takes device space that queued / admitted work will allocate, so it is not evicted before use
   (thrash); wasted = evicted unused or its workflow released;
2. honest hidden/exposed accounting: ``status(tokens, record=True)`` marks when a request first
   waited on an in-flight prefetch, and that wait is exposed;
3. load versus recompute: ``recompute_s_per_token`` / ``recompute_cost`` / ``load_on_demand(...,
   recompute_s=)`` and the planner's ``PrefetchCandidate.recompute_s``.
"""

from __future__ import annotations

import math

import pytest

from kvflow_agents.serving.policy import PrefetchCandidate, PrefetchPlanner, PrefixStatus
from policy_driver import make_manager, put

INF = math.inf



def host_only(m, tokens, wf, agent):
    """Put an agent's prefix on device, then push it to host."""
    put(m, tokens, wf, agent, len(tokens))
    held = m.allocate(m.device.num_free + m.evictable_device_pages)
    assert m.agent_residency(wf, agent) == "host"
    m.free(held)


# ------------------------------------------------------------------ 1. prefetch budget
def _overflowing_pool(reserve):
    """16 device pages: 12 locked by three running requests, 4 of a finished request's
    leftovers (+inf, unlocked), 0 free; agent A's 4-page prefix is host-only (STE 1 next)."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, reserve_pages=reserve)
    host_only(m, [10] * 4, "w", "A")
    running = []
    for i in range(3):
        toks = [100 + i] * 4
        put(m, toks)
        running.append(m.lock(m.match(toks, record=False)))
    put(m, [50, 51, 52, 53])                       # finished request's leftovers
    assert m.device.num_free == 0 and m.evictable_device_pages == 4
    return m, running


@pytest.mark.parametrize("reserve", [0, 4])
def test_prefetch_does_not_take_room_an_admission_will_reclaim(reserve):
    """The simulator's thrash, manager-level: with no reserve the prefetch evicts the leftovers
    to place A, and the next admitted request's allocation (everything else is locked) evicts
    the prefetched, still unused prefix. With the waiting request's 4 pages reserved the
    prefetch waits, the allocation takes the leftovers, and nothing is wasted."""
    m, running = _overflowing_pool(reserve)
    m.update_hints("w", {"A": 1})
    if reserve == 0:  # the thrash (pre-fix behaviour, still what an engine without reserve gets)
        assert m.metrics.prefetch_issued == 1
        assert m.agent_residency("w", "A") == "device"
    else:
        assert m.metrics.prefetch_issued == 0 and m.metrics.prefetch_budget_skips >= 1
        assert m.agent_residency("w", "A") == "host"
        assert m.evictable_device_pages == 4  # nothing was evicted for a prefetch
    pages = m.allocate(4)                          # the waiting request is admitted
    assert pages is not None
    if reserve == 0:
        assert m.metrics.prefetch_wasted == 1 and m.metrics.prefetch_used == 0
        assert m.agent_residency("w", "A") == "host"
    else:
        assert m.metrics.prefetch_wasted == 0
        # a running request finishes and the queue is empty: now the prefetch fits
        m.set_reserved_pages(0)
        m.free(pages)
        m.unlock(running.pop())
        rep = m.tick()
        assert rep.prefetches_started == [("w", "A")]
        assert m.match([10] * 4).device_len == 4 and m.metrics.prefetch_used == 1
        assert m.metrics.prefetch_wasted == 0
    m.check_invariants()


def test_reserve_callable_is_evaluated_only_when_a_prefetch_needs_room():
    calls = []

    def reserve():
        calls.append(1)
        return 0

    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, reserve_pages=reserve)
    host_only(m, [10] * 4, "w", "A")
    m.update_hints("w", {"A": 5})                  # beyond lookahead: no candidate
    assert not calls
    m.update_hints("w", {"A": 1})
    assert calls and m.metrics.prefetch_issued == 1
    assert m.reserved_pages == 0


def test_prefetch_room_counts_only_strictly_larger_priorities():
    m = make_manager("kvflow", page_size=1, device_pages=12, host_pages=64)
    put(m, [1] * 3, "w", "B", 3)
    put(m, [2] * 3, "w", "C", 3)
    put(m, [3] * 3)                                # +inf
    m.update_hints("w", {"B": 1, "C": 2})
    assert m.device.num_free == 3
    assert m.prefetch_room(1) == 3 + 3 + 3         # free + C (2) + suffix (inf)
    assert m.prefetch_room(2) == 3 + 3
    m.set_reserved_pages(5)
    assert m.prefetch_room(2) == 1


def test_allocation_evicts_larger_priorities_before_an_unused_prefetch():
    """Verify the existing order: a prefetched, unused prefix (STE 1) goes only after every
    node of larger priority (+inf suffixes, STE 2); among equal priorities the just-fetched one
    is the most recently used."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64)
    host_only(m, [10] * 3, "w", "A")
    put(m, [20] * 3, "w", "B", 3)                  # STE 2
    put(m, [21] * 3, "w", "D", 3)                  # STE 1, used before A's prefetch
    put(m, [30] * 3)                               # +inf
    log = []
    m.on_evict = lambda n, tier, prio, reason: log.append((tier, prio, reason))
    m.update_hints("w", {"A": 1, "B": 2, "D": 1})
    assert m.agent_residency("w", "A") == "device"
    assert m.metrics.prefetch_issued == 1
    free = m.device.num_free
    got = m.allocate(free + 9)                     # +inf (3) and B (3) and D (3), not A
    assert got is not None
    assert [p for t, p, _ in log if t == "device"] == [INF, 2, 1]
    assert m.agent_residency("w", "A") == "device"
    assert m.agent_residency("w", "D") == "host"
    assert m.metrics.prefetch_wasted == 0
    m.check_invariants()


def test_prefetch_wasted_when_evicted_unused_or_released_not_when_stale():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64)
    host_only(m, [10] * 3, "w", "A")
    host_only(m, [11] * 3, "v", "B")
    m.update_hints("w", {"A": 1})
    m.update_hints("v", {"B": 1})
    assert m.metrics.prefetch_issued == 2
    m.update_hints("w", {"A": 4})                  # newer hint: not wasted by itself
    assert m.metrics.prefetch_wasted == 0
    m.release_workflow("w")                        # A will never run: wasted
    assert m.metrics.prefetch_wasted == 1
    assert dict(m.metrics.prefetch_wasted_by) == {"workflow_end": 1}
    assert m.match([11] * 3).device_len == 3       # B used
    m.release_workflow("v")                        # used before release: not wasted
    assert m.metrics.prefetch_wasted == 1 and m.metrics.prefetch_used == 1
    m.check_invariants()


# ------------------------------------------------------------------ 2. hidden / exposed
@pytest.mark.parametrize("record", [False, True])
def test_status_record_charges_the_wait_on_an_in_flight_prefetch(record):
    """3-page prefetch at 1 page/s, started at 0, ready at 3. The request first tries at 1
    (status says LOADING: a status-aware engine skips it), runs at 4 after the load landed.
    Honest: 1 s hidden, 2 s exposed. Without ``record`` the wait is invisible to the core."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0)
    host_only(m, [10] * 3, "w", "A")
    m.update_hints("w", {"A": 1}, now=0.0)
    m.clock.t = 1.0
    assert m.status([10] * 3, record=record) is PrefixStatus.LOADING
    m.clock.t = 2.0
    assert m.status([10] * 3, record=record) is PrefixStatus.LOADING  # first attempt kept
    m.clock.t = 4.0
    m.tick()
    assert m.status([10] * 3, record=record) is PrefixStatus.READY
    pm = m.match([10] * 3)
    assert pm.device_len == 3 and m.metrics.prefetch_used == 1
    if record:
        assert m.metrics.load_hidden_s == pytest.approx(1.0)
        assert m.metrics.load_exposed_s == pytest.approx(2.0)
        assert m.metrics.as_dict()["load_hidden_fraction"] == pytest.approx(1 / 3)
    else:
        assert m.metrics.load_hidden_s == pytest.approx(3.0) and m.metrics.load_exposed_s == 0


def test_status_record_after_landing_or_without_load_changes_nothing():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0)
    host_only(m, [10] * 3, "w", "A")
    m.update_hints("w", {"A": 1}, now=0.0)
    m.clock.t = 5.0
    assert m.status([10] * 3, record=True) is PrefixStatus.READY
    assert m.status([99] * 3, record=True) is PrefixStatus.READY
    m.match([10] * 3)
    assert m.metrics.load_hidden_s == pytest.approx(3.0) and m.metrics.load_exposed_s == 0


# ------------------------------------------------------------------ 3. load vs recompute
def test_load_on_demand_declines_when_recompute_is_cheaper():
    # 4 pages at 1 page/s = 4 s of load
    for per_token, loads in ((0.5, False), (2.0, True), (None, True)):
        m = make_manager("hicache", page_size=1, device_pages=8, host_pages=64, link=1.0,
                         recompute_s_per_token=per_token)
        put(m, [1, 2, 3, 4])
        m.free(m.allocate(8))                      # push it to host
        pm = m.match([1, 2, 3, 4])
        assert pm.needs_load
        assert m.estimate_load_s(4) == pytest.approx(4.0)
        got = m.load_on_demand(pm)
        if loads:
            assert got == pytest.approx(4.0) and m.metrics.demand_loads == 1
        else:
            assert got is None and m.metrics.loads_declined == 1
            assert m.metrics.declined_pages == 4 and m.metrics.demand_loads == 0
            assert m.status([1, 2, 3, 4]) is PrefixStatus.NEEDS_LOAD  # nothing moved
            # the engine's own estimate for this request wins (e.g. a load its prefill hides)
            assert m.load_on_demand(pm, recompute_s=10.0) == pytest.approx(4.0)
        m.check_invariants()


def test_a_recompute_is_weighed_with_every_request_it_would_stall():
    """4 s of load against 2 s of recompute: declined on an idle engine, loaded while three
    requests run (a recompute would delay each of them too: 2 s x 4 = 8 s), and the prefetch
    planner weighs a late prefetch the same way. ``recompute_s`` stays the prefill's own time
    (what an engine's prefill can hide a load behind)."""
    running = [0]
    for n_running, loads in ((0, False), (3, True)):
        running[0] = n_running
        m = make_manager("hicache", page_size=1, device_pages=8, host_pages=64, link=1.0,
                         recompute_s_per_token=0.5, recompute_stalls=lambda: running[0])
        put(m, [1, 2, 3, 4])
        m.free(m.allocate(8))                      # push it to host
        assert m.recompute_s(4) == pytest.approx(2.0)
        assert m.loads.recompute_cost_s(4) == pytest.approx(2.0 * (1 + n_running))
        got = m.load_on_demand(m.match([1, 2, 3, 4]))
        assert (got is not None) == loads and m.metrics.loads_declined == (0 if loads else 1)
        m.check_invariants()
    for n_running, skips in ((0, 1), (3, 0)):      # 6 s of load, the agent runs in 1 s
        running[0] = n_running
        m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                         recompute_s_per_token=0.5, default_step_s=1.0,
                         recompute_stalls=lambda: running[0])
        host_only(m, [10] * 6, "w", "A")           # recompute 3 s, x4 = 12 s while 3 run
        m.update_hints("w", {"A": 1}, now=0.0)
        assert m.metrics.prefetch_recompute_skips == skips
        assert m.metrics.prefetch_issued == 1 - skips


def test_an_idle_engine_adds_no_admission_delay_to_a_load():
    """A loaded request waits for the step in progress to end (the admission delay), but an
    engine that runs nothing starts it when the load lands. 3 s of load and a 2 s step
    against 3.6 s of recompute: declined where the engine's load is unknown (the step
    counted, as before); loaded on an idle engine, where that step used to tip it (AutoGen
    PEER's reviewer: a 17 ms load declined for a 65 ms recompute, bench/RESULTS.md 6.47);
    loaded while one request runs, since recomputing would stall it too (7.2 s)."""
    stalls = {"unknown": None, "idle": lambda: 0, "busy": lambda: 1}
    for case, loads in (("unknown", False), ("idle", True), ("busy", True)):
        m = make_manager("kvflow", page_size=1, device_pages=8, host_pages=64, link=1.0,
                         recompute_s_per_token=1.2, recompute_stalls=stalls[case])
        put(m, [1, 2, 3])
        m.free(m.allocate(8))                      # push it to host
        m.observe_step(20.0)                       # EMA 0.1: a 2 s step
        assert m.loads.admission_delay_s == pytest.approx(2.0)
        assert m.loads.engine_busy() == (case != "idle")
        got = m.load_on_demand(m.match([1, 2, 3]))
        assert (got is not None) == loads, case
        assert m.metrics.loads_declined == (0 if loads else 1)
        m.check_invariants()


def test_load_estimate_includes_queueing_behind_in_flight_loads():
    m = make_manager("hicache", page_size=1, device_pages=16, host_pages=64, link=1.0,
                     recompute_cost=lambda n, ctx: 2.5 * n)  # 2.5 s per token
    put(m, [1, 2, 3])
    put(m, [7])
    m.free(m.allocate(16 - 0))                     # both to host
    assert m.load_on_demand(m.match([1, 2, 3])) == pytest.approx(3.0)  # 3 s <= 7.5 s
    assert m.estimate_load_s(1) == pytest.approx(4.0)                # 3 s queue + 1 s
    assert m.should_load(1, 4.0) and not m.should_load(1, 3.9)
    assert m.load_on_demand(m.match([7])) is None                   # 4 s > 2.5 s
    assert m.recompute_s(2, 5) == pytest.approx(5.0)


def test_planner_drops_late_prefetch_when_recompute_is_cheaper():
    p = PrefetchPlanner(lookahead=2, secs_per_page=1.0)
    late_cheap = PrefetchCandidate("cheap", 1, pages=10, step_s=2.0, recompute_s=1.0)   # 8 s late
    late_dear = PrefetchCandidate("dear", 1, pages=10, step_s=2.0, recompute_s=30.0)
    on_time = PrefetchCandidate("ok", 2, pages=1, step_s=2.0, recompute_s=0.0)        # on time
    plan = p.plan([late_cheap, late_dear, on_time])
    assert [x.candidate.tag for x in plan] == ["ok", "dear"]
    assert [x.candidate.tag for x in p.last_skipped] == ["cheap"]
    plan = p.plan([late_cheap, on_time])
    assert [x.candidate.tag for x in plan] == ["ok"]
    # no estimate: loaded as before
    plan = p.plan([PrefetchCandidate("x", 1, pages=10, step_s=2.0)])
    assert len(plan) == 1 and not p.last_skipped


def test_manager_skips_a_late_prefetch_when_recompute_is_cheaper():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                     recompute_s_per_token=0.1, default_step_s=1.0)
    host_only(m, [10] * 6, "w", "A")               # 6 s of load, the agent runs in 1 s
    m.update_hints("w", {"A": 1}, now=0.0)
    assert m.metrics.prefetch_issued == 0 and m.metrics.prefetch_recompute_skips == 1
    m2 = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                      default_step_s=1.0)           # no estimate: prefetched (late) as before
    host_only(m2, [10] * 6, "w", "A")
    m2.update_hints("w", {"A": 1}, now=0.0)
    assert m2.metrics.prefetch_issued == 1


# ------------------------------------------------------------------ a measured link estimate
def _tracker():
    from kvflow_agents.serving.policy.loads import LoadTracker
    from kvflow_agents.serving.policy.metrics import CacheMetrics

    return LoadTracker(CacheMetrics())


def test_measured_link_ignores_small_loads_and_one_outlier():
    """SGLang learns a load landed only at its next step: a one-page load measures that lag,
    not the link. Small loads do not calibrate, and a median is not dragged by one outlier."""
    t = _tracker()
    t.observe_load(1, 0.07)                       # 1 page "took" 70 ms: the step lag
    assert t.measured_spp is None
    for seconds in (0.026, 0.027, 0.025):          # 65 pages at ~0.4 ms per page
        t.observe_load(65, seconds)
    t.observe_load(65, 0.9)                        # one load measured across an idle gap
    assert t.measured_spp == pytest.approx(0.0265 / 65, rel=0.05)


def test_a_too_slow_measured_link_is_probed_not_trusted_forever():
    """A measured estimate is refreshed only by loads: after PROBE_AFTER_DECLINES declines
    in a row one load goes through, and its measurement can turn the decisions around."""
    t = _tracker()
    t.observe_load(65, 65 * 0.07)                  # a bad first sample: 70 ms per page
    recompute = 0.09                               # recomputing the prefix: 90 ms
    decisions = [t.should_load(65, recompute, now=0.0) for _ in range(t.PROBE_AFTER_DECLINES)]
    assert decisions == [False] * (t.PROBE_AFTER_DECLINES - 1) + [True]
    for _ in range(2):                             # the probes measure the real link
        t.observe_load(65, 0.026)
    assert t.should_load(65, recompute, now=0.0)


def test_a_configured_link_is_never_probed():
    from kvflow_agents.serving.policy.loads import LoadTracker
    from kvflow_agents.serving.policy.metrics import CacheMetrics

    t = LoadTracker(CacheMetrics(), secs_per_page=1.0)
    assert not any(t.should_load(65, 0.09, now=0.0) for _ in range(3 * t.PROBE_AFTER_DECLINES))


@pytest.mark.parametrize("align,prompt,cached", [(1, 16, 16), (1, 20, 16), (8, 20, 12)])
def test_the_reserve_counts_what_admission_takes(align, prompt, cached):
    """A waiting request's reserve is what ``admit`` then takes: a fully cached prompt still
    prefills its last page, and with ``reuse_align`` (a deterministic engine's 256-token chunks)
    a cached prefix is reused only in whole chunks. (The reserve once counted every cached page:
    a prefetch took the tail the alignment left to recompute, and the request waited for it.)"""
    m = make_manager("kvflow", page_size=4, device_pages=32, host_pages=64, reuse_align=align)
    tokens = list(range(100, 100 + prompt))
    put(m, tokens[:cached])
    s = m.arrive(tokens, kv_tokens=prompt + 4)
    reserve = s.reserve_pages()
    assert s.admit()
    assert reserve == len(s.pages) - s.own_from + s.decode_reserved
    with pytest.raises(ValueError):
        make_manager("kvflow", reuse_align=0)


def test_a_prefetch_is_wasted_only_when_nothing_of_it_is_left_to_read():
    """A partial eviction takes a prefetch's tail: its pages count as evicted unread, but the
    head can still be read, so it is not wasted; when the head goes too, it is, once, under
    the reason that took the last of it."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, partial_eviction=True)
    host_only(m, [10] * 6, "w", "A")
    m.update_hints("w", {"A": 1})
    assert m.metrics.prefetch_issued == 1 and m.agent_residency("w", "A") == "device"
    held = m.allocate(m.device.num_free + 2)       # the tail's 2 pages
    assert m.metrics.prefetch_evicted_pages == 2 and m.metrics.prefetch_wasted == 0
    assert m.peek([10] * 6 + [0]).device_len == 4  # the head is still readable
    m.free(held)
    held = m.store.allocate(m.device.num_free + 4, reason="grow")   # and then the head
    assert m.metrics.prefetch_evicted_pages == 6
    assert m.metrics.prefetch_wasted == 1 and dict(m.metrics.prefetch_wasted_by) == {"grow": 1}
    assert m.metrics.evicted_pages["device:grow"] == 4
    m.free(held)
    m.check_invariants()


def test_a_blocked_plan_is_not_walked_again_until_room_or_candidates_change(monkeypatch):
    """A prefetch that cannot fit is planned once; decode-like churn of the free count below
    what any start needs does not re-plan (the candidate walk ran on every step), an STE
    change does, and so does room for a partial head (min_partial_pages = 4)."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64)
    host_only(m, [10] * 6, "w", "A")
    held = m.allocate(16)                          # running requests hold the whole pool
    walks = []
    real = m.prefetcher.candidates
    monkeypatch.setattr(m.prefetcher, "candidates", lambda *a, **k: walks.append(1) or real(*a, **k))
    m.update_hints("w", {"A": 1})
    assert len(walks) == 1 and m.metrics.prefetch_issued == 0
    for k in range(3):                             # 1, 2, 3 pages free: no start needs so few
        m.free(held[k:k + 1])
        m.tick()
    assert len(walks) == 1
    m.update_hints("w", {"A": 0})                  # the candidate's STE changed: plan again
    assert len(walks) == 2 and m.metrics.prefetch_issued == 0
    m.free(held[3:4])                              # 4 free: a partial head fits
    m.tick()
    assert len(walks) == 3 and m.metrics.prefetch_issued == 1 and m.metrics.prefetch_partial == 1
    m.free(held[4:])
    m.check_invariants()


def test_recomputed_kv_adopted_for_a_prefetched_tail_belongs_to_no_load():
    """A partial eviction sends a prefetch's tail back to host; a request that recomputed it
    inserts fresh KV, which the tree adopts: that node is no load's any more, so evicting it
    again is not an unread prefetched page (and reading it would credit no prefetch)."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, partial_eviction=True)
    tokens = [10] * 6
    host_only(m, tokens, "w", "A")
    m.update_hints("w", {"A": 1})
    held = m.allocate(m.device.num_free + 2)       # the prefetch's 2-page tail goes back to host
    m.free(held)
    assert m.metrics.prefetch_evicted_pages == 2
    m.insert(tokens, m.allocate(6))                # recomputed: the tail is adopted
    (head, tail), _ = m.tree.match(tokens)
    assert head.load is not None and tail.load is None and tail.state.name == "DEVICE"
    m.update_hints("w", {"A": 5})
    m.allocate(m.device.num_free + m.evictable_device_pages)   # everything goes
    assert m.metrics.prefetch_evicted_pages == 2 + 4 and m.metrics.prefetch_wasted == 1
    m.check_invariants()


def test_a_tail_behind_a_load_in_flight_is_charged_only_what_it_adds():
    """Head loading (3 s), tail on host: the request waits for the head either way, so the
    tail costs its own 3 s past the head, not the link's 6 s queue, and loads against a 4 s
    recompute; the same load behind an unrelated one is declined as before (6.57)."""
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                     recompute_cost=lambda n, ctx: 4.0 / 3 * n, recompute_stalls=lambda: 0)
    prefix = list(range(1, 7))
    put(m, prefix)
    m.free(m.allocate(16))                          # all six pages to host
    head = m.load_on_demand(m.match(prefix[:3]))    # the head: 3 s on the link
    assert head == pytest.approx(3.0)
    pm = m.match(prefix)
    assert pm.needs_load and m.estimate_load_s(3) == pytest.approx(6.0)   # 3 s queue + 3 s
    assert m.load_on_demand(pm) is not None      # (this test backend times each load alone)
    assert (m.metrics.demand_loads, m.metrics.loads_declined) == (2, 0)
    m.clock.t = 6.0
    assert m.status(prefix) is PrefixStatus.READY
    m.check_invariants()
    # control: an unrelated load holds the link, this path has nothing in flight: declined
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                     recompute_cost=lambda n, ctx: 4.0 / 3 * n, recompute_stalls=lambda: 0)
    put(m, [50, 51, 52])
    put(m, [60, 61, 62])
    m.free(m.allocate(16))
    assert m.load_on_demand(m.match([50, 51, 52])) == pytest.approx(3.0)
    assert m.load_on_demand(m.match([60, 61, 62])) is None
    assert m.metrics.loads_declined == 1
    m.check_invariants()
