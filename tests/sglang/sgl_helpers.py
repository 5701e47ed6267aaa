"""Helpers for the SGLang plugin tests (imported by the test modules of this folder)."""

from __future__ import annotations

from array import array


def hints(workflow, agent, ste, *, step=0, fixed_tokens=None, app=None, nxt=()):
    cp = {"kvflow_v": 1, "kvflow_workflow": workflow, "kvflow_agent": agent,
          "kvflow_step": step, "kvflow_ste": dict(ste), "kvflow_next": list(nxt)}
    if app:
        cp["kvflow_app"] = app
    if fixed_tokens is not None:
        cp["kvflow_fixed_prefix_tokens"] = fixed_tokens
    return cp


def run_request(t, cache, allocator, r2t, tokens, custom_params=None, *, unlock=True):
    """What the scheduler does for one request, with SGLang's real Req and cache calls:
    queue (hint intake) -> KV in the request's own slots -> checkpoint into the tree ->
    release the request's lock. ``t`` is a kit fixture mixin instance."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req, _ = t._make_inflight_req(cache, allocator, r2t, tokens)
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
