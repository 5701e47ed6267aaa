"""Helpers for the SGLang plugin tests (imported by the test modules of this folder)."""

from __future__ import annotations

from array import array


def seq(base, n):
    """``n`` consecutive token ids from ``base`` (a distinct, recognisable prompt)."""
    return list(range(base, base + n))


def hints(workflow, agent, ste, *, step=0, fixed_tokens=None, app=None, nxt=()):
    cp = {"kvflow_v": 1, "kvflow_workflow": workflow, "kvflow_agent": agent,
          "kvflow_step": step, "kvflow_ste": dict(ste), "kvflow_next": list(nxt)}
    if app:
        cp["kvflow_app"] = app
    if fixed_tokens is not None:
        cp["kvflow_fixed_prefix_tokens"] = fixed_tokens
    return cp


def run_request(t, cache, allocator, r2t, tokens, custom_params=None, *, unlock=True,
                extra_key=None):
    """What the scheduler does for one request, with SGLang's real Req and cache calls:
    queue (hint intake) -> KV in the request's own slots -> checkpoint into the tree ->
    release the request's lock. ``t`` is a kit fixture mixin instance; ``extra_key``: the
    request's tree namespace (a LoRA id / cache salt)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req, _ = t._make_inflight_req(cache, allocator, r2t, tokens)
    req.extra_key = extra_key
    if custom_params is not None:
        req.sampling_params.custom_params = custom_params
    if hasattr(cache, "kvflow_on_request"):
        cache.kvflow_on_request(req)
    req.finished_reason = FINISH_LENGTH(length=1)
    cache.checkpoint(req, up_to=len(tokens))
    if unlock:
        cache.unlock(req.lock)
        req.lock = None
    r2t.free(req)
    return req


def key(tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


class FakeClock:
    """A clock for the emulated host link: ``sleep`` advances it instead of waiting."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t
        self.slept = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, d: float) -> None:
        self.t += d
        self.slept += d

    def advance(self, d: float) -> None:
        self.t += d


def real_copies(test):
    """Use SGLang's own host<->device copy code for the rest of ``test`` (a TestCase): the
    direct io backend with the torch ``transfer_kv_direct`` of the CPU shims."""
    import sys
    from pathlib import Path
    from unittest import mock

    import sglang.srt.mem_cache.l2_transfer as l2
    import sglang.srt.mem_cache.pool_host.mha as mha

    support = str(Path(__file__).resolve().parent / "support")
    if support not in sys.path:
        sys.path.insert(0, support)
    import sglang_shims

    for p in (mock.patch.object(l2.L2TransferEngine, "submit_host_to_device",
                                l2.L2TransferEngine.real_submit_host_to_device),
              mock.patch.object(l2.L2TransferEngine, "submit_device_to_host",
                                l2.L2TransferEngine.real_submit_device_to_host),
              mock.patch.object(mha, "transfer_kv_direct", sglang_shims.transfer_kv_direct,
                                create=True)):
        p.start()
        test.addCleanup(p.stop)


def init_hicache_direct(test, cache, *, write_policy: str = "write_through"):
    """The kit's ``_init_hicache`` with the direct io backend and layer_first host layout (the
    combination that has a torch copy path)."""
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin

    sa = ServerArgs(model_path="dummy", page_size=test.cfg.page_size, hicache_io_backend="direct",
                    hicache_mem_layout="layer_first", hicache_write_policy=write_policy)
    sa._mamba_cache_chunk_size = max(CHUNK_SIZE, test.cfg.page_size)
    set_global_server_args_for_scheduler(sa)
    cache.init_hicache(sa, cache.cache_init_params)
    test.addCleanup(drop_hicache_atexit_pin, cache)
    test.addCleanup(cache.release_host_resources)
    cache.write_through_threshold = 1 << 30
    cache.load_back_threshold = 0


class KVFlowHiCacheSetup:
    """Mixin for ``UnifiedRadixCacheFixtures`` test cases: ``self.cache`` is a
    :class:`KVFlowRadixCache` built by SGLang's test kit (``cfg``) with SGLang's real HiCache
    controller and host pool attached; ``ack_all()`` reaps the finished load-backs."""

    def setUp(self):
        from unittest import mock

        import sglang.test.kits.unified_radix_cache.fixtures as fx

        from kvflow_agents.serving.sglang.cache import KVFlowRadixCache

        with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
            self.cache, self.alloc, self.r2t = fx.build_fixture(self.cfg)
        self._init_hicache(self.cache)

    def ack_all(self):
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.loading_check()


class ClockedKVFlowHiCacheSetup(KVFlowHiCacheSetup):
    """:class:`KVFlowHiCacheSetup` with the plugin's clock in the test's hand: ``self.clock[0]``
    (seconds) is what the cache reads as wall time (leases, loads, tool-gap plans)."""

    def setUp(self):
        super().setUp()
        self.clock = [1000.0]
        self.cache._local_clock = lambda: self.clock[0]


def matched(test, cache, tokens):
    """A queued request right after SGLang's own match of it (``init_next_round_input`` in the
    prefill builder): ``last_node``, ``prefix_len``, host hit... set from ``match_prefix`` with
    the key SGLang builds (EAGLE trees: bigrams)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    req = test._make_req(test.r2t)
    req.origin_input_ids = array("q", tokens)
    m = cache.match_prefix(MatchPrefixParams(
        key=RadixKey(array("q", tokens), is_bigram=cache.tree_core.is_eagle), req=req))
    test._apply_match_to_req(req, m)
    return req
