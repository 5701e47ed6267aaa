"""Plugin registration and the scheduler hooks.

- the entry point registers the backend, the policy choice and wraps SGLang's Scheduler;
- status-aware admission: requests on a prefix still loading stay queued, order preserved,
  admitted once the load's ack is reaped (never starved), others admitted meanwhile;
- control messages (out-of-band hints) are applied and taken out of the request batch.
"""

from __future__ import annotations

import unittest
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402
from sgl_helpers import hints, run_request  # noqa: E402

from kvflow_agents.serving.sglang import hooks  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402
from kvflow_agents.serving.sglang.messages import KVFlowControl  # noqa: E402


def seq(base, n):
    return list(range(base, base + n))


def test_entry_point_registers_backend_policy_and_hooks():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvflow") == "kvflow_agents.serving.sglang.plugin:register"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    assert "kvflow" in registered_radix_cache_backends()
    assert "kvflow" in RADIX_EVICTION_POLICY_CHOICES
    assert type(get_eviction_strategy("kvflow")).__name__ == "KVFlowStrategy"
    for name in ("_add_request_to_queue", "_get_new_batch_prefill_raw", "process_input_requests"):
        assert hasattr(getattr(Scheduler, name), "__wrapped__"), name
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache",
                                "--radix-cache-backend", "kvflow",
                                "--radix-eviction-policy", "kvflow"])
    assert args.radix_cache_backend == "kvflow" and args.radix_eviction_policy == "kvflow"


def test_backend_factory_builds_kvflow_cache_on_python_core():
    from kvflow_agents.serving.sglang.plugin import kvflow_cache_factory

    cfg = CacheConfig(page_size=4)
    _, _, _ = fx.build_fixture(cfg)  # sets SGLang's global server args for the pools
    cache0, alloc, r2t = fx.build_fixture(cfg)
    params = cache0.cache_init_params
    params.tree_core_backend = "rust"
    params.eviction_policy_config = {"max_prefetch": 1}  # --radix-eviction-policy-config JSON
    ctx = SimpleNamespace(server_args=None, params=params, is_hybrid_swa=False,
                          is_hybrid_ssm=False, enable_hierarchical_cache=False,
                          disable_radix_cache=False, tp_worker=None, full_tokens_per_layer=None)
    with mock.patch.dict("os.environ", {"KVFLOW_LOOKAHEAD": "2"}):
        cache = kvflow_cache_factory(ctx)
    assert isinstance(cache, KVFlowRadixCache) and cache.lookahead == 2
    assert cache.max_inflight_prefetch == 1
    assert cache._tree_core_backend == "python" and cache.kv_strategy_bound


