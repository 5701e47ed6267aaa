"""``EngineLoop``: the engine thread's side of :class:`~.engine.Engine` (mixed into it).

Invariant: every method here runs on the engine thread (``_run`` and what it calls, and the
commands other threads queue with ``submit`` / ``abort`` / ``update_hints`` / ``call``); it is
the only caller of the cache manager, the model and the pool's load side. It reads the state
``Engine.__init__`` builds (annotated on the class below) and owns none of its own.

One scheduler step: first poll of new arrivals (hit, pin, start on-demand loads of host-only
prefixes, except for a request the skip scope passes over) → ``manager.tick()`` (finish due
loads) → admit ready requests in the policy's admission order (kvflow: the oldest workflow's
call first, ``serving/policy/admission.py``; status-aware: loading ones are skipped, see
``scheduler.py``; the prompt's pages are allocated and ``decode_reserve`` of max_tokens'
reserved at admission, the decode ones allocated as they are written) → start prefetches from
the planner's plan (after admission: with a copy thread its backups queue first) → chunked
prefill (``max_prefill_tokens`` per step, reusing each request's cached device prefix) → one
batched decode over all running requests whose prefill is done.

Cache protocol per request: the policy core's session (``serving/policy/session.py``), as every
engine drives it: ``manager.arrive`` when a request is added (its hints merged), ``poll`` when
first seen by a step (hit counters, pin, start a demand load unless recomputing the host part
is cheaper or the skip scope passes the request over) and while it waits (status-aware: LOADING
is skipped), ``admit`` for its pages, ``commit`` after prefill (insert + tag the fixed prefix),
``finish`` at the end. The engine reports its step time (``observe_step``: a loaded request is
admitted a step later) and, with ``recompute_aware``, its prefill speed (``observe_prefill``:
the recompute estimate).

Failure isolation inside a step (one request never fails another): work on one request (poll,
readiness, admission, prefill, sampling) runs under :meth:`EngineLoop._guard`: an exception
fails that request alone (finish reason ``error``, pages and pins released); a batched decode
or sampling call that raises is retried one sequence at a time, so only the sequence that
fails is failed; ``_run`` catches everything else, and fails the running requests only when
the step keeps failing. The exception to "one request never fails another": a copy that fails
on the pool's copy thread (``--copy-thread``) leaves KV nobody can trust; the next step fails
every request and empties the cache (:meth:`EngineLoop._reset_cache`).

The model side of a step (chunked prefill, the batched decode, decode-page growth and
retraction, deterministic mode) is :class:`~.engine_forward.ForwardSteps`, a base of
:class:`EngineLoop`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvflow_agents.serving.policy import CacheFullError

from .cache_view import engine_cpu_times
from .engine_forward import ForwardSteps
from .scheduler import Completion, Request, RequestState, Scheduler, StreamEvent

if TYPE_CHECKING:  # pragma: no cover
    from kvflow_agents.serving.policy import CachePolicy, KVCacheManager

    from .engine_config import EngineConfig
    from .kv_pool import PagedKVPool
    from .sampling import BatchSampler

log = logging.getLogger("kvflow.engine")


class BatchedSink:
    """A request's sink that the engine does not call per event: a step's events are collected
    per ``outlet`` and handed over with one ``outlet.post([(key, event), ...])`` after the step
    (a hand-off per token wakes the receiver, and takes the GIL from the engine thread, once
    per token per request). ``key`` means what the outlet says: an asyncio queue for a
    :class:`LoopOutlet`, unused by the engine process's pipe (``engine_core.PipeOutlet``)."""

    __slots__ = ("outlet", "key")

    def __init__(self, outlet, key) -> None:
        self.outlet, self.key = outlet, key

    def __call__(self, ev) -> None:  # direct use (outside the engine thread's batching)
        self.outlet.post([(self.key, ev)])


class LoopOutlet:
    """Events to asyncio queues of one event loop: one ``call_soon_threadsafe`` per post. Equal
    (and hashed alike) for the same loop, so one step's events to a loop go in one post."""

    __slots__ = ("loop",)

    def __init__(self, loop) -> None:
        self.loop = loop

    def __eq__(self, other) -> bool:
        return isinstance(other, LoopOutlet) and other.loop is self.loop

    def __hash__(self) -> int:
        return id(self.loop)

    def post(self, items) -> None:
        self.loop.call_soon_threadsafe(deliver_to_queues, items)


