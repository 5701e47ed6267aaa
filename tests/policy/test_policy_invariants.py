"""Property tests: random traces of requests, locks, hint updates, loads and time keep every
invariant, under every policy.

Checked after every operation (``KVCacheManager.check_invariants``): capacity never exceeded,
page ownership (no page in two nodes, no leak in the host pool), tree shape (T1-T4), evictable
counter, priority == min STE over subtree tags (brute force). Checked at every eviction (the
``on_evict`` observer): the victim is unlocked and not loading, and it is the policy's first
choice among all current candidates, which under ``kvflow`` means the dynamic suffix (+inf)
goes before any tagged prefix of finite STE.
"""

from __future__ import annotations

import math
import random

import pytest

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvflow_agents.serving.policy import NodeState
from policy_driver import make_manager, serve

AGENTS = ["a0", "a1", "a2", "a3"]
WORKFLOWS = ["w0", "w1"]


def candidates(m, tier):
    out = []
    for n in m.tree.iter_nodes():
        if (m.store.dev_candidate(n) if tier == "device" else m.store.host_candidate(n)):
            out.append(n)
    return out


def install_eviction_checks(m, log):
    def on_evict(node, tier, prio, reason):
        assert node.lock_ref == 0 or tier == "host" and node.state is NodeState.DEVICE
        assert node.state is not NodeState.LOADING, "evicted a loading node"
        assert node.state is not NodeState.OFFLOADING, "evicted an offloading node twice"
        if tier == "device":
            assert node.state is NodeState.DEVICE and node.n_device_children == 0
            if m.store.evict_floor is not None:  # M4: a prefetch never evicts as urgent or more
                assert reason == "prefetch" and prio > m.store.evict_floor
        key = m.policy.eviction_key(prio, node.last_access)
        best = min(m.policy.eviction_key(m.index.priority(c), c.last_access)
                   for c in candidates(m, tier))
        assert key <= best, (tier, reason, key, best)
        if m.policy.name == "kvflow" and tier == "device" and prio < math.inf:
            assert all(m.index.priority(c) < math.inf for c in candidates(m, "device")), \
                "a tagged prefix went before the dynamic suffix"
        log.append((tier, prio, reason))
    m.on_evict = on_evict


prompt = st.lists(st.integers(0, 40), min_size=0, max_size=14)
request = st.tuples(st.just("request"), st.sampled_from(WORKFLOWS), st.sampled_from(AGENTS),
                    prompt, st.booleans())
hint = st.tuples(st.just("hint"), st.sampled_from(WORKFLOWS),
                 st.dictionaries(st.sampled_from(AGENTS),
                                 st.one_of(st.none(), st.integers(0, 4)), max_size=4))

op = st.one_of(
    request, request, request, request, hint, hint,
    st.tuples(st.just("tick"), st.floats(0, 3)),
    st.tuples(st.just("lock"), st.sampled_from(AGENTS), prompt),
    st.tuples(st.just("unlock"), st.integers(0, 10)),
    st.tuples(st.just("alloc"), st.integers(0, 6)),
    st.tuples(st.just("free"), st.integers(0, 10)),
    st.tuples(st.just("demand"), st.sampled_from(AGENTS), prompt),
    st.tuples(st.just("release"), st.sampled_from(WORKFLOWS)),
    st.tuples(st.just("expire"),),
    st.tuples(st.just("infer"), st.sampled_from(WORKFLOWS), st.sampled_from(AGENTS), prompt),
)


def agent_prompt(wf, agent, ps, body):
    # Agents share a system prompt; a1 has the same fixed prefix in both workflows.
    system = [100, 101, 102, 103][: 2 * ps]
    own = [200 + AGENTS.index(agent)] * (3 * ps)
    if agent != "a1":
        own = own[:-1] + [300 + WORKFLOWS.index(wf)]
    return system + own, len(system + own)


BLOCKED_CHECKS = [0]   # how often a trace saw the prefetcher skip a plan as still blocked


