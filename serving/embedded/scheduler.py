"""Request bookkeeping and the admission rule of the embedded engine's scheduler.

Pure Python, no torch: the engine thread (``engine_loop.py``) calls :meth:`Scheduler.admission_plan`
once per step and does the cache and model work itself.

Request life cycle (``Request.state``)::

    WAITING ──(first poll: matched, pinned, load started if host-only and not passed over)──>
        WAITING/LOADING
    LOADING ──(load ready)──> WAITING ──(admitted: pages allocated, prefill)──> RUNNING
    RUNNING ──(EOS / stop string / max_tokens / abort)──> FINISHED
    RUNNING ──(retracted: no room to grow past an optimistic reserve)──> WAITING

Admission rule (status-aware continuous batching):
- candidates are taken in admission order (their session's ``admission_key``: arrival order for
  lru / hicache / oracle, the oldest workflow's call first for kvflow), at most ``max_batch``
  running;
- a request whose prefix is still loading is *skipped* under a status-aware policy (kvflow) so
  ready requests behind it run meanwhile; under the other policies it blocks the queue
  (head-of-line, as a synchronous load would). Which requests may run ahead of it is the skip
  scope (``serving/policy/admission.py``): any (``all``), or its own workflow's and requests
  without hints (``workflow``: another workflow's requests behind it keep their places too,
  and their first look starts no load). Only a load in flight holds others back: a request
  whose load waits for device room is skipped too, but lets everyone by (as the simulator
  and SGLang's hook, which hold for in-flight loads only);
- no starvation: a skipped request keeps its place, so it is the first candidate once its load
  lands (a load finishes in bounded time); one skipped for longer than ``max_skip_s`` (its load
  could not even start, e.g. no device room) blocks younger requests until it is ready (age
  rule; if only the pins of the waiting requests behind it hold the room, its next poll
  releases them: the session's deadlock breaker); and a ready request that could not get memory stops admission (younger requests may
  not overtake it, or a large one could wait forever);
- admission is bounded by batch slots and device memory; the engine then prefills admitted
  requests in chunks (``EngineConfig.max_prefill_tokens`` per step).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from kvflow_agents.serving.policy.admission import check_skip_scope, may_overtake
from kvflow_agents.serving.policy.session import Readiness

_ids = itertools.count(1)


class RequestState(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """Decoding settings. ``temperature == 0`` means greedy; ``max_tokens=None`` lets the engine
    pick (its ``default_max_tokens``, capped by what the device pool can hold).

    Logits processing (``sampling.py``): ``frequency_penalty`` / ``presence_penalty`` (OpenAI,
    -2..2, over the output), ``repetition_penalty`` (vLLM/SGLang, > 0, over prompt + output),
    ``logit_bias`` ({token id: -100..100}); ``logprobs`` / ``top_logprobs`` (0..20) report the raw
    distribution; ``grammar`` (a :class:`~.grammar.GrammarSpec`) constrains the output."""

    max_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: Optional[int] = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Any = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad parameter."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 <= t <= 2) or math.isnan(t):
            raise ValueError(f"temperature: must be between 0 and 2, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        if len(self.stop) > 16 or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in self.stop):
            raise ValueError("stop: at most 16 non-empty strings of up to 256 characters")
        sd = self.seed  # torch.Generator.manual_seed takes a 64-bit integer; OpenAI's is int64
        if sd is not None and (isinstance(sd, bool) or not isinstance(sd, int) or not SEED_MIN <= sd <= SEED_MAX):
            raise ValueError(f"seed: must be an integer in [{SEED_MIN}, {SEED_MAX}], got {sd!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name}: must be between -2 and 2, got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 2:
            raise ValueError(f"repetition_penalty: must be in (0, 2], got {r!r}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > 300 or not all(
                    isinstance(k, int) and k >= 0 and isinstance(v, (int, float)) and -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                raise ValueError("logit_bias: at most 300 {token id: bias in -100..100} entries")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
            raise ValueError(f"top_logprobs: must be an integer in 0..20, got {k!r}")
        if k and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")


@dataclass
class Completion:
    """The result of one request (also the last event of a stream)."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str                 # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    cached_tokens: int                 # prompt tokens not recomputed (device or host hit)
    device_hit_tokens: int             # of those: readable on device when the request arrived
    host_hit_tokens: int               # of those: loaded from host (on demand or prefetched late)
    computed_tokens: int               # prompt tokens prefilled
    queue_s: float = 0.0               # arrival -> prefill start
    load_wait_s: float = 0.0           # time spent waiting for its prefix to load
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: Optional[str] = None
    logprobs: Optional[list] = None    # sampling.TokenLogprob per output token (logprobs=True)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def usage_kvflow(self) -> dict:
        """The per-tier split reported as ``usage.kvflow``."""
        return {"device_hit_tokens": self.device_hit_tokens, "host_hit_tokens": self.host_hit_tokens,
                "computed_tokens": self.computed_tokens, "queue_s": round(self.queue_s, 6),
                "load_wait_s": round(self.load_wait_s, 6), "ttft_s": round(self.ttft_s, 6)}


