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
from sgl_helpers import hints, matched, run_request, seq  # noqa: E402

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.sglang import hooks  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402
from kvflow_agents.serving.sglang.messages import KVFlowControl  # noqa: E402


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
    for name in ("_add_request_to_queue", "process_input_requests"):
        assert hasattr(getattr(Scheduler, name), "__wrapped__"), name
    from sglang.srt.managers.schedule_policy import PrefillAdder

    assert hasattr(PrefillAdder.add_one_req, "__wrapped__")
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
    with mock.patch.dict("os.environ", {"KVFLOW_LOOKAHEAD": "2", "KVFLOW_BUSY_LOOKAHEAD": "1"}):
        cache = kvflow_cache_factory(ctx)
    assert isinstance(cache, KVFlowRadixCache) and cache.lookahead == 2
    assert cache.busy_lookahead == 1 and cache.kv_prefetcher.planner.busy_lookahead == 1
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

    def build_prefill(self, queue, budget=1):
        """SGLang's prefill builder, in outline: for each queued request, match it
        (``init_next_round_input``), then offer it to the adder; CONTINUE goes on, anything
        else stops. The stand-in adder takes up to ``budget`` requests. Returns the taken ones;
        ``queue`` keeps the others in order (SGLang removes only the admitted ones)."""
        from sglang.srt.managers.schedule_policy import AddReqResult

        adder = SimpleNamespace(tree_cache=self.cache, can_run_list=[])

        def add_one_req(adder, req, **kw):
            if len(adder.can_run_list) >= budget:
                return AddReqResult.OTHER
            adder.can_run_list.append(req)
            return AddReqResult.CONTINUE

        for i, req in enumerate(queue):
            rid, queue[i] = req.rid, matched(self, self.cache, list(req.origin_input_ids))
            req = queue[i]
            req.rid = rid  # the same request matched again (its hints stay its own)
            if hooks.around_add_one_req(add_one_req, adder, req) != AddReqResult.CONTINUE:
                break
        queue[:] = [r for r in queue if r not in adder.can_run_list]
        return adder.can_run_list

    def test_status_aware_skip_keeps_order_and_never_starves(self):
        ids = lambda r: [tuple(x.origin_input_ids) for x in r]  # noqa: E731
        r1, r2, r3, r4 = (matched(self, self.cache, t) for t in (
            seq(5000, 8), self.a + seq(6000, 8), seq(7000, 8), self.a + seq(8000, 8)))
        queue = [r1, r2, r3, r4]          # r2, r4 are on A's loading prefix
        self.assertEqual(ids(self.build_prefill(queue)), ids([r1]))
        self.assertEqual(ids(queue), ids([r2, r3, r4]))          # held in place
        self.assertEqual(ids(self.build_prefill(queue)), ids([r3]))   # ready ones keep going
        self.assertEqual(ids(queue), ids([r2, r4]))
        self.assertGreaterEqual(self.cache.kv_stats["blocked_polls"], 3)
        # the load lands (the ack is reaped at the next scheduler step)
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.check_hicache_events()
        self.assertFalse(self.cache.kvflow_has_inflight())
        self.assertEqual(ids(self.build_prefill(queue, budget=2)), ids([r2, r4]))  # not starved

    def queued(self, tokens, workflow=None, agent="X"):
        """A request queued with hints (SGLang's intake hook reads them), then matched."""
        req = matched(self, self.cache, tokens)
        if workflow is not None:
            req.sampling_params.custom_params = hints(workflow, agent, {agent: 0}, step=1)
            self.cache.kvflow_on_request(req)
        return req

    def test_skip_scope_workflow_lets_only_the_loading_requests_workflow_ahead(self):
        ids = lambda r: [tuple(x.origin_input_ids) for x in r]  # noqa: E731
        for scope, want in (("all", [1, 2, 3]), ("workflow", [1, 3])):
            with self.subTest(scope=scope):
                self.cache.skip_scope = scope
                queue = [self.queued(self.a + seq(6000, 8), "wf", "A"),  # on A's loading prefix
                         self.queued(seq(7000, 8), "wf", "B"),           # its workflow's sibling
                         self.queued(seq(8000, 8), "other", "X"),        # another workflow
                         self.queued(seq(9000, 8))]                      # no hints
                before = self.cache.kv_stats["held_for_workflow"]
                expected = [queue[i] for i in want]
                self.assertEqual(ids(self.build_prefill(queue, budget=4)), ids(expected))
                self.assertEqual(self.cache.kv_stats["held_for_workflow"] - before,
                                 1 if scope == "workflow" else 0)

    def test_no_inflight_load_means_adder_untouched(self):
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.loading_check()
        req = matched(self, self.cache, self.a + seq(6000, 8))
        adder = SimpleNamespace(tree_cache=self.cache)
        original = mock.Mock(return_value="added")
        self.assertEqual(hooks.around_add_one_req(original, adder, req, has_chunked_req=False),
                         "added")
        original.assert_called_once_with(adder, req, has_chunked_req=False)


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


def test_requeued_or_older_step_hints_do_not_move_the_workflow_back():
    """SGLang queues a retracted / preempted request again through _add_request_to_queue: its
    hints were taken already. A request whose hint is older than the workflow's latest step
    (the workflow moved on) is superseded. Both still get their fixed prefix tagged."""
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, alloc, r2t = fx.build_fixture(kit.cfg)
    sched = SimpleNamespace(tree_cache=cache, waiting_queue=[])
    r1, _ = kit._make_inflight_req(cache, alloc, r2t, seq(100, 16))
    r1.sampling_params.custom_params = hints("wf", "A", {"A": 0, "B": 1}, step=1)
    hooks.after_add_request_to_queue(None, sched, r1)
    cache.kvflow_apply_hints(Hints(workflow="wf", agent="B", step=2, ste={"B": 0, "A": 3}))
    hooks.after_add_request_to_queue(None, sched, r1, is_retracted=True)   # the re-queue
    assert cache.kv_hints.workflows["wf"].step == 2
    assert (cache.kv_hints.ste("wf", "A"), cache.kv_hints.ste("wf", "B")) == (3, 0)
    assert cache.kv_stats["requeued"] == 1
    r2, _ = kit._make_inflight_req(cache, alloc, r2t, seq(200, 16))     # a late step-1 request
    r2.sampling_params.custom_params = hints("wf", "C", {"C": 0, "B": 1}, step=1)
    hooks.after_add_request_to_queue(None, sched, r2)
    assert cache.kv_hints.ste("wf", "B") == 0 and cache.kv_stats["stale_hints"] == 1
    assert cache._req_hints[r1.rid].tag == ("wf", "A") and cache._req_hints[r2.rid].tag == ("wf", "C")
