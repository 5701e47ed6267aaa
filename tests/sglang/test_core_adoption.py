"""What the plugin gained by running the policy core's parts over SGLang's tree (the three
features ``serving/sglang/README.md`` used to list as not adopted), on SGLang's real
UnifiedRadixCache + HiCache controller + host pool (only the copy itself is stood in):

- the prefetch reserve: room the scheduler's waiting queue will allocate is not prefetched into;
- exposed / hidden load time: a request held back by a load in flight charges the wait;
- load versus recompute: a demand ``init_load_back`` is skipped when recomputing is cheaper,
  and the link estimate is calibrated from SGLang's own load-back durations.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InitLoadBackParams,  # noqa: E402
                                                    MatchPrefixParams)
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import (ClockedKVFlowHiCacheSetup, hints, key, matched,  # noqa: E402
                         run_request, seq)

from kvflow_agents.protocol import Hints  # noqa: E402


class CoreAdoptionTest(ClockedKVFlowHiCacheSetup, UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow", kv_size=128, max_context_len=256,
                      max_num_reqs=32)

    def setUp(self):
        super().setUp()
        self.fixed = {"A": seq(1000, 16), "B": seq(2000, 16)}

    def req(self, agent, ste):
        return run_request(self, self.cache, self.alloc, self.r2t, self.fixed[agent],
                           hints("wf", agent, ste, fixed_tokens=16))

    def offload_all(self):
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))

    def test_prefetch_reserve_keeps_room_for_the_waiting_queue(self):
        self.req("A", {"A": 1})
        self.offload_all()
        # untagged (+inf) work on device, 16 tokens free: A's prefix would fit
        for i in range(7):
            run_request(self, self.cache, self.alloc, self.r2t, seq(50000 + 100 * i, 16))
        self.assertEqual(self.alloc.available_size(), 16)
        # a queued request will need 124 tokens: free + evictable - 124 < 16, no prefetch
        waiting = [SimpleNamespace(origin_input_ids=list(range(120)), prefix_len=0,
                                   sampling_params=SimpleNamespace(max_new_tokens=4))]
        self.cache.kvflow_watch_scheduler(lambda: waiting)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        self.assertEqual(self.cache.kvflow_prefetch(), [])
        self.assertGreaterEqual(self.cache.kv_metrics.prefetch_budget_skips, 1)
        waiting.clear()  # the queue drained: the free room is the prefetch's
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])

    def test_a_request_held_back_by_a_prefetch_charges_exposed_time(self):
        self.req("A", {"A": 1})
        self.offload_all()
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])
        self.clock[0] += 0.5
        waiting = matched(self, self.cache, self.fixed["A"] + seq(70000, 4))
        self.assertTrue(self.cache.kvflow_blocked(waiting))  # held: its wait starts now
        self.clock[0] += 0.25
        self.ack_all()                                       # landed 0.25 s later
        m = self.cache.kv_metrics
        self.assertEqual((m.prefetch_used, m.load_exposed_s), (0, 0.0))
        self.cache.match_prefix(MatchPrefixParams(key=key(self.fixed["A"] + seq(70000, 4)),
                                                  req=waiting))
        self.assertEqual(m.prefetch_used, 1)
        self.assertAlmostEqual(m.load_exposed_s, 0.25, places=3)   # from the hold to landing
        self.assertAlmostEqual(m.load_hidden_s, 0.5, places=3)     # before anyone wanted it

    def test_prefetch_read_after_landing_is_all_hidden(self):
        self.req("A", {"A": 1})
        self.offload_all()
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        self.cache.kvflow_prefetch()
        self.clock[0] += 0.3
        self.ack_all()
        reader, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t, self.fixed["A"])
        self.cache.match_prefix(MatchPrefixParams(key=key(self.fixed["A"]), req=reader))
        m = self.cache.kv_metrics
        self.assertEqual(m.prefetch_used, 1)
        self.assertEqual(m.load_exposed_s, 0.0)
        self.assertAlmostEqual(m.load_hidden_s, 0.3, places=3)

    def test_a_landed_prefetch_evicted_unread_is_wasted_not_used_later(self):
        """SGLang's HiCache demotes an evicted node to host (it stays in the tree): a landed
        prefetch that leaves the device unread was fetched for nothing, and a later demand
        load of the same prefix must not credit it as used."""
        self.req("A", {"A": 1})
        self.offload_all()
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])
        self.ack_all()
        m = self.cache.kv_metrics
        self.assertEqual((m.prefetch_issued, m.prefetch_wasted), (1, 0))
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))  # demoted, unread
        self.assertEqual(m.prefetch_wasted, 1)
        self.assertEqual(self.cache.kv_index.node_of(("wf", "A")).evicted, True)  # still in the tree
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])  # fetched again
        self.ack_all()
        reader, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t, self.fixed["A"])
        self.cache.match_prefix(MatchPrefixParams(key=key(self.fixed["A"]), req=reader))
        self.assertEqual((m.prefetch_issued, m.prefetch_used, m.prefetch_wasted), (2, 1, 1))

    def test_load_back_durations_calibrate_the_link_estimate(self):
        self.assertEqual(self.cache.kv_loads.secs_per_page, 0.0)   # unknown until measured
        self.req("A", {"A": 1})
        self.offload_all()
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="X", ste={"A": 1}))
        with mock.patch("kvflow_agents.serving.sglang.cache.time.perf_counter",
                        side_effect=[10.0, 10.4]):
            self.cache.kvflow_prefetch()   # load_back at 10.0 s (4 pages)
            self.ack_all()                 # reaped at 10.4 s
        self.assertAlmostEqual(self.cache.kv_loads.secs_per_page, 0.1)
        self.assertAlmostEqual(self.cache.kvflow_snapshot()["link"]["secs_per_page"], 0.1)

    def _prefill_batch(self, prompts, t0, t1, cached=None, unfinished=()):
        """One prefill batch as SGLang's scheduler records it: every request stamped with the
        batch's forward entry (``set_time_batch``), its prefill end, then cached."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.observability.req_time_stats import set_time_batch

        reqs = [self._make_inflight_req(self.cache, self.alloc, self.r2t, p)[0] for p in prompts]
        with mock.patch("sglang.srt.observability.req_time_stats.time.perf_counter", return_value=t0):
            set_time_batch(reqs, "set_forward_entry_time")
        for i, r in enumerate(reqs):
            r.cached_tokens = (cached or {}).get(i, 0)
            if i in unfinished:      # a chunked request's middle chunk: no prefill end yet
                continue
            r.time_stats.set_prefill_finished_time(t1)
            r.finished_reason = FINISH_LENGTH(length=1)
            self.cache.checkpoint(r, up_to=len(prompts[i]))
            self.cache.unlock(r.lock)
            r.lock = None
        return reqs

    def test_prefill_speed_is_measured_per_batch_not_per_request(self):
        """Four requests in one batch (48 new tokens in 0.2 s, one with its 16-token prompt
        cached, one still mid-chunk): one sample, the batch's tokens over its time (a single
        request's ``t1 - t0`` over its own 8 tokens would say 25 ms per token)."""
        loads = self.cache.kv_loads
        self._prefill_batch([seq(1000, 20), seq(2000, 20), seq(1000, 16) + seq(3000, 8),
                             seq(4000, 40)], 5.0, 5.2, cached={2: 16}, unfinished=(3,))
        self.assertIsNone(loads.measured_prefill_spt)   # counted once the batch is complete
        self.cache.kvflow_step()
        self.assertAlmostEqual(loads.measured_prefill_spt, 0.2 / 48)
        self.assertAlmostEqual(self.cache.kvflow_snapshot()["link"]["recompute_s_per_token"], 0.2 / 48)
        # a lone request with a cached prompt (4 new tokens, mostly the step's fixed cost)
        # moves the estimate by its tokens' weight
        self._prefill_batch([seq(1000, 16) + seq(5000, 4)], 6.0, 6.05, cached={0: 16})
        self.cache.kvflow_step()
        keep = 1 - loads._prefill_ema
        self.assertAlmostEqual(loads.measured_prefill_spt, (keep * 0.2 + 0.05) / (keep * 48 + 4))
        self.assertLess(loads.measured_prefill_spt, 0.2 / 48 * 1.5)

    def test_demand_load_weighs_a_recompute_with_the_requests_it_would_stall(self):
        """Through the admission hook, as SGLang's PrefillAdder calls init_load_back: a load
        that one request's recompute beats is taken when three requests run and one is
        already in the round's prefill batch (recompute 16 ms x 5 > load 40 ms > 16 ms).
        Outside a round the running batch alone counts."""
        from kvflow_agents.serving.sglang import hooks

        self.req("A", {"A": 0})
        self.offload_all()
        self.cache.kv_loads.measured_spp = 0.01          # 4 pages: 40 ms
        self.cache.kv_loads.recompute_s_per_token = 0.001  # 16 tokens: 16 ms
        r, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t,
                                       self.fixed["A"] + seq(80000, 4))
        r.init_next_round_input(self.cache)
        self.assertEqual(r.host_hit_length, 16)

        def add_one_req(adder, req):  # SGLang's adder, in outline: load back what is on host
            return self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))

        m = self.cache.kv_metrics
        alone = SimpleNamespace(tree_cache=self.cache, running_batch=SimpleNamespace(reqs=[]),
                                can_run_list=[])
        with mock.patch.object(self.cache, "load_back") as lb:
            self.assertEqual(hooks.around_add_one_req(add_one_req, alone, r), (0, r.last_node))
        lb.assert_not_called()
        self.assertEqual((m.loads_declined, m.demand_loads), (1, 0))
        busy = SimpleNamespace(tree_cache=self.cache, can_run_list=[object()],
                               running_batch=SimpleNamespace(reqs=[object()] * 3))
        loaded, _ = hooks.around_add_one_req(add_one_req, busy, r)
        self.assertEqual((loaded, m.loads_declined, m.demand_loads), (16, 1, 1))
        self.assertIsNone(self.cache._kv_adder)          # the round's view ends with the call
        # outside a round (the prefetch planner's weighing): SGLang's running batch, which the
        # intake hook told the cache where to find
        self.assertEqual(self.cache.kv_loads.recompute_stalls(), 0)
        sched = SimpleNamespace(tree_cache=self.cache, waiting_queue=[],
                                running_batch=SimpleNamespace(reqs=[object()] * 2))
        hooks.after_add_request_to_queue(None, sched, r)
        self.assertEqual(self.cache.kv_loads.recompute_stalls(), 2)
        sched.running_batch = SimpleNamespace(reqs=[])   # SGLang replaces its batch objects
        self.assertEqual(self.cache.kv_loads.recompute_stalls(), 0)

    def test_demand_load_declined_when_recomputing_is_cheaper(self):
        self.req("A", {"A": 0})
        self.offload_all()
        self.cache.kv_loads.measured_spp = 1.0     # a slow link: 1 s per page
        self.cache.kv_loads.recompute_s_per_token = 0.001
        r, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t,
                                       self.fixed["A"] + seq(80000, 4))
        r.init_next_round_input(self.cache)
        self.assertEqual(r.host_hit_length, 16)
        with mock.patch.object(self.cache, "load_back") as lb:
            loaded, last = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=r.best_match_node, host_hit_length=r.host_hit_length, req=r))
        lb.assert_not_called()
        self.assertEqual((loaded, last), (0, r.last_node))
        m = self.cache.kv_metrics
        self.assertEqual((m.loads_declined, m.declined_pages, m.demand_loads), (1, 4, 0))
        # a fast link: loaded (and tracked until its ack)
        self.cache.kv_loads.measured_spp = 1e-6
        loaded, _ = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=r.best_match_node, host_hit_length=r.host_hit_length, req=r))
        self.assertEqual(loaded, 16)
        self.assertEqual(m.demand_loads, 1)
        self.assertEqual(self.cache.kv_loads.in_flight, 1)
        self.cache.ready_to_load_host_cache()
        self.ack_all()
        self.assertEqual(self.cache.kv_loads.in_flight, 0)