@dataclass
class StreamEvent:
    """What a request's sink receives, on the engine thread: text deltas, then one final event."""

    rid: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    done: Optional[Completion] = None  # set on the last event
    logprobs: tuple = ()               # sampling.TokenLogprob of token_ids (logprobs=True)


Sink = Callable[[StreamEvent], None]


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    hints: Any = None                  # kvflow_agents.protocol.Hints or None
    tenant: Optional[str] = None       # who sent it (the server's tenancy); the hints' client
    fixed_len: Optional[int] = None    # fixed-prefix tokens (from kvflow_fixed_messages)
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    # cache bookkeeping (engine thread only)
    session: Any = None                # the policy core's RequestSession (manager.arrive)
    prefilled: int = 0                 # tokens of session.tokens whose KV is written (chunked
                                       # prefill; after a retraction they include outputs)
    kv_len: int = 0                    # tokens of prompt + outputs whose KV is written
    # decoding
    output_ids: list[int] = field(default_factory=list)
    detok: Any = None
    generator: Any = None
    grammar: Any = None                # compiled constraint (xgrammar) of params.grammar
    sampling: Any = None               # sampling.RequestSampling, made at the first token
    logprobs: list = field(default_factory=list)
    skips: int = 0
    last_poll: Any = None              # its session's last Poll (state, ready_at, cached_len)
    load_inline: bool = False          # admit it with its load in flight (layer-wise overlap)
    inline_at: Optional[float] = None  # skipped: when its prefill could start hiding its load
    prefill_at: Optional[float] = None
    first_token_at: Optional[float] = None

    def poll(self, start_load: bool = True) -> bool:
        """Ask its cache session whether it can run now (the first poll records its hit, pins
        its prefix and, with ``start_load``, starts a demand load of a host-only part).
        State LOADING while a load on its prefix is in flight (a demand load or a prefetch),
        else WAITING (ready, or host-only with no load started: passed over, or no room)."""
        p = self.last_poll = self.session.poll(start_load=start_load)
        self.state = RequestState.LOADING if p.state is Readiness.LOADING else RequestState.WAITING
        return p.ready

    @property
    def pages(self) -> list[int]:
        """Device page ids of the request's KV (the session's; empty until admitted)."""
        return self.session.pages if self.session is not None else []

    @property
    def seq_len(self) -> int:
        """Tokens whose KV a decoding request has written when caught up (prompt + all outputs
        fed back so far); ``kv_len`` is less while it replays outputs after a retraction."""
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def decoding(self) -> bool:
        """Prefill done (of the prompt, or after a retraction of prompt + outputs so far)."""
        s = self.session
        return bool(self.output_ids) and s is not None and self.prefilled >= len(s.tokens)


def _admission_key(req: Request) -> tuple:
    s = req.session
    return s.admission_key if s is not None else ()


def _workflow(req: Request):
    s = req.session
    return s.workflow if s is not None else None


