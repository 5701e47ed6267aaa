"""The conformance suite on SGLang: the trace of ``tests/policy/conformance`` on SGLang's real
``UnifiedRadixCache`` (Python TreeCore, HiCache controller and host pool, real ``Req``) with
the KVFlow plugin, must give what the policy core gives: the same hit counts, the same
eviction order (residency after every request), the same prefetch decisions.

Each request is served the way SGLang's scheduler serves it (one scheduler step per request,
the trace being sequential): hint intake (``_add_request_to_queue`` hook) -> the step's
``check_hicache_events`` (acks, leases, the plugin's prefetch; the copy lands at once here, as
in the other engines' instant-link runs) -> ``Req.init_next_round_input`` (SGLang's prefix match)
-> ``init_load_back`` for a host hit -> lock, allocate the extend tokens (evicting through the
cache), write the request's KV slots -> ``checkpoint`` into the tree -> unlock. HiCache writes
through (every node gets a host copy), like the policy core's ``kvflow`` backup policy.
"""

from __future__ import annotations

import sys
import unittest
from array import array
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt")

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402

from sgl_helpers import KVFlowHiCacheSetup  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy" / "conformance"))
from conformance_trace import (DEVICE_PAGES, FIXED, PAGE, compare, hints, observe,  # noqa: E402
                               run_reference, trace)


class SGLangConformance(KVFlowHiCacheSetup, UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=PAGE, eviction_policy="kvflow", kv_size=DEVICE_PAGES * PAGE,
                      max_context_len=256, max_num_reqs=32)

    def serve(self, r):
        """One request, the way SGLang's scheduler serves it (module doc)."""
        cache, alloc, r2t = self.cache, self.alloc, self.r2t
        tokens = r.tokens
        req = self._make_req(r2t)
        req.origin_input_ids = array("q", tokens)
        req.output_ids = array("q")
        req.full_untruncated_fill_ids = array("q", tokens)
        req.extra_key = None
        req.sampling_params.custom_params = {**hints(r).to_custom_params(),
                                             "kvflow_fixed_prefix_tokens": FIXED}
        cache.kvflow_watch_scheduler(lambda: [req])
        cache.kvflow_on_request(req)
        cache.check_hicache_events()              # the scheduler step: prefetch starts
        self.ack_all()                            # ... and lands (instant link)
        req.init_next_round_input(cache)          # SGLang's own prefix match
        device_hit, host_hit = req.prefix_len, req.host_hit_length
        if host_hit > 0:                          # PrefillAdder: demand load-back
            loaded, last = cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=host_hit, req=req))
            cache.ready_to_load_host_cache()
            self.ack_all()
            req.prefix_len += loaded
            req.last_node = last
        req.kv.cache_protected_len = req.prefix_len
        req.lock = cache.lock(req.last_node)
        prefix = cache.path_device_indices(req.last_node)[:req.prefix_len]
        n_new = len(tokens) - req.prefix_len
        if alloc.available_size() < n_new:
            cache.evict(EvictParams(num_tokens=n_new - alloc.available_size()))
        new = alloc.alloc(n_new)
        assert new is not None, "no device room"
        r2t.write((req.kv.req_pool_idx, slice(0, len(tokens))),
                  torch.cat([prefix.to(new.dtype), new]))
        req.kv.kv_committed_len = req.extend_end = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=1)
        cache.checkpoint(req, up_to=len(tokens))
        cache.unlock(req.lock)
        req.lock = None
        r2t.free(req)
        self._backup_tree(cache)                  # HiCache write-through
        return observe(r, device_hit, host_hit, cache.kvflow_snapshot()["agents"],
                       cache.kv_metrics.prefetch_issued)

    def test_sglang_conforms(self):
        seen = [self.serve(r) for r in trace()]
        self.cache.sanity_check()
        compare("SGLang UnifiedRadixCache", seen, run_reference())
