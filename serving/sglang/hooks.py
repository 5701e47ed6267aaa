"""Scheduler hooks (installed through SGLang's ``HookRegistry`` by ``plugin.register``).

All three are no-ops unless the scheduler's tree cache is a :class:`KVFlowRadixCache`, and the
status-aware one is a no-op while no proactive load is in flight, so a server that receives no
hints schedules exactly as stock SGLang.

- ``after_add_request_to_queue``: hint intake when a request is queued (``custom_params``).
- ``around_get_new_batch_prefill_raw``: status-aware admission. Requests whose cached prefix
  reaches into a proactive load still in flight are taken out of ``waiting_queue`` for this
  round and put back afterwards in their original order. A load always ends (its ack is reaped
  by ``loading_check`` every step), so a held request is never starved; requests behind it
  are admitted meanwhile.
- ``around_process_input_requests``: takes :class:`KVFlowControl` messages (out-of-band hints,
  snapshot requests) out of the received batch and applies them on every rank.
"""

from __future__ import annotations

import json
import logging

from .messages import KVFlowControl

logger = logging.getLogger(__name__)

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
TARGET_ADD = f"{SCHEDULER}._add_request_to_queue"
TARGET_PREFILL = f"{SCHEDULER}._get_new_batch_prefill_raw"
TARGET_INPUT = f"{SCHEDULER}.process_input_requests"


def _kvflow_cache(scheduler):
    from .cache import KVFlowRadixCache

    tc = getattr(scheduler, "tree_cache", None)
    return tc if isinstance(tc, KVFlowRadixCache) else None


def after_add_request_to_queue(result, scheduler, req, *args, **kwargs):
    cache = _kvflow_cache(scheduler)
    if cache is not None:
        try:
            cache.kvflow_watch_queue(lambda: scheduler.waiting_queue)  # the prefetch reserve
            cache.kvflow_on_request(req)
        except Exception:  # hints are advisory
            logger.exception("kvflow: hint intake failed")
    return None


def around_get_new_batch_prefill_raw(original, scheduler, *args, **kwargs):
    cache = _kvflow_cache(scheduler)
    if cache is None or not cache.kvflow_has_inflight():
        return original(scheduler, *args, **kwargs)
    queue = scheduler.waiting_queue
    held = [r for r in queue if cache.kvflow_blocked(r)]
    if not held:
        return original(scheduler, *args, **kwargs)
    cache.kv_stats["blocked_polls"] += len(held)
    order = list(queue)
    held_ids = {id(r) for r in held}
    scheduler.waiting_queue = [r for r in queue if id(r) not in held_ids]
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        # The original may reassign or reorder waiting_queue; keep what it left, restore the
        # held requests, original order first, then anything it appended.
        remaining = scheduler.waiting_queue
        keep = {id(r) for r in remaining} | held_ids
        known = {id(r) for r in order}
        merged = [r for r in order if id(r) in keep]
        merged.extend(r for r in remaining if id(r) not in known)
        if isinstance(remaining, list):
            remaining[:] = merged
            scheduler.waiting_queue = remaining
        else:
            scheduler.waiting_queue = merged


def around_process_input_requests(original, scheduler, recv_reqs, *args, **kwargs):
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
        if getattr(scheduler, "tp_rank", 0) != 0 or not msg.reply_to:
            return
        snap = cache.kvflow_snapshot() if cache is not None else {
            "engine": "sglang", "policy": None,
            "error": "the tree cache is not KVFlowRadixCache (start with --radix-cache-backend kvflow)"}
        _push_json(msg.reply_to, snap)


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
