"""Tool gaps in the SGLang plugin (``serving/policy/toolgap.py`` over SGLang's tree), on SGLang's
real UnifiedRadixCache + HiCache controller + host pool (only the copy itself is stood in).

A tool hint (``kvflow_tool_s = {agent: seconds}``) gives the waiting agent's whole last turn a
resume tag: kept above the dynamic suffixes other requests left (hold, STE 2) while the tool
runs, brought back from host in time for the resume (near, STE 1), dropped when the agent's
next request arrives, when the tool is far slower than measured, or when the workflow ends.
"""

from __future__ import annotations

import math
import unittest
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import ClockedKVFlowHiCacheSetup, hints, key, run_request, seq  # noqa: E402

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.policy.toolgap import RESUME  # noqa: E402

TAG = ("wf", "A" + RESUME)


class ToolGapTest(ClockedKVFlowHiCacheSetup, UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow", kv_size=128, max_context_len=256,
                      max_num_reqs=32)

    def setUp(self):
        super().setUp()
        # agent A's turn: fixed prompt 16, its dynamic part 8, what it generated 8
        self.turn = seq(1000, 16) + seq(5000, 8) + seq(6000, 8)
        run_request(self, self.cache, self.alloc, self.r2t, self.turn,
                    hints("wf", "A", {"A": 0, "T": 1}, fixed_tokens=16))

    def tool_starts(self, secs):
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=1, ste={"T": 0, "A": 1},
                                            event="transition", tool_s={"A": secs}))

    def device_len(self, tokens):
        return self.cache.match_prefix(MatchPrefixParams(key=key(tokens))).device_prefix_len

    def ste(self):
        return self.cache.kv_book.effective_ste(TAG)

    def test_resume_tag_keeps_the_whole_last_turn_then_brings_it_back_in_time(self):
        self.tool_starts(2.0)
        node = self.cache.kv_book.agent_node("wf", "A" + RESUME)
        self.assertIsNotNone(node)
        self.assertEqual(self.ste(), 2)                          # hold while the tool runs
        # other requests leave untagged suffixes; eviction takes them, not A's last turn
        for i in range(4):
            run_request(self, self.cache, self.alloc, self.r2t, seq(20000 + 100 * i, 16))
        self.cache.evict(EvictParams(num_tokens=64))
        self.assertEqual(self.device_len(self.turn), len(self.turn))
        for i in range(4):
            self.assertEqual(self.device_len(seq(20000 + 100 * i, 16)), 0)
        # all of it to host (e.g. a long tool and a busy server); the plan brings it back
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.assertEqual(self.device_len(self.turn), 0)
        self.cache.check_hicache_events()   # A (STE 1) is next: its fixed prefix comes back
        self.ack_all()
        self.assertEqual(self.device_len(self.turn), 16)          # the last turn's tail: not yet
        self.assertFalse(self.cache.kvflow_has_inflight())
        self.clock[0] += 1.96                     # resume_at - lead (a 4-page load: ~0 here)
        self.cache.check_hicache_events()
        self.assertEqual(self.ste(), 1)
        self.assertTrue(self.cache.kvflow_has_inflight())
        self.ack_all()
        self.assertEqual(self.device_len(self.turn), len(self.turn))
        # the agent's next request reads it (SGLang's match at admission credits the prefetches)
        self.clock[0] += 0.1
        reader, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t, self.turn)
        self.cache.match_prefix(MatchPrefixParams(key=key(self.turn), req=reader))
        self.assertEqual(self.cache.kv_metrics.prefetch_used, 2)   # A's prefix, then its turn
        # and closes the gap: its own request pins the path now; that request extended A's
        # last turn, so when it finishes A's new turn is kept at A's own STE (a turn gap)
        run_request(self, self.cache, self.alloc, self.r2t, self.turn + seq(7000, 4),
                    hints("wf", "A", {"A": 0, "T": 1}, step=2, fixed_tokens=16))
        self.assertEqual((self.cache.kv_gaps.opened, self.cache.kv_gaps.closed_by_request), (1, 1))
        self.assertEqual([g.kind for g in self.cache.kv_gaps.open_gaps("wf", "A")], ["turn"])
        self.assertEqual(self.ste(), 0)

    def test_an_agent_that_extends_its_last_turn_keeps_it_without_a_tool_hint(self):
        """A turn gap (no tool): A's next prompt extends its last turn past the fixed prompt,
        so A is learned; from then on its finished turn is tagged at A's own STE and outlives
        the untagged suffixes other requests leave."""
        second = self.turn + seq(7000, 4)
        run_request(self, self.cache, self.alloc, self.r2t, second,
                    hints("wf", "A", {"A": 0, "T": 1}, step=1, fixed_tokens=16))
        self.assertEqual([g.kind for g in self.cache.kv_gaps.open_gaps("wf", "A")], ["turn"])
        self.assertEqual(self.cache.kv_book.records[TAG].tokens, tuple(second))
        self.assertEqual(self.ste(), 0)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=2, ste={"T": 0, "A": 1},
                                            event="transition"))
        self.cache.check_hicache_events()                          # the gap follows A's STE
        self.assertEqual(self.ste(), 1)
        for i in range(4):
            run_request(self, self.cache, self.alloc, self.r2t, seq(20000 + 100 * i, 16))
        self.cache.evict(EvictParams(num_tokens=64))
        self.assertEqual(self.device_len(second), len(second))
        for i in range(4):
            self.assertEqual(self.device_len(seq(20000 + 100 * i, 16)), 0)

    def test_no_turn_gap_while_another_request_of_the_agent_is_in_flight(self):
        """T5: parallel instances under one agent name (a fan-out) open no turn gap until the
        last one ends."""
        second = self.turn + seq(7000, 4)
        run_request(self, self.cache, self.alloc, self.r2t, second,
                    hints("wf", "A", {"A": 0, "T": 1}, step=1, fixed_tokens=16))
        self.assertTrue(self.cache.kv_gaps.open_gaps("wf", "A"))   # learned, alone: a gap
        sibling, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t, second + seq(8000, 4))
        sibling.sampling_params.custom_params = hints("wf", "A", {"A": 0}, step=2, fixed_tokens=16)
        self.cache.kvflow_on_request(sibling)                      # queued, in flight
        run_request(self, self.cache, self.alloc, self.r2t, second + seq(7100, 4),
                    hints("wf", "A", {"A": 0}, step=3, fixed_tokens=16))
        self.assertFalse(self.cache.kv_gaps.open_gaps("wf", "A"))

    def test_parallel_instances_each_keep_their_own_turn(self):
        """T6: two instances of A (a fan-out) each call a tool; each tool hint keeps the turn
        of the instance that just finished, under a resume tag of its own, and one
        instance's resumed request closes its own gap only."""
        self.tool_starts(2.0)                                      # instance 1's tool
        other = seq(1000, 16) + seq(5100, 8) + seq(6100, 8)        # instance 2, same fixed part
        run_request(self, self.cache, self.alloc, self.r2t, other,
                    hints("wf", "A", {"A": 0, "T": 1}, step=1, fixed_tokens=16))
        self.tool_starts(2.0)                                      # instance 2's tool
        gaps = self.cache.kv_gaps.open_gaps("wf", "A")
        self.assertEqual([g.tag_agent for g in gaps], ["A" + RESUME, "A" + RESUME + "2"])
        self.assertEqual({self.cache.kv_book.records[("wf", g.tag_agent)].tokens for g in gaps},
                         {tuple(self.turn), tuple(other)})
        for i in range(4):                                         # others' untagged suffixes
            run_request(self, self.cache, self.alloc, self.r2t, seq(20000 + 100 * i, 16))
        self.cache.evict(EvictParams(num_tokens=64))
        self.assertEqual(self.device_len(self.turn), len(self.turn))
        self.assertEqual(self.device_len(other), len(other))
        run_request(self, self.cache, self.alloc, self.r2t, self.turn + seq(7000, 4),
                    hints("wf", "A", {"A": 0, "T": 1}, step=2, fixed_tokens=16))
        self.assertEqual(self.cache.kv_gaps.closed_by_request, 1)  # instance 1's, not 2's
        self.assertIn("tool", [g.kind for g in self.cache.kv_gaps.open_gaps("wf", "A")])
        self.assertEqual(self.cache.kv_book.records[("wf", "A" + RESUME + "2")].tokens, tuple(other))

    def test_an_agent_not_learned_loses_its_dynamic_part_first(self):
        """The control: one turn only, nothing learned; A's dynamic part is +inf like the
        others' suffixes, and the oldest goes first."""
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=2, ste={"T": 0, "A": 1},
                                            event="transition"))
        self.cache.check_hicache_events()
        self.assertFalse(self.cache.kv_gaps.gaps)
        for i in range(4):
            run_request(self, self.cache, self.alloc, self.r2t, seq(20000 + 100 * i, 16))
        self.cache.evict(EvictParams(num_tokens=64))
        self.assertEqual(self.device_len(self.turn), 16)           # its fixed prefix only

    def test_a_tool_far_slower_than_measured_releases_the_tag(self):
        self.tool_starts(0.5)
        self.assertEqual(self.ste(), 2)
        self.clock[0] += 2 * 0.5 + 1.0 + 0.01                     # past 2 x expected + grace
        self.cache.check_hicache_events()
        self.assertEqual(self.ste(), math.inf)
        self.assertEqual(self.cache.kv_gaps.expired, 1)

    def test_the_workflows_end_drops_its_gaps_and_no_tool_hint_changes_nothing(self):
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=1, ste={"T": 0, "A": 1},
                                            event="transition"))
        self.assertIsNone(self.cache.kv_book.agent_node("wf", "A" + RESUME))
        self.assertFalse(self.cache.kv_gaps.gaps)
        self.tool_starts(2.0)
        self.assertTrue(self.cache.kv_gaps.gaps)
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=2, ste={}, event="end"))
        self.assertFalse(self.cache.kv_gaps.gaps)
        self.assertEqual(self.ste(), math.inf)


