"""Unit tests of KVCacheManager behaviour: ownership, tiers, eviction order, loads, prefetch,
hints (leases, caps), inference of fixed prefixes, snapshot and metrics."""

from __future__ import annotations

import json

import pytest

from kvflow_agents.serving.policy import (POLICIES, KVCacheManager, KVFlowPolicy,
                                          PrefetchCandidate, PrefetchPlanner, PrefixStatus,
                                          get_policy)
from policy_driver import make_manager, put, serve

INF = float("inf")



def test_registry_and_names():
    assert set(POLICIES) >= {"lru", "hicache", "kvflow", "oracle"}
    assert get_policy("kvflow").name == "kvflow"
    with pytest.raises(ValueError):
        get_policy("fifo")
    assert isinstance(get_policy(KVFlowPolicy(backup="tagged")), KVFlowPolicy)


def test_insert_takes_ownership_and_frees_duplicates():
    m = make_manager("lru", page_size=2, device_pages=10, host_pages=0)
    p1 = m.allocate(3)
    m.insert([1, 2, 3, 4, 5, 6, 7], p1 + [99])  # 3 full pages; the extra id is ignored
    assert m.device.num_used == 3
    pm = m.match([1, 2, 3, 4, 5, 6])
    assert pm.device_len == 6 and pm.device_pages == p1 and pm.status is PrefixStatus.READY
    # A second request computed the same prefix into its own pages: those come back.
    p2 = m.allocate(4)
    m.insert([1, 2, 3, 4, 5, 6, 8, 8], p2)
    assert m.device.num_used == 4  # 3 shared + 1 new
    # Re-inserting with the tree's own pages frees nothing.
    pm = m.match([1, 2, 3, 4, 5, 6, 8, 8])
    m.insert([1, 2, 3, 4, 5, 6, 8, 8], pm.device_pages)
    assert m.device.num_used == 4
    m.check_invariants()


def test_lock_protects_and_allocate_fails_without_evicting():
    m = make_manager("lru", page_size=1, device_pages=6, host_pages=0)
    put(m, [1, 2, 3])
    put(m, [4, 5, 6])
    h = m.lock(m.match([1, 2, 3]))
    h2 = m.lock(m.match([4, 5, 6]))
    assert m.allocate(1) is None and m.tree.num_nodes == 2
    m.unlock(h2)
    assert m.allocate(2) is not None
    assert m.match([1, 2, 3]).device_len == 3  # the locked one survived
    assert m.match([4, 5, 6], record=False).device_len == 1  # tail of the other went
    m.unlock(h)
    with pytest.raises(RuntimeError):
        m.unlock(h)
    m.check_invariants()


def test_lru_has_no_host_tier():
    m = make_manager("lru", page_size=1, device_pages=4, host_pages=100)
    put(m, [1, 2, 3, 4])
    assert m.allocate(4) is not None
    assert m.host.capacity == 0 and m.tree.num_nodes == 0
    pm = m.match([1, 2, 3, 4])
    assert pm.cached_len == 0 and m.metrics.miss_tokens == 4


def test_hicache_write_through_and_load_on_demand():
    m = make_manager("hicache", page_size=2, device_pages=4, host_pages=8, link=2.0)
    put(m, [1, 2, 3, 4])
    held = m.allocate(4)  # evicts everything to host (write-through)
    assert m.metrics.backup_pages == 2 and m.host.num_used == 2
    m.free(held)
    pm = m.match([1, 2, 3, 4, 5, 6])
    assert pm.status is PrefixStatus.NEEDS_LOAD and pm.cached_len == 4 and pm.device_len == 0
    assert m.status([1, 2, 3, 4]) is PrefixStatus.NEEDS_LOAD
    ready = m.load_on_demand(pm)
    assert ready == pytest.approx(1.0)  # 2 pages at 2 pages/s
    assert m.status([1, 2, 3, 4]) is PrefixStatus.LOADING
    # A loading node is never evicted: only 2 free pages remain to allocate.
    assert m.allocate(3) is None
    m.clock.t = 1.0
    m.tick()
    assert m.status([1, 2, 3, 4]) is PrefixStatus.READY
    assert m.match([1, 2, 3, 4]).device_len == 4
    # The host copy is kept: evicting again costs no copy.
    m.allocate(4)
    assert m.metrics.backup_pages == 2
    m.check_invariants()


