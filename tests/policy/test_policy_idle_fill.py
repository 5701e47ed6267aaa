"""Agents further ahead than ``busy_lookahead`` load only on an idle link (``serving/policy/
prefetch.py``): one at a time, only while every agent due by then fits in the pool, and only
while the link's recent busy share is below ``fill_link_cap``."""

from __future__ import annotations

import pytest

from kvflow_agents.serving.policy import CacheMetrics, LoadTracker, PrefetchCandidate, PrefetchPlanner
from policy_driver import make_manager, to_host


def test_agents_beyond_the_busy_lookahead_load_only_on_an_idle_link():
    """``busy_lookahead`` 1 under ``lookahead`` 2: an agent two steps away is planned only when
    nothing nearer is planned and the link has no backlog, most urgent first, marked as an
    idle fill (the executor starts one of them)."""
    p = PrefetchPlanner(lookahead=2, secs_per_page=1.0, busy_lookahead=1)
    near = PrefetchCandidate("next", 1, pages=2, step_s=10.0)
    far_a = PrefetchCandidate("far-a", 2, pages=4, step_s=10.0)
    far_b = PrefetchCandidate("far-b", 2, pages=2, step_s=10.0)   # less urgent: 2 s over 20 s
    assert [x.candidate.tag for x in p.plan([far_a, near, far_b])] == ["next"]
    assert p.plan([far_a, far_b], link_busy_s=0.5) == []          # a load is still on the link
    assert p.plan([far_a, far_b], link_idle=False) == []          # one whose landing is not known
    plan = p.plan([far_b, far_a])
    assert [x.candidate.tag for x in plan] == ["far-a", "far-b"] and plan[0].finish_s == 4.0
    assert all(x.idle_fill for x in plan)
    assert not any(x.idle_fill for x in p.plan([far_a, near, far_b]))
    # without the band every agent within the lookahead is planned, most urgent first
    p.busy_lookahead = None
    assert [x.candidate.tag for x in p.plan([far_a, near, far_b])] == ["next", "far-a", "far-b"]


def test_a_prefetch_two_steps_ahead_waits_for_the_link_to_fall_idle():
    """On the manager: agent B (STE 2) is not prefetched while A's load (STE 1) is on the link;
    the tick after A lands starts B's. With the plain lookahead of 2 both start at once."""
    def setup(**kw):
        m = make_manager("kvflow", page_size=1, device_pages=32, host_pages=64, link=1.0,
                         lookahead=2, default_step_s=100.0, **kw)
        to_host(m, [10] * 4, "A", "w")
        to_host(m, [20] * 4, "B", "w")
        m.update_hints("w", {"A": 1, "B": 2}, now=0.0)
        return m

    m = setup(busy_lookahead=1)
    assert m.metrics.prefetch_issued == 1 and m.agent_residency("w", "A") == "loading"
    assert m.agent_residency("w", "B") == "host"
    m.clock.t = 2.0
    m.tick(2.0)                                    # A's 4 s load still on the link
    assert m.metrics.prefetch_issued == 1
    m.clock.t = 4.0
    m.tick(4.0)                                    # A landed: the link is idle
    assert m.agent_residency("w", "A") == "device" and m.agent_residency("w", "B") == "loading"
    assert m.metrics.prefetch_issued == 2
    m.check_invariants()

    m = setup()
    assert m.metrics.prefetch_issued == 2 and m.agent_residency("w", "B") == "loading"


def _far_fills(*agents, device_pages=8, lookahead=3):
    """Host-only agents ``(name, pages, STE)`` of one workflow under ``busy_lookahead`` 1, the
    device pool empty; 100 s steps, so nothing is due soon and only idle fills move."""
    m = make_manager("kvflow", page_size=1, device_pages=device_pages, host_pages=64, link=1.0,
                     lookahead=lookahead, busy_lookahead=1, default_step_s=100.0)
    for i, (name, pages, _) in enumerate(agents):
        to_host(m, [10 * (i + 1)] * pages, name)
    assert m.device.num_free == device_pages
    m.update_hints("w", {name: ste for name, _, ste in agents}, now=0.0)
    return m


