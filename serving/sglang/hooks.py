"""Scheduler hooks (installed through SGLang's ``HookRegistry`` by ``plugin.register``).

All of them are no-ops unless the scheduler's tree cache is a :class:`KVFlowRadixCache`, and
the admission one is a no-op while no proactive load is in flight, so a server that receives
no hints schedules exactly as stock SGLang.

- ``after_add_request_to_queue``: hint intake when a request is queued (``custom_params``);
  a re-queued request (retraction, preemption, grammar wait) does not replay its hints.
- ``after_calc_priority`` (``SchedulePolicy.calc_priority``): workflow-ordered admission
  (``KVFLOW_ADMISSION``, default ``workflow``; ``serving/policy/admission.py``). After SGLang's
  own sort, the waiting queue is stable-sorted by the oldest workflow's first arrival (each
  request's key is set when it is first queued, on the rank-agreed clock), so when the batch or
  the pool cannot take every waiting request, workflows run back to back instead of in
  lockstep. SGLang's order stays among a workflow's requests; priority scheduling's priority
  still comes first; a queue with no hinted request is left as SGLang sorted it.
- ``around_add_one_req`` (``PrefillAdder.add_one_req``): status-aware admission. SGLang's
  prefill builder has just matched the request (``init_next_round_input``); if that match runs
  through a node whose proactive load has not landed, the request is skipped for this round
  (``CONTINUE``: the builder goes on with the requests behind it; the request stays queued in
  its place). A load always ends (its ack is reaped every step), so it is never starved.
  Under the ``workflow`` skip scope (``KVFLOW_SKIP_SCOPE``, kvflow's default;
  ``serving/policy/admission.py``) only the skipped request's own workflow's requests and
  requests without hints may go ahead of it: another workflow's are passed over too
  (``CONTINUE``, they keep their places). Around every call it also tells the cache which
  adder is deciding, so a demand load-back weighed in it counts the running batch and the
  round's prefill batch as the requests a recompute would stall (``loads._recompute_stalls``).
- ``around_process_input_requests``: once per loop iteration on every rank: advances the
  plugin's rank-agreed clock (its only collective) and takes :class:`KVFlowControl` messages
  (out-of-band hints, snapshot requests) out of the received batch, applied on every rank.
"""

from __future__ import annotations

import json
import logging

from kvflow_agents.serving.policy.admission import may_overtake

from .messages import KVFlowControl

logger = logging.getLogger(__name__)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
TARGET_ADD = f"{SCHEDULER}._add_request_to_queue"
TARGET_ADMIT = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
TARGET_ORDER = "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority"
TARGET_INPUT = f"{SCHEDULER}.process_input_requests"


def _kvflow_cache(scheduler):
    from .cache import KVFlowRadixCache

    tc = getattr(scheduler, "tree_cache", None)
    return tc if isinstance(tc, KVFlowRadixCache) else None


def after_add_request_to_queue(result, scheduler, req, *args, **kwargs):
    cache = _kvflow_cache(scheduler)
    if cache is not None:
        try:
            cache.kvflow_watch_scheduler(lambda: scheduler.waiting_queue,  # the prefetch reserve
                                         lambda: getattr(scheduler, "running_batch", None))
            hints = cache.kvflow_on_request(req)
            cache.kvflow_admission_key(req, hints)
        except Exception:  # hints are advisory
            logger.exception("kvflow: hint intake failed")
    return None


def after_calc_priority(result, policy, *args, **kwargs):
    waiting_queue = args[0] if args else kwargs.get("waiting_queue")
    cache = _kvflow_cache(policy)
    if cache is not None and waiting_queue:
        try:
            sign = policy.priority_sign if getattr(policy, "enable_priority_scheduling", False) else None
            cache.kvflow_order_queue(waiting_queue, sign)
        except Exception:  # the queue stays in SGLang's order
            logger.exception("kvflow: admission order failed")
    return result


def around_add_one_req(original, adder, req, *args, **kwargs):
    cache = _kvflow_cache(adder)
    if cache is None:
        return original(adder, req, *args, **kwargs)
    with cache.kvflow_prefill_round(adder):  # a demand load weighed now counts the batches
        return _add_one_req(cache, original, adder, req, *args, **kwargs)


