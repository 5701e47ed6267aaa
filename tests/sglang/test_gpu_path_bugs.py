"""Bugs of the plugin on the paths a GPU server takes, shown on SGLang's real classes where
this CPU's real server cannot express them (the server-side ones are in
``tests/sglang_server/test_bugs.py``).

1. Overlap scheduler + proactive loads vs SGLang's 3-slot layer-counter ring. On a GPU the
   scheduler builds batch k+1 while batch k still runs, and SGLang's ring is sized for that:
   a slot is reused only once the batch that consumed it has finished. A proactive load takes
   a slot that no batch consumes, so a demand load right after prefetches reuses a slot whose
   load is still in flight and SGLang asserts. (On this CPU the forward is synchronous, so
   batch k has always finished before batch k+1 is built: the real server cannot show it.)
   Modelled here with the real controller, the real ring, the emulated link and the overlap
   loop's pacing.
3. TP: the 0.5.23 ``Scheduler`` has no ``tp_rank``, so every rank answers a snapshot (two
   replies); the lease clock is all-reduced inside eviction, which deadlocks when one rank
   evicts alone (SGLang does not make eviction a collective). Two real processes, gloo.
4. ``kvflow_blocked`` compares the tokens of every queued request with every load in flight,
   every scheduler step: Python work O(queue x loads x tokens).
5. A node counts as on device as soon as its load starts; the status-aware check compares
   tokens, and with EAGLE's bigram keys the path tokens do not line up with the request's, so
   the request is admitted and reads rows that have not landed (poisoned here).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import unittest
from array import array
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as fx  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import (FakeClock, hints, init_hicache_direct, matched,  # noqa: E402
                         real_copies, run_request, seq)

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.sglang import host_link  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402

GBPS = 1e-6


def device_rows_read(cache, req):
    """The device KV rows a prefill of ``req`` would read for its matched prefix."""
    return cache.path_device_indices(req.last_node)[:req.prefix_len]


# ------------------------------------------------------------------------------ bug 1
class OverlapRingTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow", kv_size=256, max_context_len=256,
                      max_num_reqs=32)
    agents = ("A", "B", "C", "D", "X", "Y", "Z", "W")

    def build(self, cache_class):
        with mock.patch.object(fx, "UnifiedRadixCache", cache_class):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        self._init_hicache(self.cache)
        self.clock = FakeClock()
        host_link.install(GBPS, clock=self.clock, sleep=self.clock.sleep)
        self.addCleanup(host_link.uninstall)
        self.fixed = {a: seq(1000 * (i + 1), 16) for i, a in enumerate(self.agents)}
        for a in self.agents:
            run_request(self, self.cache, self.alloc, self.r2t, self.fixed[a],
                        hints("wf", a, {a: 0}, fixed_tokens=16)
                        if cache_class is KVFlowRadixCache else None)
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.pending = []   # consumer slots of launched batches, oldest first

    def iteration(self, *, prefetch=None, demand=None):
        """One turn of SGLang's overlap loop on a GPU: reap acks and (KVFlow) start
        prefetches; build the next prefill batch, whose demand load takes the next ring slot;
        launch it; then finish the previous batch (its forward waited for its own load)."""
        if prefetch is not None:
            # A map a real client sends: the sender running (0), the agent it names next (1).
            # (Maps that keep naming agents that never come would lose the workflow's hint
            # trust, and a distrusted workflow gets no prefetch: serving/policy/hints.py.)
            self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="router",
                                                ste={"router": 0, prefetch: 1}))
        self.cache.check_hicache_events()
        slot = -1
        if demand is not None:
            self._load_back_through_admission(self.cache, self.r2t, self.fixed[demand])
            slot = self.cache.ready_to_load_host_cache()
            self.assertGreaterEqual(slot, 0)
        self.pending.append(slot)
        if len(self.pending) > 1:
            prev = self.pending.pop(0)
            if prev >= 0:
                counter = self.cache.cache_controller.layer_done_counter
                counter.events[prev].wait(counter.num_layers - 1)

    def drain(self):
        for _ in range(4):
            self.iteration()
        self.clock.advance(60.0)
        self.cache.check_hicache_events()
        self.assertEqual(self.cache.cache_controller.ack_load_queue, [])
        self.cache.sanity_check()

    def test_stock_demand_loads_fit_sglangs_ring(self):
        """Control: SGLang's own cache under the same pacing, demand loads only."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.build(UnifiedRadixCache)
        for a in ("X", "Y", "Z", "W", "A", "B"):
            self.iteration(demand=a)
        self.drain()

    def test_proactive_loads_coexist_with_sglangs_ring(self):
        self.build(KVFlowRadixCache)
        self.iteration(prefetch="A", demand="X")
        self.iteration(prefetch="B", demand="Y")     # reuses slot 0 while A is on the link
        self.iteration(prefetch="C", demand="Z")
        self.iteration(demand="W")
        self.drain()
        self.assertGreaterEqual(self.cache.kv_metrics.prefetch_issued, 3)


