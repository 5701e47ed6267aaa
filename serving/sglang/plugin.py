"""SGLang plugin entry point: ``[project.entry-points."sglang.srt.plugins"] kvflow = ...:register``.

SGLang calls :func:`register` in every process it starts (HTTP/main, scheduler per rank,
detokenizer) through ``sglang.srt.plugins.load_plugins()``, then applies the hooks. It:

1. adds ``kvflow`` to SGLang's eviction-policy table and ``--radix-eviction-policy`` choices;
2. registers the radix-cache backend ``kvflow`` (``--radix-cache-backend kvflow``): a
   :class:`KVFlowRadixCache` built by SGLang's own ``create_unified_radix_cache`` (which also
   attaches HiCache when ``--enable-hierarchical-cache`` is on), on the Python TreeCore;
3. hooks the scheduler (hint intake, status-aware prefill, control messages) and the HTTP
   server (``/kvflow/v1/hints``, ``/kvflow/v1/cache``, chat-template fixed-prefix length).

The hooks act only when the cache is a ``KVFlowRadixCache``; installed but not selected, the
plugin changes nothing. Tunables come from the environment (the launcher sets them):
``KVFLOW_LOOKAHEAD`` (steps, default 1), ``KVFLOW_LEASE_S`` (60), ``KVFLOW_MAX_PREFETCH`` (2),
``KVFLOW_ADMISSION`` (``workflow`` or ``fcfs``: the waiting queue's order, ``hooks.py``),
``KVFLOW_SKIP_SCOPE`` (``all`` or ``workflow``: who may go ahead of a request whose prefix is
loading, ``hooks.py``),
``KVFLOW_HOST_LINK_GBPS`` (an emulated host link under every HiCache copy; ``host_link.py``).
"""

from __future__ import annotations

import logging
import os

from kvflow_agents.serving.policy import KVFlowPolicy
from kvflow_agents.serving.policy.admission import check_admission, check_skip_scope

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvflow"
_registered = False


def _env_num(name: str, cast, default):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return cast(raw)
    except ValueError:
        logger.warning("kvflow: ignoring %s=%r", name, raw)
        return default


def cache_options() -> dict:
    return {
        "lookahead": _env_num("KVFLOW_LOOKAHEAD", float, 1.0),
        "busy_lookahead": _env_num("KVFLOW_BUSY_LOOKAHEAD", float, None),
        "lease_s": _env_num("KVFLOW_LEASE_S", float, 60.0),
        "max_inflight_prefetch": _env_num("KVFLOW_MAX_PREFETCH", int, 2),
        "admission": _env_num("KVFLOW_ADMISSION", check_admission, "workflow"),
        "skip_scope": _env_num("KVFLOW_SKIP_SCOPE", check_skip_scope, KVFlowPolicy.skip_scope),
    }


def kvflow_cache_factory(ctx):
    """``--radix-cache-backend kvflow``: SGLang's unified radix cache with our class."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    from .cache import KVFlowRadixCache

    params = ctx.params
    params.tree_core_backend = "python"  # the Rust TreeCore rejects custom eviction policies
    if (params.eviction_policy or "lru").lower() == "lru":
        params.eviction_policy = "kvflow"  # the backend implies the policy unless set otherwise
    if not ctx.enable_hierarchical_cache:
        logger.warning("kvflow: --enable-hierarchical-cache is off: no host tier, so no "
                       "prefetch; STE still orders eviction")
    opts = cache_options()

    class _Configured(KVFlowRadixCache):
        lookahead = opts["lookahead"]
        busy_lookahead = opts["busy_lookahead"]
        lease_s = opts["lease_s"]
        max_inflight_prefetch = opts["max_inflight_prefetch"]
        admission = opts["admission"]
        skip_scope = opts["skip_scope"]

    _Configured.__name__ = _Configured.__qualname__ = "KVFlowRadixCache"
    return create_unified_radix_cache(ctx, cache_class=_Configured)


def _install_host_link() -> None:
    """``KVFLOW_HOST_LINK_GBPS`` (``--kvflow-host-link-gbps``): the emulated host link under
    SGLang's host->device copies, whatever the cache backend (see ``host_link.py``)."""
    from . import host_link

    try:
        host_link.install_from_env()
    except host_link.HostLinkError:
        logger.exception("kvflow: emulated host link NOT installed")
        raise


def register() -> None:
    """Idempotent; safe in every SGLang process."""
    global _registered
    if _registered:
        return
    from sglang.srt.mem_cache.registry import (register_radix_cache_backend,
                                               registered_radix_cache_backends)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks, http_api
    from .strategy import ensure_eviction_policy_registered

    ensure_eviction_policy_registered()
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, kvflow_cache_factory)
    HookRegistry.register(hooks.TARGET_ADD, hooks.after_add_request_to_queue, HookType.AFTER)
    HookRegistry.register(hooks.TARGET_ADMIT, hooks.around_add_one_req, HookType.AROUND)
    HookRegistry.register(hooks.TARGET_ORDER, hooks.after_calc_priority, HookType.AFTER)
    HookRegistry.register(hooks.TARGET_INPUT, hooks.around_process_input_requests,
                          HookType.AROUND)
    HookRegistry.register(http_api.TARGET_LAUNCH, http_api.before_launch_server, HookType.BEFORE)
    HookRegistry.register(http_api.TARGET_CHAT, http_api.after_convert_to_internal_request,
                          HookType.AFTER)
    _install_host_link()
    _registered = True
    logger.info("kvflow: SGLang plugin registered (backend/policy %r)", BACKEND_NAME)