def _add_one_req(cache, original, adder, req, *args, **kwargs):
    if not cache.kvflow_has_inflight():
        return original(adder, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    # the workflow of this round's first request skipped for its load (one adder per round)
    held = getattr(adder, "kvflow_held", None)
    workflow = None
    try:
        workflow = cache.kvflow_workflow(req)
        # another workflow's request is passed over untouched (no wait recorded, no load-back)
        passed = held is not None and not may_overtake(cache.skip_scope, held, workflow)
        blocked = not passed and cache.kvflow_blocked(req)
    except Exception:  # never let bookkeeping stop admission
        logger.exception("kvflow: admission check failed")
        blocked = passed = False
    if not (blocked or passed):
        return original(adder, req, *args, **kwargs)
    if blocked:
        cache.kv_stats["blocked_polls"] += 1
        if held is None and workflow is not None:
            adder.kvflow_held = workflow
    else:
        cache.kv_stats["held_for_workflow"] += 1
    _undo_match_side_effects(cache, req)
    return AddReqResult.CONTINUE


def _undo_match_side_effects(cache, req) -> None:
    """What SGLang's builder does for a request its adder did not take: the match may have
    staged Mamba copy-on-write state or taken a Mamba slot (hybrid models only)."""
    kv = getattr(req, "kv", None)
    if kv is None:
        return
    if getattr(kv, "mamba_cow_src_index", None) is not None:
        kv.mamba_cow_src_index = None
    if getattr(kv, "mamba_needs_clear", False):
        kv.mamba_needs_clear = False
    if getattr(kv, "holds_mamba", False) and not getattr(req, "session", None):
        pool = getattr(getattr(cache, "req_to_token_pool", None), "mamba_allocator", None)
        if pool is not None and getattr(kv, "mamba_pool_idx", None) is not None:
            pool.free(kv.mamba_pool_idx.unsqueeze(-1))
            kv.mamba_pool_idx = None


def around_process_input_requests(original, scheduler, recv_reqs, *args, **kwargs):
    cache = _kvflow_cache(scheduler)
    if cache is not None:
        try:
            cache.kvflow_step()
        except Exception:
            logger.exception("kvflow: clock step failed")
    if recv_reqs and any(isinstance(r, KVFlowControl) for r in recv_reqs):
        ours = [r for r in recv_reqs if isinstance(r, KVFlowControl)]
        recv_reqs = [r for r in recv_reqs if not isinstance(r, KVFlowControl)]
        for msg in ours:
            try:
                handle_control(scheduler, msg)
            except Exception:
                logger.exception("kvflow: control message %s failed", msg.kind)
    return original(scheduler, recv_reqs, *args, **kwargs)


def handle_control(scheduler, msg: KVFlowControl) -> None:
    cache = _kvflow_cache(scheduler)
    if msg.kind == "hints":
        if cache is None:
            return
        from kvflow_agents.protocol import HintError, Hints

        try:
            hints = Hints.from_custom_params(msg.payload)
        except HintError:
            cache.kv_stats["hint_errors"] += 1
            return
        if hints is not None:
            cache.kvflow_apply_hints(hints)
    elif msg.kind == "snapshot":
        if not msg.reply_to or _tp_rank(cache) != 0:
            return  # every rank gets the message; one answers
        snap = cache.kvflow_snapshot() if cache is not None else {
            "engine": "sglang", "policy": None,
            "error": "the tree cache is not KVFlowRadixCache (start with --radix-cache-backend kvflow)"}
        from . import host_link

        link = host_link.current()
        snap["host_link"] = link.snapshot() if link is not None else None
        _push_json(msg.reply_to, snap)


def _tp_rank(cache) -> int:
    """This scheduler's TP rank: the cache's TP group when it has one (what its collectives
    use), else SGLang's parallel context (0.5.23's ``Scheduler`` has no ``tp_rank``)."""
    if cache is not None and cache.tp_world_size > 1 and cache.tp_group is not None:
        import torch.distributed as dist

        return dist.get_rank(group=cache.tp_group)
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank or 0)
    except Exception:  # not published (a single process, tests): the only rank
        return 0


def _push_json(address: str, obj) -> None:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.connect(address)
        sock.send(json.dumps(obj, default=str).encode())
    except Exception:
        logger.exception("kvflow: snapshot reply failed")
    finally:
        sock.close()