# ------------------------------------------------------------------------------ bug 3
def _tp_rank_main(rank, port, reply_addr, evict_alone, out, stop):
    """One TP rank: a real gloo group of 2, a KVFlowRadixCache using it as its TP group."""
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import sglang.test.kits.unified_radix_cache.fixtures as fx
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.test.kits.unified_radix_cache.config import CacheConfig
        from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

        from kvflow_agents.serving.sglang import hooks
        from kvflow_agents.serving.sglang.messages import KVFlowControl

        fx.get_device = lambda *a, **k: "cpu"
        kit = UnifiedRadixCacheFixtures()
        kit.cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            cache, alloc, r2t = fx.build_fixture(kit.cfg)
        for i in range(3):   # something to evict, with hints (a tagged workflow)
            run_request(kit, cache, alloc, r2t, seq(100 * (i + 1), 16),
                        hints("wf", f"A{i}", {f"A{i}": i}, fixed_tokens=16))
        cache.tp_group = dist.group.WORLD
        cache.tp_world_size = 2
        scheduler = Scheduler.__new__(Scheduler)   # the real class: no tp_rank attribute
        scheduler.tree_cache = cache
        dist.barrier()
        out.put(("ready", rank))
        if reply_addr:
            hooks.handle_control(scheduler, KVFlowControl("snapshot", {}, reply_addr))
            out.put(("answered", rank))
        if evict_alone and rank == 0:
            before = cache.evictable_size()
            cache.evict(EvictParams(num_tokens=16))   # rank 1 does not evict
            out.put(("evicted", rank, before - cache.evictable_size()))
        stop.wait(120)    # alive and idle, as a rank would be
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(wanted, *, reply_addr=None, evict_alone=False, timeout=20.0, startup=300.0):
    """Start two ranks; once both are set up (imports take a while on a busy box), wait up to
    ``timeout`` s for the events ``wanted`` (a predicate over the event list); then stop both.
    Returns the events."""
    import queue
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_tp_rank_main, args=(r, port, reply_addr, evict_alone, out, stop),
                         daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    events: list = []

    def collect(until, deadline):
        while not until(events) and time.monotonic() < deadline:
            try:
                events.append(out.get(timeout=max(0.05, min(0.5, deadline - time.monotonic()))))
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    return
            if any(e[0] == "error" for e in events):
                return

    try:
        collect(lambda ev: sum(e[0] == "ready" for e in ev) == 2, time.monotonic() + startup)
        collect(wanted, time.monotonic() + timeout)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [e for e in events if e[0] == "error"]
    assert not errors, errors[0][2]
    return events


@pytest.fixture(scope="module")
def two_ranks():
    """One run of two TP ranks: both get the same snapshot request (as every rank does, the
    control message is broadcast with the requests); then rank 0 evicts alone."""
    import zmq

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        events = _run_two_ranks(
            lambda ev: sum(e[0] == "answered" for e in ev) == 2 and any(e[0] == "evicted" for e in ev),
            reply_addr=f"tcp://127.0.0.1:{port}", evict_alone=True)
        replies = 0
        while pull.poll(1000):
            pull.recv()
            replies += 1
    finally:
        pull.close(linger=0)
    return events, replies