def test_kvflow_eviction_order_suffix_then_largest_ste_then_lru():
    m = make_manager("kvflow", page_size=1, device_pages=12, host_pages=0)
    put(m, [1, 1, 1, 7], "w", "A", fixed=3)   # fixed prefix 3 + 1 dynamic
    put(m, [2, 2, 2, 8], "w", "B", fixed=3)
    put(m, [3, 3, 3, 9], "w", "C", fixed=3)
    m.update_hints("w", {"A": 2, "B": 1, "C": 2})
    order = []
    m.on_evict = lambda n, tier, prio, reason: order.append((n.key, prio))
    assert m.allocate(13) is None  # nothing evicted when hopeless
    assert order == []
    m.allocate(3)
    assert [k for k, _ in order] == [(7,), (8,), (9,)]  # dynamic suffixes first, by LRU
    m.match([1, 1, 1])  # touch A: C becomes the least recently used of the STE-2 pair
    m.allocate(3)
    assert order[-1] == ((3, 3, 3), 2)
    m.allocate(3)
    assert order[-1] == ((1, 1, 1), 2)
    assert m.match([2, 2, 2]).device_len == 3  # B (next to run) is the last one standing
    m.check_invariants()


def test_kvflow_backs_up_tagged_prefixes_and_host_keeps_urgent_copies():
    m = make_manager(KVFlowPolicy(backup="tagged"), page_size=1, device_pages=8, host_pages=3)
    put(m, [1, 1, 1, 7], "w", "A", fixed=3)
    put(m, [2, 2, 2, 8], "w", "B", fixed=3)
    m.update_hints("w", {"A": 1, "B": 3})
    m.allocate(8)
    # suffixes dropped (untagged), B (STE 3) backed up first, then A (STE 1) needs host room:
    # B is less urgent, so it leaves the host; A's copy stays.
    assert m.metrics.dropped_pages == 2
    assert m.agent_residency("w", "A") == "host"
    assert m.agent_node("w", "B") is None
    m.check_invariants()
    # The other way round, a less urgent copy never displaces a more urgent one.
    m2 = make_manager(KVFlowPolicy(backup="tagged"), page_size=1, device_pages=8, host_pages=3)
    put(m2, [1, 1, 1, 7], "w", "A", fixed=3)
    put(m2, [2, 2, 2, 8], "w", "B", fixed=3)
    m2.update_hints("w", {"A": 3, "B": 1})
    m2.match([2, 2, 2, 8])
    m2.allocate(8)
    assert m2.agent_residency("w", "B") == "host"
    assert m2.agent_node("w", "A") is None


def test_shared_prefix_priority_is_min_across_workflows():
    m = make_manager("kvflow", page_size=1, device_pages=20, host_pages=0)
    put(m, [5, 5, 1, 1], "w1", "planner")
    put(m, [5, 5, 2, 2], "w2", "coder")
    m.update_hints("w1", {"planner": 4})
    m.update_hints("w2", {"coder": 1})
    shared = m.match([5, 5], record=False).node
    assert m.index.priority(shared) == 1
    m.release_workflow("w2")
    assert m.index.priority(shared) == 4
    m.check_invariants()


def test_tag_split_at_page_boundary_and_moves():
    m = make_manager("kvflow", page_size=2, device_pages=20, host_pages=0)
    put(m, [1, 2, 3, 4, 5, 6, 7, 8])
    node = m.tag_fixed_prefix([1, 2, 3, 4, 5, 6, 7, 8], 5, "w", "A")  # aligned down to 4
    assert node.key == (1, 2, 3, 4) and m.index.node_of(("w", "A")) is node
    assert m.tag_fixed_prefix([1, 2, 3, 4, 5, 6, 7, 8], 6, "w", "A").key == (5, 6)
    assert m.index.tags_at(node) == set()
    assert m.tag_fixed_prefix([9, 9, 9, 9], 4, "w", "B") is None  # not cached (yet)
    m.check_invariants()


def test_hint_lease_expires_and_revives():
    m = make_manager("kvflow", page_size=1, device_pages=20, host_pages=0, lease_s=5.0)
    node = put(m, [1, 2, 3], "w", "A")
    m.update_hints("w", {"A": 1}, now=0.0)
    assert m.index.priority(node) == 1
    rep = m.tick(now=4.0)
    assert rep.expired_workflows == [] and m.index.priority(node) == 1
    rep = m.tick(now=6.0)
    assert rep.expired_workflows == ["w"] and m.index.priority(node) == INF
    m.update_hints("w", {"B": 2}, now=7.0)  # any hint of the workflow renews its lease
    assert m.index.priority(node) == 1


