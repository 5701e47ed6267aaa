"""KVFlowRadixCache on SGLang's real classes: UnifiedRadixCache, the Python TreeCore (the
test kit's inspector subclass), MHATokenToKVPool / TokenToKVPoolAllocator on CPU, real Req.

- STE eviction order (largest steps-to-execution first, dynamic suffixes before any tagged
  prefix), re-evaluated when hints change;
- shared prefix takes the minimum over agents and workflows;
- no hints: identical to stock SGLang LRU (differential against UnifiedRadixCache);
- leases, workflow end, null STE, inferred boundary.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402

from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402
from kvflow_agents.serving.sglang.strategy import KVFlowStrategy  # noqa: E402

from sgl_helpers import hints, key, run_request, seq  # noqa: E402


class Kit(UnifiedRadixCacheFixtures):
    def __init__(self, cfg):
        self.cfg = cfg


def build(page_size=4, cls=KVFlowRadixCache, policy="kvflow", kv_size=512):
    kit = Kit(CacheConfig(page_size=page_size, eviction_policy=policy, kv_size=kv_size,
                          max_context_len=512, max_num_reqs=64))
    with mock.patch.object(fx, "UnifiedRadixCache", cls):
        cache, alloc, r2t = fx.build_fixture(kit.cfg)
    return kit, cache, alloc, r2t


def cached_len(cache, tokens) -> int:
    return cache.match_prefix(fx.MatchPrefixParams(key=key(tokens))).device_prefix_len


def residency(cache):
    return {a["agent"]: a["residency"] for a in cache.kvflow_snapshot()["agents"]}


# ------------------------------------------------------------------------------------------
def test_built_on_sglang_python_core_with_kvflow_strategy():
    _, cache, _, _ = build()
    assert isinstance(cache, UnifiedRadixCache)
    assert type(cache.tree_core).__name__ == "UnifiedTreeCoreInspector"  # the kit's Python core
    assert isinstance(cache.tree_core.eviction_strategy, KVFlowStrategy)
    assert cache.tree_core.eviction_strategy.index is cache.kv_index


def test_ste_eviction_order_suffix_first_then_largest_ste():
    kit, cache, alloc, r2t = build(page_size=4)
    ste = {"planner": 0, "coder": 1, "reviewer": 3}
    fixed = {a: seq(1000 * (i + 1), 16) for i, a in enumerate(ste)}
    for rnd in range(2):
        for a in ste:
            run_request(kit, cache, alloc, r2t, fixed[a] + seq(50000 + 100 * rnd + len(a), 8),
                        hints("wf", a, ste, fixed_tokens=16))
    assert set(residency(cache).values()) == {"device"}
    order = []
    cache.tree_core.eviction_strategy  # noqa: B018 (strategy is rebuilt into the heap per evict)
    # 6 suffixes x 8 tokens go first, in any LRU order, before any fixed prefix
    r = cache.evict(EvictParams(num_tokens=48))
    assert r.num_tokens_evicted == 48
    assert residency(cache) == {"planner": "device", "coder": "device", "reviewer": "device"}
    for _ in range(3):
        cache.evict(EvictParams(num_tokens=16))
        gone = [a for a in ste if cached_len(cache, fixed[a]) == 0 and a not in order]
        order.extend(gone)
    assert order == ["reviewer", "coder", "planner"]


def test_new_hint_reorders_next_eviction():
    kit, cache, alloc, r2t = build(page_size=4)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, a, hints("wf", "A", {"A": 0, "B": 3}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, b, hints("wf", "B", {"A": 0, "B": 3}, fixed_tokens=16))
    # B is the most recent, but the workflow now says A runs last
    from kvflow_agents.protocol import Hints

    cache.kvflow_apply_hints(Hints(workflow="wf", agent="B", ste={"A": 5, "B": 0}))
    cache.evict(EvictParams(num_tokens=16))
    assert cached_len(cache, a) == 0 and cached_len(cache, b) == 16


def test_shared_prefix_takes_min_across_agents_and_workflows():
    kit, cache, alloc, r2t = build(page_size=4)
    system = seq(100, 16)
    x, y = system + seq(3000, 8), system + seq(4000, 8)
    run_request(kit, cache, alloc, r2t, x, hints("w1", "X", {"X": 5, "Y": 0}, fixed_tokens=24))
    run_request(kit, cache, alloc, r2t, y, hints("w1", "Y", {"X": 5, "Y": 0}, fixed_tokens=24))
    # another workflow of the same app tags the shared system prompt alone, STE 2
    z = system + seq(5000, 8)
    run_request(kit, cache, alloc, r2t, z, hints("w2", "Z", {"Z": 2}, fixed_tokens=16))
    idx = cache.kv_index
    shared = idx.node_of(("w2", "Z"))
    assert idx.node_of(("w1", "X")).parent is shared and idx.node_of(("w1", "Y")).parent is shared
    cache.kvflow_apply_hints(__import__("kvflow_agents.protocol", fromlist=["Hints"]).Hints(
        workflow="w2", agent="other", ste={"Z": 2}))
    assert idx.priority(shared) == 0          # min(X=5, Y=0, Z=2)
    strat = cache.tree_core.eviction_strategy
    assert strat.get_priority(shared)[0] == 0  # key (-priority, lru) = (-0, ...)
    cache.evict(EvictParams(num_tokens=8))     # Z's dynamic suffix (untagged)
    cache.evict(EvictParams(num_tokens=8))     # X's own part (STE 5)
    assert cached_len(cache, x) == 16 and cached_len(cache, y) == 24
    cache.evict(EvictParams(num_tokens=8))     # then Y's own part; the shared node is a leaf now
    assert cached_len(cache, y) == 16 and cached_len(cache, system) == 16
    assert idx.priority(shared) == 2           # only Z (STE 2) is left below it
    cache.sanity_check()


def test_null_ste_counts_as_never_again():
    kit, cache, alloc, r2t = build(page_size=4)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, b, hints("wf", "B", {"A": None, "B": 4}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, a, hints("wf", "A", {"A": None, "B": 4}, fixed_tokens=16))
    # A sent the last request (STE 0 while running); the workflow then says A never runs again
    from kvflow_agents.protocol import Hints

    cache.kvflow_apply_hints(Hints(workflow="wf", agent="B", ste={"A": float("inf"), "B": 0}))
    cache.evict(EvictParams(num_tokens=16))
    assert cached_len(cache, a) == 0 and cached_len(cache, b) == 16


def test_lease_expiry_and_workflow_end_unpin():
    kit, cache, alloc, r2t = build(page_size=4)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, a, hints("old", "A", {"A": 0}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, b, hints("new", "B", {"B": 1}, fixed_tokens=16))
    import time

    cache.kvflow_expire(now=time.monotonic() + cache.lease_s + 1)  # both quiet: both +inf
    assert cache.kv_index.ste(("old", "A")) == float("inf")
    from kvflow_agents.protocol import Hints

    cache.kvflow_apply_hints(Hints(workflow="new", agent="B", ste={"B": 1}))  # revived
    assert cache.kv_index.ste(("new", "B")) == 1
    cache.evict(EvictParams(num_tokens=16))
    assert cached_len(cache, a) == 0 and cached_len(cache, b) == 16
    cache.kvflow_apply_hints(Hints(workflow="new", agent="B", event="end"))
    assert ("new", "B") not in cache.kv_index


def test_boundary_inferred_from_history_without_declared_length():
    kit, cache, alloc, r2t = build(page_size=4)
    system = seq(100, 13)  # 13 tokens: the inferred boundary is page-aligned down to 12
    run_request(kit, cache, alloc, r2t, system + seq(7000, 8), hints("wf", "A", {"A": 0}))
    assert ("wf", "A") not in cache.kv_index  # one request: nothing to infer from
    run_request(kit, cache, alloc, r2t, system + seq(8000, 8), hints("wf", "A", {"A": 0}))
    node = cache.kv_index.node_of(("wf", "A"))
    assert node is not None and len(cache._path_tokens(node)) == 12
    assert cache.kv_stats["inferred_tags"] == 1


def test_malformed_hints_are_ignored_request_still_cached():
    kit, cache, alloc, r2t = build(page_size=4)
    a = seq(1000, 16)
    run_request(kit, cache, alloc, r2t, a, {"kvflow_v": 1, "kvflow_workflow": "w",
                                            "kvflow_agent": "A", "kvflow_ste": {"A": -3}})
    assert cache.kv_stats["hint_errors"] == 1 and not list(cache.kv_index.tags())
    assert cached_len(cache, a) == 16


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_no_hints_is_stock_sglang_lru(page_size):
    """Differential: the same random workload on stock UnifiedRadixCache (lru) and on
    KVFlowRadixCache without hints gives the same evictions and the same cached prefixes."""
    rng = random.Random(page_size)
    stock = build(page_size, UnifiedRadixCache, "lru", kv_size=1024)
    ours = build(page_size, KVFlowRadixCache, "kvflow", kv_size=1024)
    prompts = [seq(1000 * (i + 1), page_size * rng.randint(1, 4)) for i in range(6)]
    history = []
    for step in range(40):
        base = rng.choice(prompts)
        toks = base + seq(100000 + 50 * step, page_size * rng.randint(0, 3))
        history.append(toks)
        for kit, cache, alloc, r2t in (stock, ours):
            run_request(kit, cache, alloc, r2t, toks)
        if step % 5 == 4:
            n = page_size * rng.randint(1, 6)
            r1 = stock[1].evict(EvictParams(num_tokens=n))
            r2 = ours[1].evict(EvictParams(num_tokens=n))
            assert r1 == r2
        for t in history[-8:]:
            assert cached_len(stock[1], t) == cached_len(ours[1], t)
        assert stock[1].evictable_size() == ours[1].evictable_size()
    ours[1].sanity_check()


def test_hybrid_swa_tree_is_tagged_without_split():
    """Full+SWA: SGLang splits only Full-only trees, so the tag goes on the deepest cached
    node within the fixed prefix, and eviction still honours it."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kit = Kit(CacheConfig(page_size=4, components=(ComponentType.FULL, ComponentType.SWA),
                          sliding_window_size=4, eviction_policy="kvflow", kv_size=512,
                          max_context_len=512, max_num_reqs=64))
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, alloc, r2t = fx.build_fixture(kit.cfg)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, a, hints("wf", "A", {"A": 0, "B": 3}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, b, hints("wf", "B", {"A": 0, "B": 3}, fixed_tokens=16))
    na, nb = cache.kv_index.node_of(("wf", "A")), cache.kv_index.node_of(("wf", "B"))
    assert na is not None and nb is not None
    assert len(cache._path_tokens(na)) <= 16 and len(cache._path_tokens(nb)) <= 16
    cache.evict(EvictParams(num_tokens=16))
    cache.sanity_check()
    assert not na.evicted and (nb.evicted or not cache._alive(nb))