def check_blocked_plan(m):
    """Reference for ``Prefetcher._still_blocked``: whenever it would skip the plan, no fresh
    candidate passes the budget check (neither whole nor as a partial head)."""
    pf, store = m.prefetcher, m.store
    tags = m.tags.prefetch_candidates()
    if not pf._still_blocked(tags):
        return
    BLOCKED_CHECKS[0] += 1
    avail = store.free_pages() - pf.reserved_pages
    for c in pf.candidates(m.clock.t, tags):
        ev, above = store.evictable_pages(), store.evictable_above(c.ste)
        assert not (avail >= c.pages or (avail + ev >= c.pages and avail + above >= c.pages)), c
        assert avail + min(ev, above) < pf.min_partial_pages or not store.partial_prefetch, c


class Trace:
    """Applies operations the way an engine and a hint source would, checking after each."""

    def __init__(self, policy, ps, device, host, link, inflight):
        self.m = make_manager(policy, page_size=ps, device_pages=device, host_pages=host,
                              link=link, max_inflight_loads=inflight, lease_s=5.0)
        self.policy, self.ps, self.device = policy, ps, device
        self.log: list = []
        install_eviction_checks(self.m, self.log)
        self.held_locks, self.held_pages, self.step = [], [], 0

    def apply(self, o):
        m, ps = self.m, self.ps
        kind = o[0]
        if kind == "request":
            _, wf, agent, body, tag = o
            fixed, flen = agent_prompt(wf, agent, ps, body)
            serve(m, fixed + body, flen, wf, agent, tag=tag)
        elif kind == "hint":
            self.step += 1
            m.update_hints(o[1], o[2], step=self.step)
        elif kind == "tick":
            m.clock.t += o[1]
            m.tick()
        elif kind == "lock":
            fixed, _ = agent_prompt("w0", o[1], ps, o[2])
            self.held_locks.append(m.lock(m.match(fixed + o[2], record=False)))
        elif kind == "unlock" and self.held_locks:
            m.unlock(self.held_locks.pop(o[1] % len(self.held_locks)))
        elif kind == "alloc":
            pages = m.allocate(o[1])
            if pages is not None:
                assert len(pages) == o[1]
                self.held_pages.append(pages)
        elif kind == "free" and self.held_pages:
            m.free(self.held_pages.pop(o[1] % len(self.held_pages)))
        elif kind == "demand":
            fixed, _ = agent_prompt("w1", o[1], ps, o[2])
            pm = m.match(fixed + o[2])
            if pm.needs_load:
                m.load_on_demand(pm)  # do not wait: leaves LOADING nodes behind
        elif kind == "release":
            m.release_workflow(o[1])
        elif kind == "expire":
            m.clock.t += 10.0
            m.tick()
        elif kind == "infer":
            fixed, _ = agent_prompt(o[1], o[2], ps, o[3])
            b = m.infer_fixed_prefix(o[1], o[2], fixed + o[3])
            assert b % ps == 0
        m.check_invariants()
        check_blocked_plan(m)
        if self.policy != "oracle":
            assert m.device.num_used <= self.device
        assert m.host.num_used <= m.host.capacity
        if self.policy in ("lru", "oracle"):
            assert m.host.num_used == 0

    def finish(self):
        m = self.m
        if self.policy == "oracle":
            assert not self.log, "oracle evicted"
        for h in self.held_locks:
            m.unlock(h)
        for p in self.held_pages:
            m.free(p)
        m.clock.t += 1000
        m.tick()
        m.check_invariants()
        # Nothing is pinned any more: everything the tree holds on device can be evicted.
        if self.policy != "oracle":
            assert m.evictable_device_pages == m.device.num_used
        event(f"{self.policy}: evictions>={min(len(self.log), 5)} "
              f"loads>={min(m.metrics.demand_loads, 3)} "
              f"prefetch>={min(m.metrics.prefetch_issued, 2)}")


POLICY_NAMES = ["lru", "hicache", "kvflow", "oracle"]
configs = dict(ps=st.sampled_from([1, 2, 3]), device=st.integers(6, 30),
               host=st.integers(0, 40), link=st.sampled_from([None, 2.0, 8.0]),
               inflight=st.integers(0, 3))


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(op, min_size=10, max_size=80), **configs)
def test_random_traces_keep_invariants(policy, ps, device, host, link, inflight, ops):
    trace = Trace(policy, ps, device, host, link, inflight)
    for o in ops:
        trace.apply(o)
    trace.finish()