class AdmissionTest(UnifiedRadixCacheFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow", kv_size=128, max_context_len=256,
                      max_num_reqs=32)

    def setUp(self):
        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        self._init_hicache(self.cache)
        self.a = seq(1000, 16)
        run_request(self, self.cache, self.alloc, self.r2t, self.a,
                    hints("wf", "A", {"A": 1}, fixed_tokens=16))
        self._backup_tree(self.cache)
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        self.assertEqual(self.cache.kvflow_prefetch(), [("wf", "A")])  # A now in flight

    def queued(self, toks):
        req, _ = self._make_inflight_req(self.cache, self.alloc, self.r2t, toks)
        return req

    def test_status_aware_skip_keeps_order_and_never_starves(self):
        r1 = self.queued(seq(5000, 8))
        r2 = self.queued(self.a + seq(6000, 8))   # on A's loading prefix
        r3 = self.queued(seq(7000, 8))
        r4 = self.queued(self.a + seq(8000, 8))   # on A's loading prefix
        sched = SimpleNamespace(tree_cache=self.cache, waiting_queue=[r1, r2, r3, r4])
        seen = []

        def prefill(s, *args, **kwargs):  # stands for SGLang's builder: admits the head
            seen.append(list(s.waiting_queue))
            admitted = s.waiting_queue[0] if s.waiting_queue else None
            s.waiting_queue = [r for r in s.waiting_queue if r is not admitted]
            return admitted

        out = hooks.around_get_new_batch_prefill_raw(prefill, sched, None, None)
        self.assertIs(out, r1)
        self.assertEqual(seen[-1], [r1, r3])                  # the builder never saw r2, r4
        self.assertEqual(sched.waiting_queue, [r2, r3, r4])   # back, in arrival order
        out = hooks.around_get_new_batch_prefill_raw(prefill, sched, None, None)
        self.assertIs(out, r3)                                # ready ones keep going
        self.assertEqual(sched.waiting_queue, [r2, r4])
        # the load lands (the ack is reaped at the next scheduler step)
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.check_hicache_events()
        self.assertFalse(self.cache.kvflow_has_inflight())
        out = hooks.around_get_new_batch_prefill_raw(prefill, sched, None, None)
        self.assertIs(out, r2)                                # not starved, still first
        self.assertEqual(sched.waiting_queue, [r4])

    def test_no_inflight_load_means_builder_untouched(self):
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.loading_check()
        q = [self.queued(self.a + seq(6000, 8)), self.queued(seq(7000, 8))]
        sched = SimpleNamespace(tree_cache=self.cache, waiting_queue=q)
        original = mock.Mock(return_value="batch")
        self.assertEqual(hooks.around_get_new_batch_prefill_raw(original, sched, 1, 2), "batch")
        original.assert_called_once_with(sched, 1, 2)
        self.assertIs(sched.waiting_queue, q)


def test_control_messages_applied_on_scheduler_and_removed_from_batch():
    cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, _, _ = fx.build_fixture(cfg)
    sched = SimpleNamespace(tree_cache=cache, tp_rank=0)
    original = mock.Mock()
    other = object()
    msg = KVFlowControl("hints", hints("wf", "tool", {"A": 2, "B": None}))
    hooks.around_process_input_requests(original, sched, [other, msg])
    original.assert_called_once_with(sched, [other])
    assert cache.kv_hints.ste("wf", "A") == 2 and cache.kv_hints.ste("wf", "B") == float("inf")
    hooks.around_process_input_requests(original, sched, [KVFlowControl("hints", {"kvflow_v": 9})])
    assert cache.kv_stats["hint_errors"] == 1
    hooks.around_process_input_requests(
        original, sched, [KVFlowControl("hints", {"kvflow_v": 1, "kvflow_workflow": "wf",
                                                  "kvflow_agent": "tool", "kvflow_event": "end"})])
    assert "wf" not in cache.kv_hints.workflows


def test_control_message_survives_sglang_ipc_encoding():
    """Both of SGLang's IPC encodings (pickle, the default, and msgpack): sent the way the
    HTTP endpoint sends it, received the way the scheduler receives it."""
    import zmq
    from sglang.srt.managers import io_struct

    msg = KVFlowControl("hints", hints("wf", "A", {"A": 1}))
    ctx = zmq.Context.instance()
    for use_pickle in (True, False):
        with mock.patch.object(io_struct, "_USE_PICKLE_IPC", use_pickle):
            a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
            addr = f"inproc://kvflow-ipc-{use_pickle}"
            a.bind(addr)
            b.connect(addr)
            try:
                io_struct.sock_send(a, io_struct.wrap_as_pickle(msg))
                back = io_struct.sock_recv(b)
            finally:
                a.close(linger=0)
                b.close(linger=0)
        assert isinstance(back, KVFlowControl) and back.payload == msg.payload, use_pickle


def test_snapshot_reply_over_zmq():
    import json

    import zmq

    cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, _, _ = fx.build_fixture(cfg)
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        hooks.handle_control(SimpleNamespace(tree_cache=cache, tp_rank=0),
                             KVFlowControl("snapshot", {}, f"tcp://127.0.0.1:{port}"))
        assert pull.poll(3000)
        snap = json.loads(pull.recv())
    finally:
        pull.close(linger=0)
    assert snap["engine"] == "sglang" and snap["policy"] == "kvflow"