def test_an_idle_fill_starts_only_while_every_agent_due_by_then_fits():
    """C (STE 3, 8 pages) is the more urgent fill (8 s over 300 s against A's 2 s over 200 s),
    and the 8-page pool holds it. But A, due first, would then evict it unread to load: the
    fill band follows the pool, so C waits and A fills; after A lands C still does not fit
    beside it. Alone, C fills."""
    m = _far_fills(("A", 2, 2), ("C", 8, 3))
    assert m.agent_residency("w", "A") == "loading" and m.agent_residency("w", "C") == "host"
    assert m.metrics.prefetch_fill_overflows == 1
    m.clock.t = 2.0
    m.tick(2.0)                                     # A landed, the link is idle
    assert m.agent_residency("w", "A") == "device" and m.agent_residency("w", "C") == "host"
    assert m.metrics.prefetch_issued == 1 and m.metrics.prefetch_wasted == 0
    m.check_invariants()

    m = _far_fills(("C", 8, 3))
    assert m.agent_residency("w", "C") == "loading" and m.metrics.prefetch_fill_overflows == 0


def test_an_idle_fill_counts_the_agents_due_with_it():
    """Two agents two steps away, 4 pages each, 6 pages of pool: each fits alone, both do not;
    the band stops below them (the pool holds no whole step's agents that far ahead), and with
    room for both they fill one at a time."""
    m = _far_fills(("A", 4, 2), ("B", 4, 2), device_pages=6)
    assert m.metrics.prefetch_issued == 0 and m.metrics.prefetch_fill_overflows == 1
    m = _far_fills(("A", 4, 2), ("B", 4, 2), device_pages=8)
    assert m.metrics.prefetch_issued == 1
    m.clock.t = 4.0
    m.tick(4.0)
    assert m.metrics.prefetch_issued == 2 and m.agent_residency("w", "B") == "loading"


def test_the_link_utilization_is_the_busy_share_of_the_last_window():
    loads = LoadTracker(CacheMetrics(), secs_per_page=1.0)
    w = LoadTracker.UTILIZATION_WINDOW_S
    assert loads.link_utilization(0.0) == 0.0
    loads.start([], 4, "demand", 0.0)               # on the link 0-4 s
    loads.start([], 2, "prefetch", 1.0)             # queued behind it: 4-6 s
    assert loads.link_utilization(5.0) == pytest.approx(5.0 / w)
    assert loads.link_utilization(10.0) == pytest.approx(6.0 / w)
    assert loads.link_utilization(w + 3.0) == pytest.approx(3.0 / w)  # 0-3 s slid out
    assert loads.link_utilization(w + 7.0) == 0.0


def test_an_idle_fill_waits_while_the_link_was_busy_most_of_the_last_window():
    """B's 16-page demand load keeps the link busy 16 of the first 20 s: when it lands the
    link is idle but at 0.8 of its recent time, above the 0.75 cap, so A (STE 2) is not filled
    (each fill evicts an agent due later: volume); at 22 s the share is 0.7 and A fills. With no
    cap it fills as soon as the link is idle."""
    def setup(**kw):
        m = make_manager("kvflow", page_size=1, device_pages=32, host_pages=64, link=1.0,
                         lookahead=3, busy_lookahead=1, default_step_s=100.0, **kw)
        to_host(m, [10] * 4, "A", "w")
        to_host(m, list(range(100, 116)), "B", "v")
        assert m.load_on_demand(m.match(list(range(100, 116)))) == pytest.approx(16.0)
        m.update_hints("w", {"A": 2}, now=0.0)
        assert m.agent_residency("w", "A") == "host"      # the link is busy
        m.clock.t = 16.0
        m.tick(16.0)
        return m

    m = setup()
    assert m.agent_residency("w", "A") == "host" and m.metrics.prefetch_fill_link_busy == 1
    m.clock.t = 22.0
    m.tick(22.0)
    assert m.agent_residency("w", "A") == "loading" and m.metrics.prefetch_issued == 1
    m = setup(fill_link_cap=None)
    assert m.agent_residency("w", "A") == "loading" and m.metrics.prefetch_fill_link_busy == 0