def test_update_hints_sender_counts_as_running_and_null_is_inf():
    m = make_manager("kvflow", page_size=1, device_pages=20, host_pages=0)
    a = put(m, [1, 2], "w", "A")
    b = put(m, [3, 4], "w", "B")
    m.update_hints("w", {"B": None}, agent="A")
    assert m.index.priority(a) == 0 and m.index.priority(b) == INF
    m.update_hints("w", {"B": "garbage"})  # advisory: never fails
    assert m.index.priority(b) == INF


def test_client_cap_demotes_least_urgent_tags():
    m = make_manager("kvflow", page_size=1, device_pages=40, host_pages=0, client_cap_pages=6)
    nodes = {x: put(m, [i] * 3, "w", x, 3) for i, x in enumerate("ABC")}
    m.update_hints("w", {"A": 0, "B": 1, "C": 2})
    assert m.index.priority(nodes["A"]) == 0 and m.index.priority(nodes["B"]) == 1
    assert m.index.priority(nodes["C"]) == INF  # 9 pages > cap of 6
    m.update_hints("w", {"C": 0, "B": 3})
    assert m.index.priority(nodes["C"]) == 0 and m.index.priority(nodes["B"]) == INF
    assert [a["demoted"] for a in m.snapshot()["agents"]] == [False, True, False]


def test_infer_fixed_prefix_from_history():
    m = make_manager("kvflow", page_size=2, device_pages=40, host_pages=0)
    sys_prompt = [7] * 6
    t1 = sys_prompt + [1, 1, 1]
    put(m, t1)
    assert m.infer_fixed_prefix("w", "A", t1) == 0  # one request says nothing
    t2 = sys_prompt + [1, 2, 2, 2]
    put(m, t2)
    assert m.infer_fixed_prefix("w", "A", t2) == 6  # LCP 7 -> page-aligned 6
    assert m.index.node_of(("w", "A")) is m.match(sys_prompt, record=False).node


def test_oracle_never_evicts():
    m = make_manager("oracle", page_size=1, device_pages=2, host_pages=10)
    for i in range(10):
        put(m, [i, i, i])
    assert m.device.capacity >= 30 and m.metrics.evictions == {}
    assert all(m.match([i, i, i]).device_len == 3 for i in range(10))


@pytest.mark.parametrize("policy", ["oracle", "oracle-pool"])
def test_the_pool_oracle_caches_for_free_but_runs_requests_in_the_pool(policy):
    """Both oracles keep every prefix (never evict, the pool grows for the cache); only the
    plain one also runs more requests at once than the configured pool holds."""
    m = make_manager(policy, page_size=1, device_pages=6, host_pages=0)
    for i in range(10):
        put(m, [i, i, i])                  # 30 cached pages in a 6-page pool
    assert all(m.match([i, i, i]).device_len == 3 for i in range(10))
    s1 = m.arrive([0, 0, 0, 7, 7, 7], kv_tokens=6)   # 3 cached + 3 new
    assert s1.admit()
    s2 = m.arrive([1, 1, 1, 8, 8, 8], kv_tokens=6)   # 3 + 3 more: 12 held > 6
    assert s2.admit() is (policy == "oracle")
    if policy == "oracle-pool":
        s1.finish()                        # room again: s1's pages are cache now
        assert s2.admit()
    assert m.metrics.evictions == {}


def _host_only_agents(m, agents, wf="w"):
    """Put each agent's prefix (3 pages) on device, then push all of it to host."""
    for i, a in enumerate(agents):
        put(m, [10 + i] * 3, wf, a, 3)
    held = m.allocate(m.device.num_free + m.evictable_device_pages)
    assert all(m.agent_residency(wf, a) == "host" for a in agents)
    m.free(held)


def test_prefetch_loads_next_agents_bounded_by_inflight():
    m = make_manager("kvflow", page_size=1, device_pages=12, host_pages=20, link=3.0,
                     max_inflight_loads=1)
    _host_only_agents(m, ["A", "B", "C"])
    started = m.update_hints("w", {"A": 2, "B": 1, "C": 1}, now=0.0)
    assert len(started) == 1 and m.metrics.prefetch_deferred == 1
    assert m.status([11] * 3) is PrefixStatus.LOADING or m.status([12] * 3) is PrefixStatus.LOADING
    m.clock.t = 1.0
    rep = m.tick()
    assert rep.loads_finished == 1 and len(rep.prefetches_started) == 1
    m.clock.t = 2.0
    m.tick()
    assert m.status([11] * 3) is PrefixStatus.READY and m.status([12] * 3) is PrefixStatus.READY
    assert m.status([10] * 3) is PrefixStatus.NEEDS_LOAD  # STE 2 > lookahead: not prefetched
    pm = m.match([11] * 3)
    assert pm.device_len == 3 and m.metrics.prefetch_used == 1
    assert m.metrics.load_hidden_s == pytest.approx(1.0) and m.metrics.load_exposed_s == 0
    m.check_invariants()


