"""The emulated host link (``serving/sglang/host_link.py``) under SGLang's real HiCache:
the controller, its load/ack queues, the layer-counter ring, the host pool and SGLang's own
host->device copy code (direct io backend, layer_first), on a fake clock.

- a load of ``b`` bytes is not acked before ``b / rate``; loads queue FIFO on one link;
- the bytes land when a reader may see them (an event found ready, a forward's layer wait);
  until then the destination rows are poisoned (NaN) when asked;
- a forward waiting on layer ``i`` waits until that layer's share of the transfer is done;
- bad speeds are refused; the plugin installs the link from ``KVFLOW_HOST_LINK_GBPS``.
"""

from __future__ import annotations

import unittest

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as fx  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import FakeClock, init_hicache_direct, real_copies  # noqa: E402

from kvflow_agents.serving.sglang import host_link  # noqa: E402

GBPS = 1e-6   # 1000 bytes per second: easy arithmetic


class HostLinkTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, kv_size=128, max_context_len=256, max_num_reqs=16,
                      num_layers=4, head_num=2, head_dim=8)

    def setUp(self):
        real_copies(self)
        self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        init_hicache_direct(self, self.cache)
        self.clock = FakeClock()
        self.link = host_link.install(GBPS, clock=self.clock, sleep=self.clock.sleep, poison=True)
        self.addCleanup(host_link.uninstall)
        self.cc = self.cache.cache_controller
        self.pool = self._get_full_kv_pool(self.alloc)

    def put_on_host(self, tokens, marker):
        """Cache ``tokens`` with known KV in layer 0, back it up (real copy), drop it from device."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req, idx = self._make_inflight_req(self.cache, self.alloc, self.r2t, tokens)
        self._fill_full_kv(self.alloc, idx, marker)
        req.finished_reason = FINISH_LENGTH(length=1)
        self.cache.checkpoint(req, up_to=len(tokens))
        self.cache.unlock(req.lock)
        req.lock = None
        self.r2t.free(req)
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.assertEqual(self.cache.evictable_size(), 0)

    def demand_load(self, tokens):
        req = self._load_back_through_admission(self.cache, self.r2t, tokens)
        slot = self.cache.ready_to_load_host_cache()
        self.assertGreaterEqual(slot, 0)
        return req, slot

    def device_rows(self, req):
        idx = self.cache.tree_core.collect_full_device_indices(req.best_match_node, self.cache.root_node_handle())
        return self.pool.get_key_buffer(self.pool.start_layer)[idx].float()

    def load_seconds(self, ntokens):
        return ntokens * self.cc.mem_pool_host.size_per_token / (GBPS * 1e9)

    # ------------------------------------------------------------------------------------
    def test_ack_only_after_bytes_over_rate_and_bytes_land_then(self):
        a = list(range(100, 116))
        self.put_on_host(a, 3.0)
        t0 = self.clock()
        req, slot = self.demand_load(a)
        dur = self.load_seconds(16)
        self.assertGreater(dur, 1.0)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 0)
        self.assertTrue(torch.isnan(self.device_rows(req)).all())     # in flight: poisoned
        self.clock.advance(dur * 0.99)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 0)
        self.assertTrue(torch.isnan(self.device_rows(req)).all())
        self.clock.advance(dur * 0.02)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 1)
        self.assertTrue((self.device_rows(req) == 3.0).all())        # landed: the host copy
        self.cache.loading_check()
        self.assertEqual(self.cc.ack_load_queue, [])
        self.assertAlmostEqual(self.clock() - t0, dur * 1.01, places=6)
        snap = self.link.snapshot()
        self.assertEqual(snap["loads"], 1)
        self.assertEqual(snap["bytes"], 16 * self.cc.mem_pool_host.size_per_token)

    def test_loads_queue_on_one_link(self):
        a, b = list(range(100, 116)), list(range(200, 208))
        self.put_on_host(a, 3.0)
        self.put_on_host(b, 5.0)
        self.demand_load(a)
        self.demand_load(b)
        da, db = self.load_seconds(16), self.load_seconds(8)
        self.clock.advance(da + 1e-6)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 1)
        self.clock.advance(db * 0.9)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 1)
        self.clock.advance(db * 0.2)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 2)
        self.assertGreater(self.link.stats["queued_s"], 0)

    def test_forward_layer_wait_blocks_until_that_layer_is_on_device(self):
        a = list(range(100, 116))
        self.put_on_host(a, 7.0)
        t0 = self.clock()
        req, slot = self.demand_load(a)
        dur = self.load_seconds(16)
        counter = self.cc.layer_done_counter
        counter.set_consumer(slot)
        counter.wait_until(0)                     # what get_key_buffer(layer 0) does
        layers = self.cc.transfer_layer_id_max
        self.assertAlmostEqual(self.clock() - t0, dur / layers, places=6)
        self.assertTrue((self.device_rows(req) == 7.0).all())
        counter.wait_until(layers - 1)
        self.assertAlmostEqual(self.clock() - t0, dur, places=6)
        self.assertEqual(self.cache._count_ready_acks(self.cc.ack_load_queue), 1)

    def test_ring_sees_a_load_in_flight(self):
        """SGLang's own check that a slot is free before reuse reads the emulated state."""
        a = list(range(100, 116))
        self.put_on_host(a, 3.0)
        _, slot = self.demand_load(a)
        self.assertFalse(self.cache.is_load_back_event_done(slot))
        self.clock.advance(self.load_seconds(16) + 1e-6)
        self.assertTrue(self.cache.is_load_back_event_done(slot))


def test_bad_speeds_are_refused():
    for bad in (0, -1, float("nan"), float("inf"), "fast"):
        with pytest.raises(host_link.HostLinkError):
            host_link.HostLink(bad)


def test_plugin_installs_the_link_from_the_environment(monkeypatch):
    monkeypatch.setenv(host_link.ENV_GBPS, "0.5")
    try:
        link = host_link.install_from_env()
        assert link is host_link.current() and link.gbps == 0.5
        with pytest.raises(host_link.HostLinkError):
            host_link.install(2.0)                    # one link per process
        assert host_link.install(0.5) is link         # idempotent
    finally:
        host_link.uninstall()
    monkeypatch.setenv(host_link.ENV_GBPS, "lots")
    with pytest.raises(host_link.HostLinkError, match="not a number"):
        host_link.install_from_env()


def test_launcher_validates_the_flag():
    from kvflow_agents.serving.sglang.launch import build_args

    _, env = build_args(["--model-path", "m", "--kvflow-host-link-gbps", "0.25"])
    assert env["KVFLOW_HOST_LINK_GBPS"] == "0.25"
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit, match="--kvflow-host-link-gbps"):
            build_args(["--model-path", "m", f"--kvflow-host-link-gbps={bad}"])
