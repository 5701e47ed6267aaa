"""Prefetch under memory pressure: the head of a prefix that does not fit whole is loaded
(partial prefetch), room goes to lower STEs first, and a tick that could start nothing new
skips the planner's walk."""

from __future__ import annotations

from policy_driver import make_manager, put, to_host


def _setup(**kw):
    m = make_manager("kvflow", page_size=1, device_pages=20, host_pages=100, link=1.0, **kw)
    a, b = list(range(100, 108)), list(range(200, 208))
    m.update_hints("w", {"a": 0, "b": 5}, agent="a", plan=False)
    put(m, b, "w", "b")
    put(m, a, "w", "a")
    run = list(range(300, 314))       # a running request holds 14 of the 20 pages
    node = m.insert(run, m.allocate(14))
    m.lock(node)
    return m, a, b


def test_head_of_a_prefix_that_does_not_fit_is_prefetched():
    m, a, b = _setup(min_partial_prefetch_pages=2)
    assert m.match(b, record=False).host_len == 8          # b was pushed to host
    m.update_hints("w", {"a": 2, "b": 1}, plan=False)      # b runs next; a (STE 2) may go
    started = m.tick(m.clock.t).prefetches_started
    assert started == [("w", "b")] and m.metrics.prefetch_partial == 1
    m.clock.t = 1e6
    m.tick(m.clock.t)
    got = m.match(b, record=False)
    assert 2 <= got.device_len < 8 and got.device_len + got.host_len == 8
    m.check_invariants()


def test_partial_prefetch_can_be_switched_off():
    m, a, b = _setup(min_partial_prefetch_pages=0)
    m.update_hints("w", {"a": 2, "b": 1}, plan=False)
    assert m.tick(m.clock.t).prefetches_started == [] and m.metrics.prefetch_partial == 0
    m.check_invariants()


def test_idle_ticks_skip_the_plan_until_something_changes(monkeypatch):
    m, a, b = _setup(min_partial_prefetch_pages=0)
    m.update_hints("w", {"a": 2, "b": 1}, plan=False)
    m.tick(m.clock.t)                                      # deferred: no room
    calls = []
    orig = m.planner.plan
    monkeypatch.setattr(m.planner, "plan", lambda *x, **k: calls.append(1) or orig(*x, **k))
    for _ in range(5):
        m.tick(m.clock.t)
    assert calls == []                                     # nothing changed: no re-plan
    m.update_hints("w", {"a": 3, "b": 1}, plan=False)      # a hint changed priorities
    m.tick(m.clock.t)
    assert calls == [1]
    m.check_invariants()


def test_room_goes_to_the_lower_ste_whatever_the_link_order():
    """A late load (its agent runs now, STE 0) goes on the link behind an on-time one (STE 1),
    but it takes room first: the STE-1 prefetch may not start with the pages the STE-0 one
    needs, since that one would evict it unused when it starts (a fan-out's prefetches
    thrashed this way: RESULTS.md §6.26)."""
    m = make_manager("kvflow", page_size=1, device_pages=20, host_pages=100, link=100.0,
                     min_partial_prefetch_pages=0)
    a, b = list(range(100, 108)), list(range(200, 208))
    m.update_hints("w", {"a": 3, "b": 4}, plan=False)
    to_host(m, a, "a")
    to_host(m, b, "b")
    m.lock(m.insert(list(range(300, 312)), m.allocate(12)))  # running: room for one prefix
    m.update_hints("w", {"a": 0, "b": 1}, plan=False)
    plan = m.planner.plan(m.prefetcher.candidates(m.clock.t))
    assert [(p.candidate.tag, p.on_time) for p in plan] == [(("w", "b"), True), (("w", "a"), False)]
    assert m.tick(m.clock.t).prefetches_started == [("w", "a")]
    assert ("w", "b") in m.prefetcher.pending
    m.clock.t = 1e6
    m.tick(m.clock.t)
    assert m.agent_residency("w", "a") == "device" and m.metrics.prefetch_wasted == 0
    m.check_invariants()