def test_only_tp_rank_0_answers_a_snapshot(two_ranks):
    events, replies = two_ranks
    assert sum(e[0] == "answered" for e in events) == 2, events
    assert replies == 1


def test_one_rank_evicting_alone_does_not_deadlock(two_ranks):
    """Rank 0 evicts, rank 1 (alive, idle) does not: rank 0's eviction must not wait on it."""
    events, _ = two_ranks
    evicted = [e for e in events if e[0] == "evicted"]
    assert evicted, f"rank 0 still blocked in eviction after 20 s; events {events}"
    assert evicted[0][2] >= 16, evicted


# ------------------------------------------------------------------------------ bug 4
class CountingIds(array):
    """``origin_input_ids`` that counts element reads (Python-level work per token)."""

    reads = 0

    def __getitem__(self, i):
        CountingIds.reads += 1 if isinstance(i, int) else 0
        return super().__getitem__(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class AdmissionCostTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=1, eviction_policy="kvflow", kv_size=8192, max_context_len=4096,
                      max_num_reqs=96)
    N = 2000      # tokens per fixed prefix
    QUEUE = 40

    def test_admission_check_cost_does_not_grow_with_prompt_length_or_loads(self):
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        self._init_hicache(self.cache)
        fixed = {a: seq(10000 * (i + 1), self.N) for i, a in enumerate("AB")}
        for a in fixed:
            run_request(self, self.cache, self.alloc, self.r2t, fixed[a],
                        hints("wf", a, {a: 1}, fixed_tokens=self.N))
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.assertEqual(len(self.cache.kvflow_prefetch()), 2)       # both in flight
        queue = []
        for i in range(self.QUEUE):
            req = matched(self, self.cache, fixed["A"] + seq(90000 + 10 * i, 8))
            req.origin_input_ids = CountingIds("q", req.origin_input_ids)
            queue.append(req)
        CountingIds.reads = 0
        for _ in range(2):                                          # two scheduler steps
            blocked = [self.cache.kvflow_blocked(r) for r in queue]
        self.assertTrue(all(blocked))
        # O(queue) per step: a small constant per request, not ~N per request per load
        self.assertLessEqual(CountingIds.reads, 2 * 4 * self.QUEUE, CountingIds.reads)


# ------------------------------------------------------------------------------ bug 5
class EagleKeysTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=1, eviction_policy="kvflow", kv_size=128, max_context_len=256,
                      max_num_reqs=16, is_eagle=True, num_layers=2, head_num=2, head_dim=8)

    def test_request_on_a_loading_prefix_is_held_back_with_bigram_keys(self):
        real_copies(self)
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        init_hicache_direct(self, self.cache)
        clock = FakeClock()
        host_link.install(GBPS, clock=clock, sleep=clock.sleep, poison=True)
        self.addCleanup(host_link.uninstall)
        a = seq(500, 24)
        # another prefix shares A's first 8 tokens: A's path is two nodes, as usual in a tree
        run_request(self, self.cache, self.alloc, self.r2t, a[:8] + seq(800, 16))
        run_request(self, self.cache, self.alloc, self.r2t, a,
                    hints("wf", "A", {"A": 2}, fixed_tokens=16))
        self._backup_tree(self.cache)
        # evict the other prefix's tail (untagged: first) and A's own part; the shared head stays
        node_a = self.cache.kv_index.node_of(("wf", "A"))
        shared = node_a.parent
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size() - len(shared.key)))
        self.assertTrue(node_a.evicted and not shared.evicted)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="router", ste={"A": 1}))
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])  # in flight
        req = matched(self, self.cache, a[:16] + seq(7000, 8))
        pool = self._get_full_kv_pool(self.alloc)
        idx = device_rows_read(self.cache, req)
        rows = pool.get_key_buffer(pool.start_layer)[idx]
        self.assertGreater(len(idx), 0)                                  # SGLang matched it on device
        self.assertTrue(torch.isnan(rows.float()).any())                 # ... not all of it landed
        self.assertTrue(self.cache.kvflow_blocked(req))                  # so it must wait
