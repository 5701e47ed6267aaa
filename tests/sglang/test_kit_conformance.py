"""SGLang's unified radix cache test kit (``sglang.test.kits.unified_radix_cache``) with our
cache class plugged in, over every cache configuration the kit defines (Full, Full+SWA,
Full+Mamba, Full+SWA+Mamba; page sizes 1..128).

The kit builds SGLang's real pools and allocators and its inspector TreeCore (the Python
core); ``fixtures.UnifiedRadixCache`` is swapped for :class:`KVFlowRadixCache`. Each config runs
one workload made only of the kit's own steps (chains of single-page extensions, branch
inserts, matches, evictions; with HiCache where the kit supports it: write-back backups,
eviction to host, the scheduler's load-back through admission) twice, on the stock
``UnifiedRadixCache`` and on ours without hints, and the observations must be identical; the
tree's own ``sanity_check`` must hold after every phase. A last phase tags agents on our cache
and checks the tree stays consistent under STE-ordered eviction.
"""

from __future__ import annotations

import unittest
from dataclasses import replace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CONFIGS, supports_hicache  # noqa: E402
from sglang.test.kits.unified_radix_cache.hicache import (  # noqa: E402
    UnifiedRadixCacheHiCacheFixtures)

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402


class Workload(UnifiedRadixCacheHiCacheFixtures):
    """The kit's fixture steps, recorded as observations."""

    def observe(self, cache, obs, label, seqs):
        for i, s in enumerate(seqs):
            m = fx.match_prefix(cache, s)
            obs.append((label, i, m.device_prefix_len, m.host_hit_length))
        obs.append((label, "sizes", cache.evictable_size(), cache.protected_size()))
        cache.sanity_check()

    def run_workload(self, cls, hicache: bool):
        # stock: the kit's config (LRU); ours: the same config with the kvflow policy
        cfg = self.cfg if cls is UnifiedRadixCache else replace(self.cfg, eviction_policy="kvflow")
        with mock.patch.object(fx, "UnifiedRadixCache", cls):
            cache, alloc, r2t = fx.build_fixture(cfg)
        assert type(cache) is cls
        if hicache:
            self._init_hicache(cache, write_policy="write_back")
        obs = []
        chain = self._build_chain_pages(cache, alloc, r2t, 4)
        chain_tokens = self._match_tokens_for_chain(cache, chain)
        seqs = [chain_tokens]
        for i in range(3):  # branches off a shared head, and an unrelated sequence
            s = self._make_seq(1, 2) + self._make_seq(5000 + 1000 * i, i + 1)
            self._insert(cache, alloc, r2t, s)
            seqs.append(s)
        seqs.append(self._make_seq(90000, 2))
        self._insert(cache, alloc, r2t, seqs[-1])
        self.observe(cache, obs, "inserted", seqs)
        ps = self.cfg.page_size
        for n in (ps, 2 * ps):
            r = cache.evict(EvictParams(num_tokens=n))
            obs.append(("evict", n, r.num_tokens_evicted))
            self.observe(cache, obs, f"evicted{n}", seqs)
        if hicache:
            self._backup_tree(cache)
            r = cache.evict(EvictParams(num_tokens=cache.evictable_size()))
            obs.append(("evict-all", r.num_tokens_evicted))
            self.observe(cache, obs, "on-host", seqs)
            self._load_back_through_admission(cache, r2t, seqs[1])
            self._finish_pending_loads(cache)
            self._release_ongoing_load_back_locks(cache)
            self.observe(cache, obs, "loaded", seqs)
        return obs, cache, alloc, r2t

    def test_kit_workload_identical_to_stock_without_hints(self):
        for hicache in (False, True):
            if hicache and not supports_hicache(self.cfg):
                continue
            with self.subTest(hicache=hicache):
                stock, *_ = self.run_workload(UnifiedRadixCache, hicache)
                ours, cache, _, _ = self.run_workload(KVFlowRadixCache, hicache)
                self.assertEqual(stock, ours)
                self.assertEqual(list(cache.kv_index.tags()), [])
                self.assertTrue(cache.kv_strategy_bound)

    def test_kit_tree_consistent_with_tags(self):
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            cache, alloc, r2t = fx.build_fixture(replace(self.cfg, eviction_policy="kvflow"))
        if supports_hicache(self.cfg):
            self._init_hicache(cache, write_policy="write_back")
        ps = self.cfg.page_size
        head = self._make_seq(1, 2)
        agents = {}
        for i, ste in enumerate((0, 2, 5)):
            s = head + self._make_seq(7000 + 1000 * i, 2)
            self._insert(cache, alloc, r2t, s)
            node = fx.match_prefix(cache, s).last_device_node
            agents[f"a{i}"] = (s, cache.tree_core.node_by_id(node), ste)
        for name, (s, node, ste) in agents.items():
            cache.kv_index.set_tag(("wf", name), node, ste)
        cache.kvflow_apply_hints(Hints(workflow="wf", agent="x",
                                       ste={n: v[2] for n, v in agents.items()}))
        cache.evict(EvictParams(num_tokens=2 * ps))
        cache.sanity_check()
        # the largest STE (a2) went first; the most urgent (a0) and a1 kept their device KV
        a0, a1, a2 = (agents[n][1] for n in ("a0", "a1", "a2"))
        self.assertTrue(a2.evicted or cache.tree_core._node_arena.get(a2.id) is not a2)
        self.assertFalse(a0.evicted)
        self.assertFalse(a1.evicted)
        cache.evict(EvictParams(num_tokens=cache.evictable_size()))
        cache.sanity_check()


for _cfg in CONFIGS:
    _name = f"TestKit_{_cfg.label}"
    globals()[_name] = type(_name, (Workload, unittest.TestCase), {"cfg": _cfg})
del _cfg, _name