def deliver_to_queues(items) -> None:
    """On the event loop: put a step's events on their requests' queues, in order."""
    for q, ev in items:
        q.put_nowait(ev)


class EngineLoop(ForwardSteps):
    """The engine thread's steps and commands (module doc); mixed into :class:`~.engine.Engine`."""

    # built by Engine.__init__
    config: "EngineConfig"
    policy: "CachePolicy"
    manager: "KVCacheManager"
    pool: "PagedKVPool"
    scheduler: Scheduler
    sampler: "BatchSampler"
    model: Any
    tokenizer: Any
    model_name: str
    page_size: int
    counters: dict
    recorder: Any
    _inbox: "queue.SimpleQueue[Callable[[], None]]"
    _requests: dict
    _stop: threading.Event
    _lock: threading.Lock          # guards ``counters`` against the API threads' increments
    _outbox: dict                  # outlet -> [(key, event)] of this step (BatchedSink)
    _snapshot: dict
    _published: float
    _fair_share: bool
    _tenanted: bool
    _cuda: bool

    def _run(self) -> None:
        import torch

        progress, failed_steps = True, 0
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._drain(0.0 if progress else self._idle_timeout())
                    if self._stop.is_set():
                        break
                    progress = self._step()
                    failed_steps = 0
                except Exception:  # noqa: BLE001 - the engine thread must survive anything
                    # Failures a request causes are attributed to it inside the step (see
                    # _fail); one that reaches here is the engine's own. Retry; only when the
                    # step keeps failing are the running requests failed, so the queue moves.
                    log.exception("engine step failed")
                    self.counters["step_failures"] += 1
                    failed_steps += 1
                    progress = False
                    if failed_steps >= 3:
                        for r in list(self.scheduler.running):
                            self._fail(r, "engine step", None)
                        failed_steps = 0
                try:
                    self._flush_outbox()
                    self._publish(force=not progress)
                except Exception:  # noqa: BLE001 - delivery and metrics must not stop the engine
                    log.exception("publishing engine events or stats failed")
        for r in list(self._requests.values()):
            self._finish(r, "abort", error="engine shut down")
        self._flush_outbox()

    def _drain(self, timeout: float) -> None:
        try:
            cmd = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                cmd()
            except Exception:
                log.exception("engine command failed")
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                self._flush_outbox()  # e.g. an abort's final event
                return

    def _idle_timeout(self) -> float:
        """How long to sleep when nothing could run: until the next load lands, or a skipped
        request's load is short enough for its own prefill to hide the rest (or 0.5 s)."""
        nxt = self.manager.next_event_at  # loads landing, tool-gap plans moving
        nxt = nxt() if callable(nxt) else nxt
        now = self.pool.now()
        t = 0.5
        if nxt is not None:  # demand loads and prefetches alike
            t = min(t, nxt - now)
        for req in self.scheduler.waiting:  # a skipped load its own prefill can now hide
            if req.inline_at is not None and req.inline_at > now:
                t = min(t, req.inline_at - now)
        return max(t, 0.0005)

    def _step(self) -> bool:
        t0 = time.perf_counter()
        progress = self._step_once()
        if progress:
            dt = time.perf_counter() - t0
            self.counters["busy_s"] += dt
            self.manager.observe_step(dt)
        return progress

    def _step_once(self) -> bool:
        sched, mgr = self.scheduler, self.manager
        self.counters["steps"] += 1
        if self.pool.copy_failure is not None:
            self._reset_cache()
        progress = False
        # bounded (max_batch deep): polled requests pin their prefix; demand loads go on the
        # link before this step's prefetches, except a passed-over request's (skip scope)
        for req, start_load in sched.first_looks():
            self._guard(req, "cache lookup", req.poll, start_load)
            progress = True
        rep = mgr.tick(self.pool.now(), prefetch=False)  # finish due loads
        progress |= bool(rep.loads_finished)
        if rep.expired_workflows:
            self._update_fair_share()
        for req in sched.admission_plan(self._ready_guarded):
            if self._guard(req, "admission", self._admit, req) is False:
                break
            progress = True
        # Prefetches after admission: a copy thread (--copy-thread) is FIFO, so the backups
        # admission queued (out of the pages this step's prefill writes) go before the
        # prefetch loads. The prefetcher reserves pages for waiting requests either way
        # (manager._session_reserve).
        progress |= bool(mgr.prefetch(self.pool.now()))
        progress |= self._prefill()
        if any(r.decoding for r in sched.running):
            progress |= self._decode()
        return progress

    # -- failure isolation -------------------------------------------------------------------
    # Invariant: an exception raised while working on one request fails that request only
    # (its client gets the error, its pages and pins are released); the batch goes on.
    def _guard(self, req: Request, what: str, fn: Callable, *args) -> Any:
        """``fn(*args)``; if it raises, fail ``req`` alone and return None."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - attributed to this request
            self._fail(req, what, e)
            return None

    def _reset_cache(self) -> None:
        """After a copy failed on the pool's copy thread (``kv_pool``): no KV either tier holds
        can be trusted, and no forward ran since (``wait_copies`` raises). Fail every request
        the engine holds (each may hold or await such KV), then drop every cached prefix
        without copying any of it to host; the engine serves on from an empty cache."""
        exc = self.pool.take_copy_failure()
        self.counters["cache_resets"] += 1
        log.error("a KV copy failed: failing %d requests and resetting the cache",
                  len(self._requests), exc_info=exc)
        for req in list(self._requests.values()):
            self._fail(req, "KV copy", exc)
        self.manager.discard_all()

    def _ready_guarded(self, req: Request) -> bool:
        return bool(self._guard(req, "readiness check", self._is_ready, req))

    def _fail(self, req: Request, what: str, exc: Optional[BaseException]) -> None:
        if req.state is RequestState.FINISHED:
            return
        if exc is not None:
            log.error("%s failed for %s", what, req.rid, exc_info=exc)
        msg = f"{what} failed for this request" + (f" ({type(exc).__name__})" if exc else "")
        try:
            self._finish(req, "error", error=msg)
        except Exception:  # noqa: BLE001 - last resort: forget it, but answer its client
            log.exception("cleaning up %s failed", req.rid)
            self.scheduler.remove(req.rid)
            self._requests.pop(req.rid, None)
            req.state = RequestState.FINISHED
            self.counters["finished"] += 1
            self.counters["errors"] += 1
            self._send(req, StreamEvent(req.rid, "", (), done=Completion(
                id=req.rid, text="", token_ids=list(req.output_ids), finish_reason="error",
                prompt_tokens=len(req.prompt_ids), cached_tokens=0, device_hit_tokens=0,
                host_hit_tokens=0, computed_tokens=0, error=msg)))

    # -- per request ------------------------------------------------------------------------
    def _add(self, req: Request) -> None:
        self._requests[req.rid] = req
        kv_tokens = len(req.prompt_ids) + req.params.max_tokens - 1
        if req.tenant is not None:
            self._tenanted = True
        try:  # merges its hints; reserves its pages (prefetch budget)
            req.session = self.manager.arrive(req.prompt_ids, req.hints, fixed_len=req.fixed_len,
                                              kv_tokens=kv_tokens, client=req.tenant)
        except Exception:  # noqa: BLE001 - hints are advisory: serve the request without them
            log.exception("the hints of %s could not be applied", req.rid)
            req.hints = None
            req.session = self.manager.arrive(req.prompt_ids, None, kv_tokens=kv_tokens)
        self.scheduler.add(req)
        if req.hints is not None:
            self._update_fair_share()

    def _apply_hints(self, h: Any, *, tenant: Optional[str] = None) -> None:
        """Out-of-band hints (a request's own come in with ``manager.arrive``)."""
        if tenant is not None:
            self._tenanted = True
        self.manager.apply_hints(h, client=tenant)
        self._update_fair_share()

    def _update_fair_share(self) -> None:
        """``client_cap="fair"``: each active tenant's hints protect at most device pool / n
        pages (no cap while there is one), so one tenant's flood of urgent hints cannot evict
        the others' prefixes. Untenanted use (no API keys) is never capped."""
        if not (self._fair_share and self._tenanted):
            return
        n = self.manager.tags.hints.active_clients()
        self.manager.set_client_cap(None if n <= 1 else max(1, self.manager.device.capacity // n))

    def _is_ready(self, req: Request) -> bool:
        """Readiness (the scheduler's admission rule): only requests a step has already looked
        at; ready when their prefix is readable, or, while a load on it is in flight, when
        :meth:`_may_load_inline` lets the load overlap the request's own prefill. A wait on a
        load is recorded by the session (hidden/exposed)."""
        if not req.session.looked:
            return False
        if req.poll():
            return True
        if req.state is RequestState.LOADING and self._may_load_inline(req):
            req.load_inline = True
            return True
        return False

    def _may_load_inline(self, req: Request) -> bool:
        """Admit a request whose prefix is still loading, its prefill reading each layer as it
        lands (``EngineConfig.layerwise_load``; SGLang's HiCache loads a batch's prefixes so).
        Without the status-aware skip always, as SGLang's batch does: the step waits on the
        load's layers instead of the request waiting for all of it. With the skip only where
        the load lands within the time the request's own prefill is estimated to take (the
        measured prefill speed; none without ``recompute_aware``), so the step barely waits;
        otherwise it is skipped as before. Not merely when nothing else runs: a longer load
        would hold the engine thread in the prefill, and a request arriving meanwhile, which
        the skip lets run, would wait for it. Never while part of the prefix below what is in
        flight is host-only and not loading yet (a prefetch that took only the head, and the
        session could not queue the rest behind it: no room, or recomputing it is cheaper):
        admitted now, that part would be recomputed, or loaded only if there were room this
        instant; waiting, it is decided once the head lands, as before. A skipped request records when
        its prefill would start hiding the rest (``inline_at``): an idle engine wakes then
        instead of when the load lands, so it overlaps as hicache's does and stays free for
        arrivals until then."""
        p = req.last_poll
        if not self.config.layerwise_load or p is None or p.host_rest:
            return False
        if not self.scheduler.status_aware:
            return True
        req.inline_at = None
        if p.ready_at is None:
            return False
        hide = self.manager.loads.recompute_s(len(req.session.tokens) - p.cached_len, p.cached_len)
        if hide is None:
            return False
        if p.ready_at - self.pool.now() <= hide:
            return True
        req.inline_at = p.ready_at - hide  # an idle engine wakes then (_idle_timeout)
        return False

    def _admit(self, req: Request) -> bool:
        inline, req.load_inline, req.inline_at = req.load_inline, False, None
        try:
            if not req.session.admit(load_inline=inline):
                return False  # wait for running requests to free memory (no overtaking)
        except CacheFullError:
            self._finish(req, "error", error="not enough device KV memory for this request")
            return True
        self._ensure_device_capacity()
        self.scheduler.admitted(req)
        req.prefilled = req.kv_len = req.session.reused
        if req.prefill_at is not None:  # re-admitted after a retraction: sampling state goes on
            return True
        req.prefill_at = time.monotonic()
        import torch
        req.generator = torch.Generator(device="cpu")
        req.generator.manual_seed(req.params.seed if req.params.seed is not None else random.getrandbits(63))
        stop_ids = () if req.params.ignore_eos else None
        req.detok = self.tokenizer.stream(stop=req.params.stop, stop_token_ids=stop_ids)
        return True

    # -- output and finish --------------------------------------------------------------------
    def _emit(self, req: Request, tok: int, lp: Any = None) -> None:
        req.output_ids.append(tok)
        if lp is not None:
            req.logprobs.append(lp)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        text = req.detok.push(tok)
        reason = None
        if req.detok.finished:
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            text += req.detok.finish()
        if text or reason is None:
            self._send(req, StreamEvent(req.rid, text, (tok,), logprobs=(lp,) if lp is not None else ()))
        if reason is not None:
            self._finish(req, reason)

    def _send(self, req: Request, ev: StreamEvent) -> None:
        sink = req.sink
        if type(sink) is BatchedSink:  # collected; _flush_outbox hands them over once per step
            self._outbox.setdefault(sink.outlet, []).append((sink.key, ev))
            return
        try:
            sink(ev)
        except Exception:  # e.g. the client's event loop is gone
            log.debug("sink of %s failed", req.rid, exc_info=True)

    def _flush_outbox(self) -> None:
        """One post per outlet (an event loop, the engine process's pipe) for everything this
        step produced (:class:`BatchedSink`)."""
        if not self._outbox:
            return
        box, self._outbox = self._outbox, {}
        for outlet, items in box.items():
            try:
                outlet.post(items)
            except Exception:  # e.g. the loop is closed: its clients are gone
                log.debug("outlet %r gone; %d stream events dropped", outlet, len(items), exc_info=True)

    def _abort(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is not None:
            self._finish(req, "abort")

    def _finish(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        if req.state is RequestState.FINISHED:
            return
        was_running = req.state is RequestState.RUNNING
        self.scheduler.remove(req.rid)
        self._requests.pop(req.rid, None)
        s = req.session
        if s is not None:  # the tree keeps what was written (not after an error); pages freed
            written = req.kv_len if was_running else 0
            if self.config.deterministic:  # decode-computed KV is not what a prefill would write
                written = min(written, len(req.prompt_ids))
            s.finish(req.prompt_ids + req.output_ids, written, cache=reason != "error")
        req.state = RequestState.FINISHED
        now = time.monotonic()
        text = req.detok.text if req.detok is not None else ""
        comp = Completion(
            id=req.rid, text=text, token_ids=list(req.output_ids), finish_reason=reason,
            prompt_tokens=len(req.prompt_ids), cached_tokens=s.prompt_reused if s else 0,
            device_hit_tokens=s.device_hit if was_running else 0,
            host_hit_tokens=s.host_hit if was_running else 0,
            computed_tokens=len(req.prompt_ids) - s.prompt_reused if was_running else 0,
            queue_s=(req.prefill_at or now) - req.arrival, load_wait_s=s.load_wait_s if s else 0.0,
            ttft_s=(req.first_token_at or now) - req.arrival, latency_s=now - req.arrival, error=error,
            logprobs=list(req.logprobs) if req.params.logprobs else None)
        c = self.counters
        c["finished"] += 1
        c["aborted"] += reason == "abort"
        c["errors"] += reason == "error"
        c["prompt_tokens"] += comp.prompt_tokens
        c["generation_tokens"] += comp.completion_tokens
        c["cached_tokens"] += comp.cached_tokens
        if self.recorder is not None and reason != "abort":
            try:
                fixed = req.fixed_len if req.fixed_len is not None else self._inferred_fixed(req)
                self.recorder.record(req, comp, fixed)
            except Exception:  # a trace is diagnostics: never fail the request for it
                log.exception("could not record request %s", req.rid)
        self._send(req, StreamEvent(req.rid, "", (), done=comp))

    def _inferred_fixed(self, req: Request) -> int:
        """The boundary the cache tagged for this agent (0 when none is known)."""
        h = req.hints
        if h is None:
            return 0
        return self.manager.fixed_prefix_len(h.workflow, h.agent, app=h.app)

    # -- stats ------------------------------------------------------------------------------
    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._published < 0.05:
            return
        self._published = now
        mgr = self.manager
        with self._lock:
            counters = dict(self.counters)
        self._snapshot = {
            "model": self.model_name, "policy": self.policy.name, "page_size": self.page_size,
            "counters": counters, "kv_copies": dict(self.pool.stats), "queue": self.scheduler.counts(),
            "admission_passes": dict(self.scheduler.passes),
            "device_pages": {"capacity": mgr.device.capacity, "used": mgr.device.num_used,
                             "reserved": mgr.decode_reserved, "evictable": mgr.evictable_device_pages},
            "host_pages": {"capacity": mgr.host.capacity, "used": mgr.host.num_used},
            "loads_in_flight": mgr.loads_in_flight, "cache": mgr.metrics.as_dict(),
            "hints": mgr.tags.hints.stats(), "client_cap_pages": mgr.tags.client_cap_pages,
            "cpu": engine_cpu_times(),  # (on the engine thread: its own CPU, and its process's)
        }
