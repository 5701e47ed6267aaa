"""Proactive load-back on SGLang's real HiCache (HybridCacheController, host pool, load/ack
queues, layer counters); only the host<->device copy is stood in (conftest).

- agents with STE <= lookahead whose tagged prefix is host-only are loaded with SGLang's
  ``load_back`` at the scheduler step (``check_hicache_events``), most urgent first;
- free load slots and the in-flight cap bound it;
- no thrash: making room never evicts a node at least as urgent as the fetched agent;
- requests on a prefix in flight are reported blocked until the ack is reaped.
"""

from __future__ import annotations

import unittest
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import hints, key, matched, run_request, seq  # noqa: E402

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402


class PrefetchTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow", kv_size=128, max_context_len=256,
                      max_num_reqs=32)

    def setUp(self):
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        self._init_hicache(self.cache)  # SGLang's real HiCache controller + host pool
        self.fixed = {"A": seq(1000, 16), "B": seq(2000, 16), "C": seq(3000, 16)}

    def req(self, agent, ste, suffix=0, **kw):
        toks = self.fixed[agent] + (seq(90000 + 10 * suffix, 4) if suffix else [])
        return run_request(self, self.cache, self.alloc, self.r2t, toks,
                           hints("wf", agent, ste, fixed_tokens=16, **kw))

    def offload_all(self):
        """Back everything up to host (write-through) and evict it from the device."""
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.assertEqual(self.cache.evictable_size(), 0)

    def residency(self):
        return {a["agent"]: a["residency"] for a in self.cache.kvflow_snapshot()["agents"]}

    def device_len(self, tokens):
        return self.cache.match_prefix(fx.MatchPrefixParams(key=key(tokens))).device_prefix_len

    def ack_all(self):
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.loading_check()

    # ----------------------------------------------------------------------------------
    def test_prefetch_issues_load_back_for_next_agents(self):
        ste = {"A": 0, "B": 1, "C": 4}
        for a in ste:
            self.req(a, ste)
        self.offload_all()
        self.assertEqual(set(self.residency().values()), {"host"})
        with mock.patch.object(self.cache, "load_back", wraps=self.cache.load_back) as lb:
            self.cache.check_hicache_events()
        loaded = {self.cache.kv_index.node_of(("wf", a)).id: a for a in ste}
        self.assertEqual(sorted(loaded[c.args[0]] for c in lb.call_args_list), ["A", "B"])
        self.assertEqual(self.cache.kv_metrics.prefetch_issued, 2)
        res = self.residency()
        self.assertEqual((res["A"], res["B"], res["C"]), ("loading", "loading", "host"))
        # in flight: SGLang's ongoing_load_back holds the anchors until the acks
        self.assertEqual(set(self.cache._inflight), set(self.cache.ongoing_load_back))
        self.ack_all()
        self.assertFalse(self.cache.kvflow_has_inflight())
        self.assertEqual(self.device_len(self.fixed["A"]), 16)
        self.assertEqual(self.device_len(self.fixed["B"]), 16)
        self.assertEqual(self.device_len(self.fixed["C"]), 0)  # STE 4 > lookahead 1

    def test_requests_on_a_loading_prefix_are_blocked_until_ack(self):
        ste = {"A": 1, "B": 3}
        self.req("A", ste)
        self.req("B", ste)
        self.offload_all()
        self.cache.check_hicache_events()
        # as SGLang's prefill builder does: match each queued request, then admit or skip it
        on_a = matched(self, self.cache, self.fixed["A"] + seq(70000, 8))
        on_b = matched(self, self.cache, self.fixed["B"] + seq(71000, 8))
        other = matched(self, self.cache, seq(72000, 24))
        self.assertTrue(self.cache.kvflow_blocked(on_a))
        self.assertFalse(self.cache.kvflow_blocked(on_b))    # host-only: demand load as usual
        self.assertFalse(self.cache.kvflow_blocked(other))
        self.ack_all()
        on_a = matched(self, self.cache, self.fixed["A"] + seq(70000, 8))   # next round's match
        self.assertFalse(self.cache.kvflow_blocked(on_a))

    def _held_with_host_rest(self):
        """A's earlier call left its 4-token history below A's tag; all offloaded; the prefetch
        loads the tag only, so A's next call is held with a host-only rest."""
        self.req("A", {"A": 1, "B": 3}, suffix=1)
        self.offload_all()
        self.cache.check_hicache_events()
        self.assertEqual(self.residency()["A"], "loading")
        toks = self.fixed["A"] + seq(90010, 4) + seq(70000, 8)
        req = matched(self, self.cache, toks)
        self.assertEqual((req.prefix_len, req.host_hit_length), (16, 4))
        return toks, req

    def test_a_host_rest_below_a_loading_prefix_is_queued_behind_it(self):
        """Held for its prefix's prefetch, a request's host-only rest is loaded at once, not at
        admission, when the next agent's prefetch may hold the link (bench/RESULTS.md 6.57)."""
        toks, req = self._held_with_host_rest()
        with mock.patch.object(self.cache, "load_back", wraps=self.cache.load_back) as lb:
            self.assertTrue(self.cache.kvflow_blocked(req))
            self.assertTrue(self.cache.kvflow_blocked(matched(self, self.cache, toks)))
        self.assertEqual([c.args[0] for c in lb.call_args_list], [req.last_host_node])
        self.assertEqual(self.cache.kv_stats["rest_queued"], 1)
        self.assertEqual(self.cache.kv_metrics.demand_loads, 1)
        nxt = matched(self, self.cache, toks)  # the rest counts as on device, still in flight
        self.assertEqual((nxt.prefix_len, nxt.host_hit_length), (20, 0))
        self.assertTrue(self.cache.kvflow_blocked(nxt))
        self.ack_all()
        self.assertFalse(self.cache.kvflow_blocked(matched(self, self.cache, toks)))
        self.assertEqual(self.device_len(toks), 20)
        self.cache.sanity_check()

    def test_a_host_rest_cheaper_to_recompute_is_weighed_once(self):
        toks, req = self._held_with_host_rest()
        with mock.patch.object(self.cache.kv_loads, "should_load", return_value=False) as sl, \
                mock.patch.object(self.cache, "load_back") as lb:
            for _ in range(3):  # a held request is checked every round
                self.assertTrue(self.cache.kvflow_blocked(req))
        lb.assert_not_called()
        self.assertEqual(sl.call_count, 1)
        self.assertIsNotNone(sl.call_args.kwargs["ready_anyway"])  # charged past the head
        self.ack_all()
        req = matched(self, self.cache, toks)  # admission's demand load weighs it again
        self.assertEqual((req.prefix_len, req.host_hit_length), (16, 4))
        self.assertFalse(self.cache.kvflow_blocked(req))

    def test_free_slot_and_inflight_cap(self):
        ste = {"A": 0, "B": 1, "C": 1}
        for a in ste:
            self.req(a, ste)
        self.offload_all()
        with mock.patch.object(type(self.cache), "_proactive_slot_free", return_value=False):
            self.assertEqual(self.cache.kvflow_prefetch(), [])
        self.assertGreater(self.cache.kv_stats["prefetch_skipped_no_slot"], 0)
        self.cache.max_inflight_prefetch = 1
        self.assertEqual(len(self.cache.kvflow_prefetch()), 1)
        self.assertEqual(self.cache.kvflow_prefetch(), [])      # cap reached, nothing more
        self.ack_all()
        self.assertEqual(len(self.cache.kvflow_prefetch()), 1)  # slot free again

    def test_no_thrash_prefetch_never_evicts_equally_urgent(self):
        # Device holds 128 tokens. A (STE 1) goes to host; B fills the device and is
        # itself needed now (STE 0) -> prefetching A must not evict B.
        self.req("A", {"A": 1, "B": 0})
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=16))
        self.assertEqual(self.residency()["A"], "host")
        filler = []
        for i in range(7):  # 7 x 16 = 112 tokens of B-tagged prefixes (STE 0)
            toks = seq(40000 + 100 * i, 16)
            run_request(self, self.cache, self.alloc, self.r2t, toks,
                        hints("wf2", f"B{i}", {f"B{i}": 0}, fixed_tokens=16))
            filler.append(toks)
        run_request(self, self.cache, self.alloc, self.r2t, seq(60000, 16))  # untagged junk
        self.assertEqual(self.alloc.available_size(), 0)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        started = self.cache.kvflow_prefetch()
        # room for A came only from the untagged (+inf) node; every STE-0 prefix survived
        self.assertEqual(started, [("wf", "A")])
        self.assertEqual(self.device_len(seq(60000, 16)), 0)
        for toks in filler:
            self.assertEqual(self.device_len(toks), 16)

    def test_no_thrash_declines_rather_than_evict_more_urgent(self):
        self.req("A", {"A": 1})
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=16))
        filler = []
        for i in range(8):  # the whole device: 8 x 16 tokens, each an agent running now
            toks = seq(40000 + 100 * i, 16)
            run_request(self, self.cache, self.alloc, self.r2t, toks,
                        hints("wf2", f"B{i}", {f"B{i}": 0}, fixed_tokens=16))
            filler.append(toks)
        self.assertEqual(self.alloc.available_size(), 0)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        # the policy core's budget: no free page, none evictable above STE 1 -> not even tried
        with mock.patch.object(self.cache, "load_back", wraps=self.cache.load_back) as lb:
            self.assertEqual(self.cache.kvflow_prefetch(), [])
        lb.assert_not_called()
        self.assertGreaterEqual(self.cache.kv_metrics.prefetch_budget_skips, 1)
        # were the budget estimate wrong, SGLang's eviction walk still stops at the floor
        from kvflow_agents.serving.sglang.loads import _SGLangTarget

        with mock.patch.object(_SGLangTarget, "evictable_above", return_value=10**6):
            self.assertEqual(self.cache.kvflow_prefetch(), [])
        self.assertEqual(self.cache.kv_stats["prefetch_declined"], 1)
        self.assertGreater(self.cache.kv_stats["floor_stops"], 0)
        for toks in filler:
            self.assertEqual(self.device_len(toks), 16)
        self.assertEqual(self.residency()["A"], "host")
        self.cache.sanity_check()

    def test_lookahead_bounds_prefetch(self):
        ste = {"A": 2, "B": 3}
        self.req("A", ste)
        self.req("B", ste)
        self.offload_all()
        self.assertEqual(self.cache.kvflow_prefetch(), [])
        self.cache.lookahead = 2
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])

    def test_agents_beyond_the_busy_lookahead_wait_for_an_idle_link(self):
        """--kvflow-busy-lookahead 1 under lookahead 2: B (STE 2) is loaded only once A's load
        (STE 1) has been acked; SGLang's loads are untimed, so "idle" is "nothing in flight"."""
        ste = {"A": 1, "B": 2}
        self.req("A", ste)
        self.req("B", ste)
        self.offload_all()
        self.cache.lookahead, self.cache.busy_lookahead = 2, 1
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])
        self.assertEqual(self.cache.kvflow_prefetch(), [])
        self.assertEqual(self.residency()["B"], "host")
        self.ack_all()
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "B")])
        self.ack_all()
        self.assertEqual(self.residency(), {"A": "device", "B": "device"})

    def test_no_hints_no_prefetch(self):
        for a in self.fixed:
            run_request(self, self.cache, self.alloc, self.r2t, self.fixed[a])
        self.offload_all()
        with mock.patch.object(self.cache, "load_back") as lb:
            self.cache.check_hicache_events()
        lb.assert_not_called()
        self.assertFalse(self.cache.kvflow_has_inflight())
