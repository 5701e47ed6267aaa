"""``Engine``: the embedded KVFlow engine as an in-process Python object (like SGLang's ``Engine``
or vLLM's ``LLM``). The HTTP server (``server.py``) wraps it; benchmarks drive it directly.

    from kvflow_agents.serving.embedded.engine import Engine
    with Engine(model="tiny-random", policy="kvflow", device_tokens=4096) as eng:
        out = eng.chat([{"role": "user", "content": "hi"}], max_tokens=8)
        print(out.text, out.cached_tokens)

Public API (thread-safe): ``Engine(config=None, *, loaded=None, **EngineConfig fields)``;
``chat(messages, hints=None, **sampling) -> Completion`` and ``generate(prompt | ids, ...)``
(blocking); ``make_request(...)`` + ``async for ev in stream(req)`` (streaming, asyncio);
``submit(req)`` / ``abort(rid)`` (sink-based); ``update_hints(Hints)`` (out-of-band, incl.
``event="end"``); ``cache_report()`` (what ``/kvflow/v1/cache`` shows); ``stats()`` (non-blocking
snapshot for metrics); ``call(fn)`` (run ``fn(engine)`` on the engine thread); ``shutdown()``.
Sampling keywords: ``max_tokens, temperature, top_p, stop, seed, ignore_eos``, penalties,
``logit_bias``, ``logprobs``/``top_logprobs``, ``grammar`` (a ``grammar.GrammarSpec``: JSON schema,
tool-call structural tag...); ``chat(..., tools=[...])`` renders OpenAI tools into the prompt.
Logits go through ``sampling.BatchSampler`` (one call per prefill/decode step).

It owns the model, the tokenizer, the paged KV pools (:class:`~.kv_pool.PagedKVPool`, which is
the policy core's ``KVTransferBackend``) and a :class:`~kvflow_agents.serving.policy.KVCacheManager`.

Threading invariants:
- exactly one engine thread does all model work and is the only caller of the cache manager
  (on 2 CPU cores a second compute thread only slows decode down); on CPU, loads and backups
  are copied by the pool's one copy thread (a GPU's copy engine) when torch leaves a core free
  (``torch_threads``), else inline, and a forward waits only for the copies touching the pages
  it reads or writes (``pool.wait_copies``);
- other threads talk to it through a command queue: :meth:`submit`, :meth:`abort`,
  :meth:`update_hints`, :meth:`call`; results come back through a per-request sink called on
  the engine thread, or, for a :class:`~.engine_loop.BatchedSink` (``stream``: asyncio queues;
  the engine process's pipe), collected and handed over once per step;
- :meth:`stats` reads a snapshot the engine thread publishes, so /metrics never blocks a step.

Failure isolation (one request never fails another):
- :meth:`make_request` validates everything the engine would fail on (sampling values, the seed's
  range, token ids, sizes: a prompt over ``max_prompt_tokens`` is refused from its length or a
  bounded probe before it is fully tokenized), on the caller's thread, before submission;
- inside a step, an exception while working on one request fails that request alone
  (:mod:`.engine_loop`).

Tenants: ``make_request(tenant=)`` / ``update_hints(hints, tenant)`` make the tenant the hints'
*client* in the policy core; with ``client_cap="fair"`` each active tenant's hints protect at most
device pool / active tenants (no cap while one tenant is active).

With ``host_link_gbps`` the pool *emulates* a GPU's host link: a load's bytes are copied at real
speed in the background but its pages only become usable at ``start + bytes / (X GB/s)``; this
exists to demonstrate prefetch/overlap on machines without a GPU.

The engine thread's side (one scheduler step, the cache protocol per request, failure
isolation inside a step) is :class:`~.engine_loop.EngineLoop`, which ``Engine`` inherits, with
its model side (prefill, decode, retraction, deterministic mode) in
:class:`~.engine_forward.ForwardSteps`. The calls written over ``make_request`` / ``submit`` /
``abort`` / ``_call_future`` (``generate``, ``chat``, ``stream``, ``call``, ``acall``, ``cache_report``) are
:class:`EngineAPI`'s, shared with :class:`~.engine_core.EngineCoreClient`, the same engine in a
process of its own (``kvflow serve --engine-process``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from .engine_config import EngineConfig, EngineInputError, client_cap_pages, params_from_kwargs
from .engine_loop import BatchedSink, EngineLoop, LoopOutlet
from .request_builder import RequestBuilder
from .scheduler import Completion, Request, SamplingParams, Scheduler, StreamEvent

__all__ = ["Engine", "EngineConfig", "EngineInputError", "Completion", "StreamEvent", "SamplingParams"]


class EngineAPI:
    """The public calls both engines share, written once over what each provides: a
    ``requests`` builder, ``make_request``, ``submit`` (the request's sink gets its events),
    ``abort`` and ``_call_future`` (run ``fn(engine)`` on the engine thread). :class:`Engine` runs in this
    process; :class:`~.engine_core.EngineCoreClient` talks to one in its own process."""

    def call(self, fn: Callable[["Engine"], Any], timeout: Optional[float] = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return self._call_future(fn).result(timeout)

    async def acall(self, fn: Callable[["Engine"], Any]) -> Any:
        return await asyncio.wrap_future(self._call_future(fn))

    def generate(self, prompt: "str | Sequence[int]", *, hints: Any = None, timeout: Optional[float] = None,
                 **sampling) -> Completion:
        """Blocking completion of a raw prompt (text or token ids)."""
        kw = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}
        return self._blocking(kw, hints, timeout, sampling)

    def chat(self, messages: Sequence[dict], *, hints: Any = None, timeout: Optional[float] = None,
             tools: Optional[Sequence[dict]] = None, **sampling) -> Completion:
        """Blocking chat completion (the model's chat template is applied, with ``tools``)."""
        return self._blocking({"messages": messages, "tools": tools}, hints, timeout, sampling)

    def _blocking(self, kw: dict, hints, timeout, sampling: dict) -> Completion:
        done = threading.Event()
        box: list[Completion] = []

        def sink(ev: StreamEvent) -> None:
            if ev.done is not None:
                box.append(ev.done)
                done.set()
        req = self.make_request(**kw, params=params_from_kwargs(sampling), hints=hints, sink=sink)
        self.submit(req)
        if not done.wait(timeout):
            self.abort(req.rid)
            raise TimeoutError(f"request {req.rid} did not finish in {timeout} s")
        return box[0]

    async def stream(self, req: Request) -> AsyncIterator[StreamEvent]:
        """Submit ``req`` (built by :meth:`make_request`; its sink is replaced) and yield its
        events. Leaving the iteration early (client gone) aborts the request and frees its pages."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req.sink = BatchedSink(LoopOutlet(loop), q)  # one hand-off per loop per engine step
        self.submit(req)
        finished = False
        try:
            while True:
                ev = await q.get()
                if ev.done is not None:
                    finished = True
                yield ev
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req.rid)

    def cache_report(self, timeout: Optional[float] = 30.0) -> dict:
        from .cache_view import cache_report
        return self.call(cache_report, timeout)

    # Both engines tokenize and validate in the caller's process, with a RequestBuilder of their own.
    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted (:attr:`RequestBuilder.max_prompt_tokens`)."""
        return self.requests.max_prompt_tokens

    @property
    def max_prompt_chars(self) -> int:
        """Prompt text longer than this is over ``max_prompt_tokens`` whatever it says."""
        return self.requests.max_prompt_chars


class Engine(EngineAPI, EngineLoop):
    """See the module docstring. Thread-safe public methods; ``generate``/``chat`` block."""

    def __init__(self, config: Optional[EngineConfig] = None, *, start: bool = True,
                 loaded: Optional[tuple] = None, **overrides) -> None:
        """``loaded`` = ``(model, tokenizer, model_config)`` from ``load_model`` to share weights
        between engines (tests, side-by-side benchmarks); else the model is loaded here."""
        import torch

        from kvflow_agents.serving.policy import KVCacheManager, get_policy

        from .kv_pool import PagedKVPool
        from .malloc_tuning import malloc_pinned, pin_malloc_thresholds
        from .model import load_model

        cfg = dataclasses.replace(config or EngineConfig(), **overrides)
        cfg.validate()
        self.config = cfg
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        self.malloc_pinned = pin_malloc_thresholds() if cfg.pin_malloc else malloc_pinned()
        t0 = time.perf_counter()
        self.model, self.tokenizer, self.model_config = loaded or load_model(
            cfg.model_path or cfg.model, cfg.device, cfg.dtype)
        self.load_s = time.perf_counter() - t0
        self.model_name = cfg.served_model_name or self.model_config.name
        self.policy = get_policy(cfg.policy, **({"backup": cfg.backup} if cfg.backup else {}))
        ps = cfg.page_size
        dev_pages = cfg.device_tokens // ps
        host_pages = cfg.host_tokens // ps if self.policy.host_tier else 0
        self.pool = PagedKVPool(self.model_config, device_pages=dev_pages, host_pages=host_pages,
                                page_size=ps, device=cfg.device, host_link_gbps=cfg.host_link_gbps,
                                copy_thread=cfg.copy_thread)
        self.manager = KVCacheManager(
            self.policy, page_size=ps, device_pages=dev_pages, host_pages=host_pages,
            backend=self.pool, lookahead=cfg.lookahead, max_inflight_loads=cfg.max_inflight_loads,
            lease_s=cfg.lease_s, bytes_per_page=self.pool.bytes_per_page,
            link_bytes_per_s=cfg.host_link_gbps * 1e9 if cfg.host_link_gbps else None,
            reserve_window=2 * cfg.max_batch,  # prefetch never takes what queued work needs
            admission=cfg.admission, partial_eviction=cfg.partial_eviction,
            lazy_decode=cfg.lazy_decode_pages,
            decode_reserve=cfg.decode_reserve,
            reuse_align=cfg.deterministic_chunk if cfg.deterministic else 1,
            turn_gaps=cfg.turn_gaps, busy_lookahead=cfg.busy_lookahead,
            fill_link_cap=cfg.fill_link_cap,
            # a recompute delays every running request's next step (loads.recompute_cost_s)
            recompute_stalls=lambda: len(self.scheduler.running))
        status_aware = self.policy.status_aware if cfg.status_aware is None else cfg.status_aware
        self.scheduler = Scheduler(max_batch=cfg.max_batch, status_aware=status_aware,
                                   max_skip_s=cfg.max_skip_s,
                                   skip_scope=cfg.skip_scope or self.policy.skip_scope)
        self.page_size = ps
        self.manager.tags.hints.configure(max_workflows=cfg.max_workflows,
                                          max_agents_per_workflow=cfg.max_agents_per_workflow,
                                          max_agents=cfg.max_hint_agents,
                                          forget_after_s=cfg.forget_after_s)
        cap = client_cap_pages(cfg, dev_pages)
        self._fair_share = cap == "fair"   # device pool / active tenants, once tenants appear
        self._tenanted = False
        if isinstance(cap, int):
            self.manager.set_client_cap(cap)
        from .grammar import GrammarBackend
        from .sampling import BatchSampler
        self.grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size)
        self.requests = RequestBuilder(tokenizer=self.tokenizer, model_config=self.model_config,
                                       config=cfg, grammar=self.grammar,
                                       capacity_tokens=lambda: self.capacity_tokens)
        self.sampler = BatchSampler(self.grammar)
        self._cuda = torch.device(cfg.device).type == "cuda"
        self._inbox: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0,
                         "hints_rejected": 0, "hints_accepted": 0, "steps": 0, "decode_steps": 0,
                         "step_failures": 0, "cache_resets": 0,
                         # wall seconds inside the model's forwards (engine thread): what the
                         # process's speed does to every policy alike; the benches pair trials by
                         # it. On CUDA only the launches (the forward is asynchronous there)
                         "prefill_forward_s": 0.0, "decode_forward_s": 0.0,
                         # prefills admitted with their prefix's load in flight (layer-wise
                         # overlap) and the seconds they waited on its layers
                         "layerwise_loads": 0, "layerwise_wait_s": 0.0,
                         # wall seconds of the steps that did something (forwards, copies and
                         # everything between them); the rest of the engine thread's life it
                         # waits for work
                         "busy_s": 0.0}
        self._sleep = time.sleep  # the layer-wise load wait (tests may count it instead)
        self._snapshot: dict = {}
        self._outbox: dict = {}            # outlet -> [(key, event)] of this step (BatchedSink)
        self._published = 0.0
        self.recorder = None
        if cfg.record_path:
            from .trace import TraceRecorder

            self.recorder = TraceRecorder(cfg.record_path)
        self._thread: Optional[threading.Thread] = None
        self._publish(force=True)
        if start:
            self.start()

    # ================================================================ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)
        self.pool.close()
        if self.recorder is not None:
            self.recorder.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        """The engine thread was started (``alive`` False after it: it stopped)."""
        return self._thread is not None

    def describe(self) -> dict:
        """What was fixed at start, as plain data: the startup line, and the HTTP side of an
        engine in its own process (``engine_core``)."""
        mgr, sched, cfg = self.manager, self.scheduler, self.config
        return {"model_name": self.model_name, "load_s": self.load_s, "policy": self.policy.name,
                "host_tier": self.policy.host_tier, "backup": getattr(self.policy, "backup", None),
                "copy_mode": self.pool.copy_mode, "admission": mgr.admission.order,
                "status_aware": sched.status_aware, "skip_scope": sched.skip_scope,
                "decode_reserve": mgr.decode_reserve, "capacity_tokens": self.capacity_tokens,
                "layerwise_load": cfg.layerwise_load, "malloc_pinned": self.malloc_pinned}

    @property
    def capacity_tokens(self) -> Optional[int]:
        """Device tokens a single request may use (None: unbounded, the oracle)."""
        if not self.policy.admission_pool_bound:
            return None
        return self.manager.device_pages * self.page_size

    # ================================================================ building requests
    def make_request(self, *, messages: Optional[Sequence[dict]] = None, prompt: Optional[str] = None,
                     prompt_ids: Optional[Sequence[int]] = None, params: Optional[SamplingParams] = None,
                     max_tokens: Optional[int] = None, hints: Any = None,
                     sink: Optional[Callable[[StreamEvent], None]] = None,
                     tools: Optional[Sequence[dict]] = None, tenant: Optional[str] = None) -> Request:
        """Tokenize and validate (any thread; the server calls it off its event loop), so a
        request the engine would fail on is refused here, before it can share a step with
        others. Raises :class:`EngineInputError`. ``tenant``: whose request it is (the client
        its hints count against for fair shares). The work is :class:`~.request_builder.RequestBuilder`'s."""
        return self.requests.build(messages=messages, prompt=prompt, prompt_ids=prompt_ids, params=params,
                                   max_tokens=max_tokens, hints=hints, sink=sink, tools=tools, tenant=tenant)

    # ================================================================ thread-safe API
    def submit(self, req: Request) -> str:
        with self._lock:
            self.counters["requests"] += 1
        self._inbox.put(lambda: self._add(req))
        return req.rid

    def abort(self, rid: str) -> None:
        self._inbox.put(lambda: self._abort(rid))

    def update_hints(self, hints: Any, tenant: Optional[str] = None) -> None:
        """Out-of-band hints (``kvflow_event`` "transition" or "end"), applied between steps."""
        self._inbox.put(lambda: self._apply_hints(hints, tenant=tenant))

    def note_hints(self, accepted: bool) -> None:
        with self._lock:
            self.counters["hints_accepted" if accepted else "hints_rejected"] += 1

    def _call_future(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        self._inbox.put(run)
        return fut

    def stats(self) -> dict:
        """The latest published snapshot (counters, cache metrics, queue, pools). Non-blocking."""
        return self._snapshot