class ToolGapNamespaceTest(ClockedKVFlowHiCacheSetup, UnifiedRadixCacheFixtures, unittest.TestCase):
    """A LoRA adapter's (or a cache salt's) request lives under its own key in SGLang's tree:
    its resume tag goes on that path, not on another namespace's identical tokens."""
    cfg = ToolGapTest.cfg

    def test_the_resume_tag_follows_the_requests_namespace(self):
        turn = seq(1000, 16) + seq(5000, 8) + seq(6000, 8)
        run_request(self, self.cache, self.alloc, self.r2t, turn)   # the base model's copy
        run_request(self, self.cache, self.alloc, self.r2t, turn,
                    hints("wf", "A", {"A": 0, "T": 1}, fixed_tokens=16), extra_key="lora-7")
        self.cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", step=1, ste={"T": 0, "A": 1},
                                            event="transition", tool_s={"A": 2.0}))
        node = self.cache.kv_book.agent_node("wf", "A" + RESUME)
        self.assertIsNotNone(node)
        self.assertEqual(node.key.extra_key, "lora-7")
        on_path = self.cache.match_prefix(MatchPrefixParams(
            key=self.cache._radix_key(turn, "lora-7", None))).last_device_node
        self.assertEqual(on_path, node.id)     # the whole turn, on the adapter's path


def test_resume_tag_covers_what_sglang_cached_of_the_turn():
    """The tokens a finished request hands the gap bookkeeping are SGLang's own record of it
    (``full_untruncated_fill_ids`` up to the checkpoint): the tag's node ends there."""
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
    import sglang.test.kits.unified_radix_cache.fixtures as fx

    from kvflow_agents.serving.sglang.cache import KVFlowRadixCache

    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, alloc, r2t = fx.build_fixture(kit.cfg)
    turn = seq(300, 16) + seq(400, 10)  # 26 tokens: the tag is page-aligned down to 24
    run_request(kit, cache, alloc, r2t, turn, hints("wf", "A", {"A": 0}, fixed_tokens=16))
    assert [t.tokens for t in cache.kv_gaps.last[("wf", "A")]] == [tuple(turn)]
    cache.kvflow_apply_hints(Hints(workflow="wf", agent="T", ste={"T": 0, "A": 1}, tool_s={"A": 1.0}))
    assert cache.kv_book.agent_node("wf", "A" + RESUME) is not None
    assert cache.kv_book.records[TAG].tokens == tuple(turn[:24])
    assert cache.match_prefix(MatchPrefixParams(key=key(turn))).device_prefix_len == 24