def test_prefetch_never_evicts_equal_or_more_urgent():
    m = make_manager("kvflow", page_size=1, device_pages=6, host_pages=20)
    _host_only_agents(m, ["A"])
    put(m, [20] * 3, "w", "B", 3)
    put(m, [21] * 3, "w", "C", 3)   # device full: B, C
    m.update_hints("w", {"A": 1, "B": 1, "C": 0})
    assert m.agent_residency("w", "A") == "host"  # no thrash: would evict B/C
    assert m.metrics.prefetch_issued == 0 and m.metrics.prefetch_deferred == 1
    m.update_hints("w", {"B": 2})   # now B is less urgent than A: A may replace it
    assert m.agent_residency("w", "A") == "device"
    assert m.agent_residency("w", "B") == "host"
    assert m.metrics.evictions["device:prefetch"] == 1
    m.check_invariants()


def test_stale_prefetch_plan_dropped_and_wasted_counted():
    m = make_manager("kvflow", page_size=1, device_pages=9, host_pages=20, link=3.0,
                     max_inflight_loads=1)
    _host_only_agents(m, ["A", "B"])
    m.update_hints("w", {"A": 1, "B": 1}, now=0.0)
    assert m.metrics.prefetch_issued == 1 and m.prefetcher.pending
    pending = next(iter(m.prefetcher.pending))
    m.update_hints("w", {pending[1]: 5}, now=0.1)  # newer hint: that agent is far away now
    assert m.metrics.prefetch_stale == 1 and not m.prefetcher.pending
    m.clock.t = 2.0
    m.tick()
    # The prefetched agent's plan changes too; its prefix is evicted before use -> wasted.
    loaded = ({"A", "B"} - {pending[1]}).pop()
    m.update_hints("w", {loaded: 6}, now=2.0)
    m.allocate(m.device.num_free + m.evictable_device_pages)
    assert m.metrics.prefetch_wasted == 1 and m.metrics.prefetch_used == 0
    assert dict(m.metrics.prefetch_wasted_by) == {"alloc": 1}


def test_exposed_load_time_when_used_before_ready():
    m = make_manager("kvflow", page_size=1, device_pages=9, host_pages=20, link=1.0)
    _host_only_agents(m, ["A"])
    m.update_hints("w", {"A": 1}, now=0.0)  # 3 pages at 1 page/s: ready at 3.0
    m.clock.t = 1.0
    pm = m.match([10] * 3)
    assert pm.status is PrefixStatus.LOADING and pm.host_len == 3
    assert m.metrics.load_hidden_s == pytest.approx(1.0)
    assert m.metrics.load_exposed_s == pytest.approx(2.0)
    assert m.load_on_demand(pm) == pytest.approx(3.0)  # nothing more to start; wait for it


def test_planner_orders_by_urgency_and_late_loads_yield():
    p = PrefetchPlanner(lookahead=3, secs_per_page=1.0)
    c = [PrefetchCandidate("far-big", 3, pages=6, step_s=4.0),     # 6 s of 12 s: 0.5
         PrefetchCandidate("small", 2, pages=1, step_s=4.0),       # 1 s of 8 s: 0.125
         PrefetchCandidate("hopeless", 1, pages=9, step_s=4.0),    # 9 s of 4 s: late
         PrefetchCandidate("too-far", 4, pages=1, step_s=1.0)]     # beyond lookahead
    plan = p.plan(c)
    assert [x.candidate.tag for x in plan] == ["far-big", "small", "hopeless"]
    assert [x.on_time for x in plan] == [True, True, False]
    # The link is busy for 10 s: everything is late, ordered by deadline.
    plan = p.plan(c, link_busy_s=10.0)
    assert [x.candidate.tag for x in plan] == ["hopeless", "small", "far-big"]
    assert not any(x.on_time for x in plan)


