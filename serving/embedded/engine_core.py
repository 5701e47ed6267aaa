"""The engine in its own process (``kvflow serve --engine-process``), vLLM v1's EngineCore split.

In one process the engine thread and the HTTP side (event loop, request preparation) share one
GIL: the engine thread waits for every CPU second the others run (~11 % of its time with 8
concurrent workflows, bench/RESULTS.md §6.36). Here the child process owns the
:class:`~.engine.Engine` (model, scheduler, KV cache, detokenization); the HTTP process keeps
parsing, tokenization and validation (:class:`~.request_builder.RequestBuilder` over its own
copy of the tokenizer) and talks to it through one pipe.

:class:`EngineCoreClient` has the surface ``server.py``, ``worker_api.py`` and ``metrics_prom.py``
use (:class:`~.engine.EngineAPI`'s calls, ``stats``, ``update_hints``, ``note_hints``,
``describe``, ``alive``/``started``, ``config``, ``tokenizer``, ``policy``, ``model_name``).

Messages (pickled tuples on a duplex ``multiprocessing`` pipe):

- HTTP → engine: ``("submit", rid, prompt_ids, params, hints, tenant, fixed_len, arrival)``,
  ``("abort", rid)``, ``("hints", hints, tenant)``, ``("call", cid, fn)`` (``fn`` a module-level
  function or a partial of one), ``("stop",)``;
- engine → HTTP: ``("ready", describe())`` or ``("failed", message)`` once, then
  ``("events", [StreamEvent, ...])`` once per engine step (:class:`PipeOutlet`, the same
  per-step batching as an event loop gets), ``("stats", snapshot)`` when the engine publishes
  one (at most every 50 ms while busy), ``("result", cid, ok, value)``.

Invariants:
- a request's events reach its sink in order, and exactly one carries ``done``: when the engine
  process exits (crash, kill, shutdown) every request in flight gets a ``done`` with
  ``finish_reason="error"`` and every pending call raises :class:`EngineProcessGone`, so no
  client waits for ever; ``alive`` turns False (``/health`` 503);
- ``arrival`` is the HTTP process's ``time.monotonic()`` (one clock for every process on a
  host), so queue and TTFT figures include the hand-off;
- hint counters (``note_hints``) are the HTTP side's and merged into ``stats()``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from typing import Any, Callable, Optional

from .engine import Engine, EngineAPI, EngineConfig
from .engine_loop import BatchedSink
from .request_builder import RequestBuilder
from .scheduler import Completion, Request, StreamEvent

log = logging.getLogger("kvflow.engine_core")

READY_TIMEOUT_S = 600.0  # loading a model (and converting a GGUF once) can take minutes


class EngineProcessGone(RuntimeError):
    """The engine process exited: nothing more can be served by this client."""


# ================================================================== the engine's process
class PipeOutlet:
    """Where the engine process's :class:`BatchedSink` events go: one pipe message per step."""

    __slots__ = ("send",)

    def __init__(self, send: Callable[[tuple], None]) -> None:
        self.send = send

    def post(self, items) -> None:
        self.send(("events", [ev for _, ev in items]))


class _CoreEngine(Engine):
    """An :class:`Engine` whose published snapshots also go to the HTTP process."""

    def __init__(self, config: EngineConfig, send: Callable[[tuple], None]) -> None:
        self._send_up = send  # set first: Engine.__init__ publishes once
        super().__init__(config)

    def _publish(self, force: bool = False) -> None:
        before = self._snapshot
        super()._publish(force)
        if self._snapshot is not before:
            self._send_up(("stats", self._snapshot))