class Scheduler:
    """Waiting queue (in admission order) + running set; decides which waiting requests to try
    admitting."""

    def __init__(self, *, max_batch: int = 16, status_aware: bool = True, max_skip_s: float = 5.0,
                 skip_scope: str = "all", clock: Callable[[], float] = time.monotonic) -> None:
        self.max_batch = max_batch
        self.max_skip_s = max_skip_s
        self.clock = clock
        self.status_aware = status_aware
        self.skip_scope = check_skip_scope(skip_scope)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # waiting requests an admission pass went past (once per pass): not ready (the
        # status-aware skip), or another workflow's call loading ahead of them (skip scope)
        self.passes = {"skipped": 0, "held_for_workflow": 0}

    def add(self, req: Request) -> None:
        """Queue ``req`` in admission order (its session's ``admission_key``: arrival order
        under fcfs, oldest workflow first under kvflow's ``workflow`` order)."""
        bisect.insort(self.waiting, req, key=_admission_key)

    def remove(self, rid: str) -> Optional[Request]:
        for q in (self.waiting, self.running):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    return r
        return None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def counts(self) -> dict:
        loading = sum(1 for r in self.waiting if r.state is RequestState.LOADING)
        return {"waiting": len(self.waiting) - loading, "loading": loading,
                "running": len(self.running)}

    def first_looks(self) -> Iterator[tuple[Request, bool]]:
        """The waiting requests no step has looked at yet (in admission order, at most
        ``max_batch`` deep), each with whether its first look may start a demand load: not
        when the skip scope passes it over, behind a waiting request of another workflow whose
        prefix is loading. It could not run before that one anyway, and its load would share
        the FIFO link with that one's (the admission plan starts it once the plan reaches it).
        The caller looks at each request (its ``state`` says LOADING if it now waits on a load)
        before resuming the iterator."""
        now = self.clock()
        held = None                   # as in admission_plan, from the states polls left
        for i, req in enumerate(list(self.waiting)):
            if i >= self.max_batch:
                return
            passed_over = held is not None and not may_overtake(self.skip_scope, held, _workflow(req))
            if not req.session.looked:
                yield req, not passed_over
            if held is None and self._holds_back(req, now):
                held = _workflow(req)

    def admission_plan(self, is_ready: Callable[[Request], bool]) -> Iterator[Request]:
        """Yield waiting requests to admit, in order. The caller admits each one and calls
        :meth:`admitted` (or stops iterating when it could not, e.g. out of memory)."""
        budget = self.max_batch - len(self.running)
        now = self.clock()
        held = None                   # the workflow of the first skipped request loading now
        for req in list(self.waiting):
            if budget <= 0:
                return
            if held is not None and not may_overtake(self.skip_scope, held, _workflow(req)):
                # another workflow's: passed over untouched (not even polled: a poll can start
                # its demand load, which would share the FIFO link with the skipped one's)
                self.passes["held_for_workflow"] += 1
                continue
            if not is_ready(req):
                req.skips += 1
                if not self._may_skip(req, now):
                    return            # head-of-line: a synchronous load blocks the queue
                self.passes["skipped"] += 1
                if held is None and self._holds_back(req, now):
                    held = _workflow(req)
                continue              # skip it; it keeps its place in the queue
            budget -= 1
            yield req

    def _may_skip(self, req: Request, now: float) -> bool:
        """Status-aware skip: a request not ready to run lets others ahead (and keeps its place)
        until it has waited ``max_skip_s``; then it blocks the queue (the age rule)."""
        return self.status_aware and now - req.arrival < self.max_skip_s

    def _holds_back(self, req: Request, now: float) -> bool:
        """Whether a skipped request holds back the requests the skip scope does not let
        overtake it: only while a load on its prefix is in flight (the scope's reason: its pages
        and slot are needed the moment it lands). One whose load waits for room, or not looked
        at yet, holds no one. The simulator and SGLang's hook apply the same rule."""
        return req.state is RequestState.LOADING and self._may_skip(req, now)

    def admitted(self, req: Request) -> None:
        self.waiting.remove(req)
        req.state = RequestState.RUNNING
        self.running.append(req)

    def retracted(self, req: Request) -> None:
        """Running -> waiting, back at its place in admission order (its key is kept)."""
        self.running.remove(req)
        req.state = RequestState.WAITING
        bisect.insort(self.waiting, req, key=_admission_key)