def test_snapshot_is_json_and_metrics_dict():
    m = make_manager("kvflow", page_size=1, device_pages=8, host_pages=20)
    serve(m, [1, 1, 1, 5], 3, "w", "A")
    serve(m, [2, 2, 2, 6], 3, "w", "B")
    m.update_hints("w", {"A": 1, "B": None})
    snap = m.snapshot()
    json.dumps(snap)
    assert snap["pools"]["device"]["used"] == 8 and snap["policy"] == "kvflow"
    assert snap["admission"] == "workflow"
    assert [(a["agent"], a["residency"], a["priority"]) for a in snap["agents"]] == [
        ("A", "device", 1), ("B", "device", None)]
    d = m.metrics.as_dict()
    assert d["miss_tokens"] == 8 and "evictions" in d and "load_hidden_fraction" in d


def test_manager_accepts_policy_instance_and_default_backend():
    m = KVCacheManager(KVFlowPolicy(), page_size=4, device_pages=4, host_pages=4)
    assert m.policy.name == "kvflow" and m.match(list(range(8))).cached_len == 0


def test_prefetch_hides_load_time_on_a_cycle():
    """Same cyclic workload, same tiers: kvflow loads the next agent while the current one
    runs (hidden), hicache loads it when its request arrives (exposed)."""
    order = ["A", "B", "C", "D"]
    results = {}
    for policy in ("hicache", "kvflow"):
        m = make_manager(policy, page_size=1, device_pages=12, host_pages=64, link=8.0)
        for t in range(24):
            agent = order[t % 4]
            m.update_hints("w", {x: (order.index(x) - t) % 4 for x in order}, step=t)
            serve(m, [10 + order.index(agent)] * 4 + [1000 + t], 4, "w", agent)
            m.clock.t += 1.0  # the agent computes for one second
            m.tick()
            m.check_invariants()
        results[policy] = m.metrics
    kv, hi = results["kvflow"], results["hicache"]
    assert hi.load_exposed_s > 0 and kv.prefetch_used > 0
    assert kv.load_exposed_s < 0.25 * hi.load_exposed_s, (kv.as_dict(), hi.as_dict())
    assert kv.device_hit_rate > hi.device_hit_rate


def test_planner_deadline_counts_time_already_spent_in_the_step():
    p = PrefetchPlanner(lookahead=2, secs_per_page=1.0)
    fresh = PrefetchCandidate("fresh", 1, pages=3, step_s=4.0)
    late = PrefetchCandidate("late", 1, pages=3, step_s=4.0, elapsed_s=2.0)
    assert p.plan([fresh])[0].on_time and not p.plan([late])[0].on_time
    assert p.plan([late])[0].deadline_s == 2.0


def test_next_load_at_tells_an_idle_scheduler_when_to_wake():
    m = make_manager("hicache", page_size=1, device_pages=4, host_pages=8, link=2.0)
    put(m, [1, 2, 3, 4])
    m.free(m.allocate(4))
    assert m.next_load_at is None
    m.load_on_demand(m.match([1, 2, 3, 4]))
    assert m.next_load_at == pytest.approx(2.0) and m.loads_in_flight == 1
    m.tick(now=2.0)
    assert m.next_load_at is None


def test_prefetcher_skips_its_walk_while_nothing_near_is_on_host_and_wakes_on_a_hint(monkeypatch):
    """Every engine step ticks the prefetcher. Once the near agents' prefixes are on device
    (one workflow: most steps), a plan would find no candidate; the state signature then stands
    for that answer and later ticks skip the candidate walk, until a hint makes an agent whose
    prefix is on host near (its priority changes the store's state) and the next tick starts
    its prefetch."""
    m = make_manager("kvflow", page_size=1, device_pages=12, host_pages=20, link=3.0)
    _host_only_agents(m, ["A", "B"])
    m.update_hints("w", {"A": 1, "B": 3}, now=0.0)
    assert m.metrics.prefetch_issued == 1
    m.clock.t = 2.0
    m.tick()
    assert m.agent_residency("w", "A") == "device" and m.agent_residency("w", "B") == "host"
    walks = []
    real = m.prefetcher.candidates
    monkeypatch.setattr(m.prefetcher, "candidates",
                        lambda now, tags=None: walks.append(now) or real(now, tags))
    for i in range(5):
        m.clock.t = 2.0 + 0.1 * i
        m.tick()
    assert len(walks) <= 1 and m.metrics.prefetch_issued == 1
    m.update_hints("w", {"A": 2, "B": 1}, now=2.5)   # B runs next
    m.clock.t = 2.6
    m.tick()
    assert m.metrics.prefetch_issued == 2 and m.agent_residency("w", "B") in ("loading", "device")
    m.check_invariants()