def test_lease_checked_at_eviction_without_hicache():
    import time

    kit, cache, alloc, r2t = build(page_size=4)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, a, hints("quiet", "A", {"A": 0}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, b, hints("live", "B", {"B": 3}, fixed_tokens=16))
    # the "quiet" workflow's last hint was long ago
    cache.kv_hints.workflows["quiet"].last_hint = time.monotonic() - cache.lease_s - 1
    cache.evict(EvictParams(num_tokens=16))          # expires it first, then evicts A (+inf)
    assert cached_len(cache, a) == 0 and cached_len(cache, b) == 16


def test_a_wall_clock_step_expires_no_lease():
    """Leases run on the monotonic clock: the wall clock jumping a day ahead (NTP, a resumed VM)
    leaves a live workflow's hints in force, so its prefix still outranks a quiet one's."""
    import time

    kit, cache, alloc, r2t = build(page_size=4)
    a, b = seq(1000, 16), seq(2000, 16)
    run_request(kit, cache, alloc, r2t, a, hints("live", "A", {"A": 1}, fixed_tokens=16))
    run_request(kit, cache, alloc, r2t, b, hints("other", "B", {"B": 3}, fixed_tokens=16))
    with mock.patch("time.time", return_value=time.time() + 86_400.0):
        cache.evict(EvictParams(num_tokens=16))      # leases checked first: neither expired
    assert cache.kv_index.ste(("live", "A")) == 1
    assert cached_len(cache, a) == 16 and cached_len(cache, b) == 0