def _serve(config: EngineConfig, conn, log_level: Optional[str]) -> None:
    """The engine process's main: build the engine, then apply the HTTP process's messages
    until it says stop or goes away."""
    import signal

    # Ctrl-C, and a SIGTERM to the process group (ServeProcess.stop), are the HTTP process's:
    # it drains, then says stop; if it dies instead, the pipe's EOF ends this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if log_level:
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    lock = threading.Lock()

    def send(msg: tuple) -> None:  # the engine thread and this one both send
        with lock:
            conn.send(msg)
    try:
        engine = _CoreEngine(config, send)
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, which raises it
        send(("failed", f"{type(e).__name__}: {e}"))
        return
    outlet = PipeOutlet(send)
    send(("ready", engine.describe()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the HTTP process is gone
                break
            op = msg[0]
            if op == "submit":
                _submit(engine, outlet, msg)
            elif op == "abort":
                engine.abort(msg[1])
            elif op == "hints":
                engine.update_hints(msg[1], tenant=msg[2])
            elif op == "call":
                _call(engine, send, msg[1], msg[2])
            elif op == "stop":
                break
    finally:
        engine.shutdown()


def _submit(engine: Engine, outlet: PipeOutlet, msg: tuple) -> None:
    _, rid, ids, params, hints, tenant, fixed_len, arrival = msg
    try:  # the HTTP side compiled it already (validation); here it comes from xgrammar's cache
        grammar = engine.grammar.compile(params.grammar) if params.grammar is not None else None
    except Exception as e:  # noqa: BLE001 - fail this request, not the process
        outlet.post([(None, StreamEvent(rid, done=_error_completion(rid, f"grammar: {e}")))])
        return
    engine.submit(Request(ids, params, BatchedSink(outlet, None), hints=hints, tenant=tenant,
                          fixed_len=fixed_len, grammar=grammar, rid=rid, arrival=arrival))


def _call(engine: Engine, send, cid: int, fn) -> None:
    def reply(fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        try:
            send(("result", cid, exc is None, fut.result() if exc is None else exc))
        except Exception as e:  # noqa: BLE001 - a value or exception that does not pickle
            send(("result", cid, False, RuntimeError(f"engine call result not sendable: {e!r}")))
    engine._call_future(fn).add_done_callback(reply)


def _error_completion(rid: str, error: str) -> Completion:
    return Completion(id=rid, text="", token_ids=[], finish_reason="error", prompt_tokens=0,
                      cached_tokens=0, device_hit_tokens=0, host_hit_tokens=0, computed_tokens=0,
                      error=error)


# ================================================================== the HTTP process's side
class EngineCoreClient(EngineAPI):
    """An :class:`Engine` in a spawned process, with the same calls (module doc).

    ``EngineCoreClient(config, log_level=None)`` loads the tokenizer here, starts the process
    and returns once the engine is ready (raises ``RuntimeError`` with the engine's error if it
    could not start)."""

    def __init__(self, config: Optional[EngineConfig] = None, *, log_level: Optional[str] = None,
                 **overrides) -> None:
        import dataclasses

        from .grammar import GrammarBackend
        from .model import load_tokenizer

        cfg = dataclasses.replace(config or EngineConfig(), **overrides)
        cfg.validate()
        self.config = cfg
        t0 = time.perf_counter()
        # first, so a GGUF is converted here once, not raced by the engine process
        self.tokenizer, self.model_config = load_tokenizer(cfg.model_path or cfg.model, cfg.dtype)
        ctx = multiprocessing.get_context("spawn")  # a fork would copy the threads' locks
        self._conn, child = ctx.Pipe(duplex=True)
        self._snapshot: dict = {}
        self._proc = ctx.Process(target=_serve, args=(cfg, child, log_level), name="kvflow-engine-core",
                                 daemon=True)
        self._proc.start()
        child.close()
        info = self._wait_ready()
        self.info = info
        self.load_s = time.perf_counter() - t0
        self.model_name = info["model_name"]
        from kvflow_agents.serving.policy import get_policy
        self.policy = get_policy(cfg.policy, **({"backup": cfg.backup} if cfg.backup else {}))
        self.grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size)
        self.requests = RequestBuilder(tokenizer=self.tokenizer, model_config=self.model_config,
                                       config=cfg, grammar=self.grammar,
                                       capacity_tokens=lambda: info["capacity_tokens"])
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sinks: dict[str, Any] = {}      # rid -> sink of a request in flight
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._cids = itertools.count()
        self._hint_counts = {"hints_accepted": 0, "hints_rejected": 0}
        self._gone: Optional[str] = None       # why the engine process is gone
        self._reader = threading.Thread(target=self._read, name="kvflow-engine-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(0.2):
                try:
                    msg = self._conn.recv()
                except EOFError:
                    break
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "stats":  # the engine publishes once while it starts
                    self._snapshot = msg[1]
                if msg[0] == "failed":
                    self._proc.join(5)
                    raise RuntimeError(f"the engine process could not start: {msg[1]}")
            elif not self._proc.is_alive():
                break
        self._proc.kill()
        raise RuntimeError(f"the engine process exited before it was ready (exit code {self._proc.exitcode})")

    # -------------------------------------------------------------- the four primitives
    def make_request(self, **kw) -> Request:
        """Tokenize and validate here, as :meth:`Engine.make_request` (same keywords)."""
        return self.requests.build(**kw)

    def submit(self, req: Request) -> str:
        with self._lock:
            gone = self._gone
            if gone is None:
                self._sinks[req.rid] = req.sink
        if gone is not None:
            _deliver(req.sink, StreamEvent(req.rid, done=_error_completion(req.rid, gone)))
            return req.rid
        self._send(("submit", req.rid, req.prompt_ids, req.params, req.hints, req.tenant,
                    req.fixed_len, req.arrival))
        return req.rid

    def abort(self, rid: str) -> None:
        self._send(("abort", rid))
        with self._lock:  # its last events are not waited for
            self._sinks.pop(rid, None)

    def _call_future(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._cids)
        with self._lock:
            if self._gone is not None:
                fut.set_exception(EngineProcessGone(self._gone))
                return fut
            self._calls[cid] = fut
        try:
            self._send(("call", cid, fn))
        except Exception as e:  # noqa: BLE001 - e.g. a lambda (does not pickle: use a module
            # function or a partial of one)
            with self._lock:
                self._calls.pop(cid, None)
            fut.set_exception(e)
        return fut

    # -------------------------------------------------------------- the rest of the surface
    def update_hints(self, hints: Any, tenant: Optional[str] = None) -> None:
        self._send(("hints", hints, tenant))

    def note_hints(self, accepted: bool) -> None:
        with self._lock:
            self._hint_counts["hints_accepted" if accepted else "hints_rejected"] += 1

    def stats(self) -> dict:
        """The engine's latest published snapshot, with this side's hint counters."""
        snap = self._snapshot
        if not snap:
            return snap
        with self._lock:
            counts = dict(self._hint_counts)
        return {**snap, "counters": {**snap.get("counters", {}), **counts}}

    def describe(self) -> dict:
        return dict(self.info)

    @property
    def alive(self) -> bool:
        return self._gone is None and self._proc.is_alive()

    @property
    def started(self) -> bool:
        return True  # ready before __init__ returned

    @property
    def capacity_tokens(self) -> Optional[int]:
        return self.info["capacity_tokens"]

    def shutdown(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._conn.close()

    def __enter__(self) -> "EngineCoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -------------------------------------------------------------- the pipe
    def _send(self, msg: tuple) -> None:
        """Send, or (the pipe broken: the engine process is gone) fail every waiter at once;
        the message's own waiter was registered first."""
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:  # BrokenPipeError; ValueError: closed here
            self._close(f"the engine process is gone ({type(e).__name__})")

    def _read(self) -> None:
        """The reader thread: events to their sinks (one post per event loop and message),
        results to their futures, snapshots kept; on EOF every waiter is told."""
        conn = self._conn
        try:
            while True:
                msg = conn.recv()
                op = msg[0]
                if op == "events":
                    self._dispatch(msg[1])
                elif op == "stats":
                    self._snapshot = msg[1]
                elif op == "result":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None and fut.set_running_or_notify_cancel():
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(msg[3])
        except (EOFError, OSError):
            # EOF comes as the process dies, a moment before it can be reaped: wait that
            # moment, or a killed process reads as alive ("stopped answering"), its exit code lost
            self._proc.join(2.0)
        except Exception:  # noqa: BLE001 - a message this side cannot read: treat as gone
            log.exception("engine process pipe failed")
        self._close(f"the engine process exited (exit code {self._proc.exitcode})"
                    if not self._proc.is_alive() else "the engine process stopped answering")

    def _dispatch(self, events: list) -> None:
        pairs = []
        sinks = self._sinks
        for ev in events:
            if ev.done is not None:
                with self._lock:
                    sink = sinks.pop(ev.rid, None)
            else:
                sink = sinks.get(ev.rid)
            if sink is not None:  # None: aborted here before its events came back
                pairs.append((sink, ev))
        _hand_over(pairs)

    def _close(self, why: str) -> None:
        with self._lock:
            if self._gone is None:
                self._gone = why
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        if sinks:
            log.error("%s; failing %d request(s) in flight", why, len(sinks))
        _hand_over([(sink, StreamEvent(rid, done=_error_completion(rid, why))) for rid, sink in sinks.items()])
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineProcessGone(why))


def _hand_over(pairs: list) -> None:
    """``(sink, event)`` pairs to their sinks: batched sinks with one post per outlet (event
    loop), in order; others called."""
    box: dict = {}
    for sink, ev in pairs:
        if type(sink) is BatchedSink:
            box.setdefault(sink.outlet, []).append((sink.key, ev))
        else:
            _deliver(sink, ev)
    for outlet, items in box.items():
        try:
            outlet.post(items)
        except Exception:  # noqa: BLE001 - the loop is closed: its clients are gone
            log.debug("outlet %r gone; %d stream events dropped", outlet, len(items))


def _deliver(sink, ev: StreamEvent) -> None:
    try:
        sink(ev)
    except Exception:  # noqa: BLE001 - a sink's failure is its caller's
        log.debug("sink of %s failed", ev.rid, exc_info=True)