def random_op(rnd):
    r = rnd.random()
    body = [rnd.randint(0, 40) for _ in range(rnd.randint(0, 14))]
    if r < 0.45:
        return ("request", rnd.choice(WORKFLOWS), rnd.choice(AGENTS), body, rnd.random() < 0.9)
    if r < 0.65:
        return ("hint", rnd.choice(WORKFLOWS),
                {a: rnd.choice([None, 0, 1, 2, 3, 4]) for a in rnd.sample(AGENTS, rnd.randint(1, 4))})
    if r < 0.75:
        return ("tick", rnd.random() * 2)
    if r < 0.79:
        return ("lock", rnd.choice(AGENTS), body)
    if r < 0.84:
        return ("unlock", rnd.randint(0, 10))
    if r < 0.87:
        return ("alloc", rnd.randint(0, 4))
    if r < 0.91:
        return ("free", rnd.randint(0, 10))
    if r < 0.95:
        return ("demand", rnd.choice(AGENTS), body)
    if r < 0.96:
        return ("release", rnd.choice(WORKFLOWS))
    if r < 0.97:
        return ("expire",)
    return ("infer", rnd.choice(WORKFLOWS), rnd.choice(AGENTS), body)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=30, deadline=None)
@given(rnd=st.randoms(use_true_random=False), n_ops=st.integers(60, 250), **configs)
def test_long_random_traces_keep_invariants(policy, ps, device, host, link, inflight, rnd, n_ops):
    # Long traces that actually fill both tiers (hypothesis keeps op lists short).
    trace = Trace(policy, ps, device, host, link, inflight)
    for _ in range(n_ops):
        trace.apply(random_op(rnd))
    trace.finish()


@settings(max_examples=30, deadline=None)
@given(rnd=st.randoms(use_true_random=False), n_ops=st.integers(60, 200),
       ps=st.sampled_from([1, 2]), device=st.integers(8, 24), host=st.integers(4, 40),
       link=st.sampled_from([1.0, 4.0]), inflight=st.integers(1, 3))
def test_prefetch_heavy_traces_keep_invariants(rnd, n_ops, ps, device, host, link, inflight):
    # Mostly requests and near-future hints with a slow link: many loads in flight at once,
    # prefetches racing demand loads, evictions while loading.
    trace = Trace("kvflow", ps, device, host, link, inflight)
    for _ in range(n_ops):
        r = rnd.random()
        body = [rnd.randint(0, 40) for _ in range(rnd.randint(0, 6))]
        if r < 0.4:
            o = ("request", rnd.choice(WORKFLOWS), rnd.choice(AGENTS), body, True)
        elif r < 0.75:
            o = ("hint", rnd.choice(WORKFLOWS), {a: rnd.choice([0, 1, 1, 2, None]) for a in AGENTS})
        elif r < 0.9:
            o = ("tick", rnd.random() * 0.5)
        else:
            o = ("demand", rnd.choice(AGENTS), body)
        trace.apply(o)
    trace.finish()
    m = trace.m
    assert m.metrics.prefetch_used + m.metrics.prefetch_wasted <= m.metrics.prefetch_issued
    assert sum(m.metrics.prefetch_wasted_by.values()) == m.metrics.prefetch_wasted


def test_blocked_plan_skips_are_checked_against_a_fresh_plan():
    """Seeded kvflow traces where the prefetcher skips plans as still blocked; every skip is
    checked against fresh candidates (``check_blocked_plan`` in ``Trace.apply``)."""
    before = BLOCKED_CHECKS[0]
    for seed in range(10):
        rnd = random.Random(seed)
        trace = Trace("kvflow", 1, 12, 30, 2.0, 2)
        for _ in range(200):
            trace.apply(random_op(rnd))
    assert BLOCKED_CHECKS[0] - before > 50