def test_tp_ranks_take_the_same_decisions_with_drifting_clocks():
    """Two ranks (same request stream, as SGLang broadcasts it) whose clocks advance at
    different rates per step: leases run on the rank-agreed clock (MIN all-reduce every
    CLOCK_SYNC_STEPS steps), so both expire the same workflow at the same step and evict the
    same nodes. The all-reduce is simulated exactly: every rank's clock is a known function
    of the step, and MIN over ranks is what the collective returns."""
    rate = {0: 1.0, 1: 1.3}  # seconds per scheduler step as each rank's own clock sees it
    lease = 5.0

    def wall(rank, step):
        return 1000.0 + rate[rank] * step

    def run_rank(rank, tp=2):
        kit, cache, alloc, r2t = build(page_size=4)
        cache.tp_world_size = tp
        cache.kv_hints.lease_s = lease
        state = {"step": 0}
        cache._local_clock = lambda: wall(rank, state["step"])

        def fake_all_reduce(t, op):
            t.fill_(int(min(wall(r, state["step"]) for r in rate) * 1000))

        cache._all_reduce = fake_all_reduce
        trace = []
        a, b = seq(1000, 16), seq(2000, 16)
        for step in range(1, 80):
            state["step"] = step
            cache._kv_tick()
            if step == 2:
                run_request(kit, cache, alloc, r2t, a, hints("wa", "A", {"A": 0}, fixed_tokens=16))
            if step == 3:
                run_request(kit, cache, alloc, r2t, b, hints("wb", "B", {"B": 0}, fixed_tokens=16))
            if step % 10 == 5:  # wb keeps talking, wa went quiet after step 2
                from kvflow_agents.protocol import Hints

                cache.kvflow_apply_hints(Hints(workflow="wb", agent="B", ste={"B": 0}))
            cache.kvflow_expire()
            trace.append((step, tuple(sorted(w for w, x in cache.kv_hints.workflows.items()
                                             if x.expired))))
        r = cache.evict(EvictParams(num_tokens=16))
        trace.append(("evict", r.num_tokens_evicted, cached_len(cache, a), cached_len(cache, b)))
        return trace

    t0, t1 = run_rank(0), run_rank(1)
    assert t0 == t1
    # the same two ranks on their own local clocks would expire "wa" at different steps
    assert run_rank(0, tp=1)[:-1] != run_rank(1, tp=1)[:-1]
    assert t0[-1] == ("evict", 16, 0, 16)            # the quiet workflow's prefix went first
    assert any("wa" in expired for _, expired in t0[:-1])


def test_eviction_strategy_adapter_orders_a_foreign_tree():
    import heapq

    from kvflow_agents.serving.policy import PriorityIndex
    from kvflow_agents.serving.sglang.strategy import EvictionStrategyAdapter

    class Foreign:  # stands in for SGLang's UnifiedTreeNode
        def __init__(self, parent, t):
            self.parent, self.last_access_time = parent, t

    root = Foreign(None, 0)
    a, b, c = Foreign(root, 3), Foreign(root, 1), Foreign(root, 2)
    index = PriorityIndex(lambda n: n.parent)
    index.set_tag("A", a, 1)
    index.set_tag("B", b, 0)
    strategy = EvictionStrategyAdapter("kvflow", index)
    heap = [(strategy.get_priority(n), i, n) for i, n in enumerate((a, b, c))]
    heapq.heapify(heap)
    assert [heapq.heappop(heap)[2] for _ in range(3)] == [c, a, b]  # +inf, then STE 1, then 0
    lru = EvictionStrategyAdapter("lru", index)
    assert sorted((a, b, c), key=lru.get_priority) == [b, c, a]
