"""Discrete-event simulator of one serving engine driving the policy core unchanged.

The engine (this file) owns time, batching and costs; every cache decision (what is cached,
where, eviction order, write-through, prefetch plans, node states, load versus recompute) is
made by :class:`kvflow_agents.serving.policy.KVCacheManager`, driven through the same
per-request session as the embedded engine: ``arrive`` (hints merged) -> ``poll`` while
waiting -> ``load`` / ``admit`` -> prefill -> ``commit`` (insert + tag) -> decode -> ``finish``;
``tick`` every scheduler iteration; ``release_workflow`` when a workflow ends.

Scheduler (SGLang-like, iteration level): waiting queue in the policy's admission order
(:mod:`~kvflow_agents.serving.policy.admission`: FIFO for lru / hicache / oracle, oldest
workflow first for kvflow; ``admission=`` overrides); each iteration either runs a
prefill batch of newly admitted requests (up to ``max_prefill_tokens`` new tokens and
``max_running`` requests; KV for prompt + output reserved at admission) or one decode step for
all running requests (decode steps between events are fast-forwarded: same batch, context
growing by one token per step). If nothing can run the clock jumps to the next arrival or load.

Client side (profile ``request_overhead_s`` + ``stream_per_token_s`` x output, 0 on the GPU
profiles): a call ends for its client that long after the engine finished it; round latency and
the workflow's next step use that time. The fixed prefix is tagged at ``Call.tag`` tokens
(default ``Call.fixed``; the validation's chat template tags before the shared prefix ends).

Loads (documented choices):
- the host->device link is FIFO (:class:`~.state.SimBackend`); ``start_load`` returns
  ``max(now, link free) + alpha + bytes/BW``. Write-through (device->host backup) is modelled as
  asynchronous on the other PCIe direction (full duplex): counted, never delaying anything.
- on-demand load inside a prefill batch (``hicache``; ``kvflow`` when nothing else can run):
  layer-wise overlap as HiCache does: layer l computes once its KV landed, so the batch takes
  ``max(compute, load_left + compute/layers)``; the excess over ``compute`` is exposed
  (``layerwise=False``: ``load_left + compute``, HiCache before its layer-wise I/O).
- ``kvflow`` is status-aware: a request whose prefix is LOADING (a prefetch in flight) is
  skipped unless its own prefill outlasts the rest of the load (then inline, layer-wise, as the
  embedded engine's ``_may_load_inline``); a skipped one wakes when its prefill could start
  hiding the rest (``Req.inline_at``). A request needing an on-demand load while other work
  exists starts the load and is skipped the same way, unless its own prefill would hide the
  whole load (then inline). Time a request waits on loads is exposed load time.
- no host room / no device room for a load: the host part is recomputed (``load_on_demand``
  returned ``None``).

Policy-core features the simulator uses (``reserve=True``, ``load_vs_recompute=None`` defaults):
- prefetch budget: the core's reserve = device pages the waiting sessions will still allocate
  (prompt + output - their cached device / loading prefix; running requests reserved theirs at
  admission), so a prefetch never takes room the next admission reclaims.
- status-aware waits are recorded by the sessions' ``poll``, so the core's
  ``load_hidden_fraction`` counts them as exposed.
- load versus recompute (``kvflow`` only by default: ``hicache`` models SGLang HiCache as
  shipped, which always loads): the manager's ``recompute_cost`` is the marginal prefill of
  the host tokens x (1 + running requests + the prefill batch being formed) (recomputing
  stalls them all; waiting for a skipped request's load does not); an inline load (the batch stalls on it) passes its own
  ``recompute_s`` = r + C (1 - 1/layers) with C = the batch's compute so far (layer-wise:
  loading costs max(C, R + C/L), recomputing C + r).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Callable, Optional

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.policy import KVCacheManager, Readiness, get_policy
from kvflow_agents.serving.policy.admission import may_overtake

from .costs import Profile
from .state import Req, SimBackend, SimResult, Tokens, WfState
from .workloads import Workload

LOADING, NEEDS_LOAD = Readiness.LOADING, Readiness.NEEDS_LOAD


class Simulator:
    def __init__(self, profile: Profile, workload: Workload, policy: str, *,
                 lookahead: int = 1, max_inflight_loads: int = 4, max_running: int = 256,
                 max_prefill_tokens: int = 16384, lease_s: float = 3600.0,
                 layerwise: bool = True, reserve: bool = True,
                 load_vs_recompute: Optional[bool] = None,
                 admission: Optional[str] = None, busy_lookahead: Optional[int] = None) -> None:
        self.p = profile
        self.w = workload
        self.policy = get_policy(policy)
        ps = self.ps = workload.page_size
        fixed_total = workload.fixed_tokens_total()
        dev = workload.device_tokens
        if dev is None and workload.device_fraction is not None:
            dev = int(workload.device_fraction * fixed_total)
        if dev is None:
            dev = profile.device_tokens()
        if dev is None:
            raise ValueError("no device pool size: the profile has none; set device_tokens or device_fraction")
        need = workload.max_request_tokens()
        if dev < need + ps:
            raise ValueError(f"device pool of {dev} tokens cannot hold one request of {need} tokens")
        host = workload.host_tokens or profile.host_tokens() or 4 * (fixed_total + need)
        self.device_tokens, self.host_tokens = dev, host
        self.t = 0.0
        self.backend = SimBackend(profile, ps, lambda: self.t)
        if load_vs_recompute is None:  # HiCache as SGLang ships it always loads a host hit
            load_vs_recompute = self.policy.name == "kvflow"
        self.load_vs_recompute = load_vs_recompute
        # Recomputing n tokens (marginal prefill after ctx cached ones; the batch pays `a`
        # anyway) stalls every running request for that long, while waiting for a load
        # delays only the request (status-aware: the others keep running), so the cost the
        # manager compares a load with is recompute x (1 + running + batch being formed):
        # the policy core's recompute_cost_s with these stalls, as the embedded engine's.
        rec = (lambda n, ctx: self._recompute(n, ctx)) if load_vs_recompute else None
        stalls = ((lambda: len(self.running) + len(self._admitting))
                  if load_vs_recompute else None)
        self._admitting: list = []  # the prefill batch being formed (_admit)
        self.mgr = KVCacheManager(self.policy, page_size=ps, device_pages=dev // ps,
                                  host_pages=host // ps, backend=self.backend, lookahead=lookahead,
                                  max_inflight_loads=max_inflight_loads, lease_s=lease_s,
                                  reserve_pages=None if reserve else 0, recompute_cost=rec,
                                  recompute_stalls=stalls,
                                  admission=admission, busy_lookahead=busy_lookahead)
        self.max_running, self.max_prefill = max_running, max_prefill_tokens
        self.layerwise = layerwise
        self.tokens = Tokens()
        self.events: list = []
        self.seq = itertools.count()
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.finished: list[Req] = []
        self.wfs = [WfState(p) for p in workload.workflows]
        self.exposed_s = 0.0
        self.iterations = 0

    # ------------------------------------------------------------------ clients
    def _schedule_step(self, wf: WfState, t: float) -> None:
        wf.step += 1
        if wf.step >= len(wf.plan.steps):
            self.mgr.release_workflow(wf.plan.id)
            return
        st = wf.plan.steps[wf.step]
        at = st.at if st.at is not None else t + st.gap_s
        heapq.heappush(self.events, (max(at, t), next(self.seq), wf))

    def _arrive(self, wf: WfState) -> None:
        st = wf.plan.steps[wf.step]
        wf.round_start.setdefault(st.round, self.t)
        wf.outstanding = len(st.calls)
        for c in st.calls:
            prompt = self.tokens.fixed(c.fixed_key, c.fixed) + self.tokens.unique(c.dynamic)
            req = Req(wf, c, prompt, self.tokens.unique(c.output), self.t, st.measured)
            hints = Hints.model_construct(workflow=wf.plan.id, agent=c.agent, step=wf.step,
                                          ste=st.ste, next=[], app=None, fixed_messages=None,
                                          event=None)
            req.session = self.mgr.arrive(prompt, hints, kv_tokens=len(prompt) + len(req.out),
                                          fixed_len=c.fixed if c.tag is None else c.tag)
            # waiting requests stay in admission order (kvflow: oldest workflow first)
            bisect.insort(self.waiting, req, key=lambda x: x.session.admission_key)

    def _finish(self, r: Req) -> None:
        r.done = self.t
        # client side (0 on GPU profiles): HTTP/request handling + SSE parsing per output token;
        # the client sees the call end, and issues the workflow's next call, this much later
        client_t = self.t + self.p.request_overhead_s + self.p.stream_per_token_s * len(r.out)
        toks = r.prompt + r.out
        r.session.finish(toks, len(toks))
        self.finished.append(r)
        wf = r.wf
        wf.outstanding -= 1
        wf.client_done = max(wf.client_done, client_t)
        if wf.outstanding == 0:
            st = wf.plan.steps[wf.step]
            wf.round_end[st.round] = wf.client_done
            self._schedule_step(wf, wf.client_done)

    # ------------------------------------------------------------------ scheduler
    def _admit(self) -> list[Req]:
        admitted, keep, budget = [], [], self.max_prefill
        self._admitting = admitted
        aware, scope = self.policy.status_aware, self.policy.skip_scope
        blocked = False
        held = None   # the workflow of the first request skipped for its load (skip scope)
        for r in self.waiting:
            if blocked or budget <= 0 or len(self.running) + len(admitted) >= self.max_running:
                keep.append(r)
                continue
            s = r.session
            if held is not None and not may_overtake(scope, held, s.workflow):
                keep.append(r)  # another workflow's: passed over untouched (no load started)
                continue
            p = s.poll(start_load=False)
            r.inline_at = None
            load_inline, rec = False, None
            if aware and p.state is LOADING and not self._may_load_inline(r, p):
                self._wait(r, p.ready_at)
                keep.append(r)
                held = held if held is not None else s.workflow
                continue
            if p.state is NEEDS_LOAD or p.state is LOADING:
                # status-aware: if other work can run and the load would not hide behind this
                # request's own prefill (layer-wise), start it and skip the request meanwhile
                hide = self._own_prefill_s(r, p)
                if (aware and p.state is NEEDS_LOAD and (self.running or admitted)
                        and self.p.load_s(p.cached_len - p.device_len) > hide):
                    p = s.load()   # async: skip until it lands
                    if p.state is LOADING and not self._may_load_inline(r, p):
                        self._wait(r, p.ready_at)
                        keep.append(r)
                        held = held if held is not None else s.workflow
                        continue
                    load_inline = p.state is LOADING
                else:
                    # inline: the batch stalls on the load as it would on recomputing, less
                    # what its own prefill hides (layer-wise), so compare for this batch alone
                    load_inline = True
                    if self.load_vs_recompute and p.state is NEEDS_LOAD:
                        # load: batch takes max(C, R + C/L); recompute: C + r. Load iff
                        # R <= r + C (1 - 1/L), C = the batch's compute so far with this one
                        rec = self._recompute(p.cached_len - p.device_len, p.device_len)
                        if self.layerwise:
                            c = self.p.prefill_s([(x.n_new, x.cached) for x in admitted]
                                                 + [(len(r.prompt) - p.cached_len, p.cached_len)])
                            rec += c * (1 - 1 / self.p.layers)
            if not s.admit(load_inline=load_inline, recompute_s=rec):
                keep.append(r)
                blocked = True  # head-of-line: wait for memory
                continue
            if r.wait_since is not None:
                w = max(0.0, min(self.t, r.wait_until) - r.wait_since)
                r.skip_wait_s += w
                r.load_wait_s += w
                r.wait_since = None
            r.cached = s.reused
            r.ready = s.ready_at if s.ready_at is not None else self.t
            # loads (prefetch or demand) on its prefix no earlier request read: their transfer
            # time is what r needed; what it waited (load_wait_s, batch stalls) is exposed
            for ld in s.loads_read:
                r.load_need_s += self.p.load_s(ld.pages * self.ps)
            r.n_new = len(r.prompt) - r.cached
            budget -= r.n_new
            admitted.append(r)
        self.waiting = keep
        self._admitting = []
        return admitted

    def _own_prefill_s(self, r: Req, p) -> float:
        """What ``r``'s own prefill takes after its cached prefix (what it can hide a load behind)."""
        return self.p.prefill_s([(len(r.prompt) - p.cached_len, p.cached_len)])

    def _may_load_inline(self, r: Req, p) -> bool:
        """Status-aware, a request whose prefix is LOADING: admitted (its prefill reading each
        layer as it lands) only where its own prefill outlasts the rest of the load, as the
        embedded engine's ``EngineLoop._may_load_inline``; otherwise skipped, waking at
        ``inline_at`` when its prefill could start hiding the rest. Never layer-wise off, nor
        while a host-only part below the in-flight one waits for the head to land."""
        if not self.layerwise or p.host_rest or p.ready_at is None:
            return False
        hide = self._own_prefill_s(r, p)
        if p.ready_at - self.t <= hide + 1e-9:  # (woken at inline_at: equal up to rounding)
            return True
        r.inline_at = p.ready_at - hide
        return False

    def _next_inline_at(self) -> float:
        """The earliest moment a skipped request's prefill could start hiding its load."""
        return min((r.inline_at for r in self.waiting
                    if r.inline_at is not None and r.inline_at > self.t), default=math.inf)

    def _recompute(self, n: int, ctx: int) -> float:
        return self.p.prefill_s([(n, ctx)]) - self.p.prefill_a

    def _wait(self, r: Req, until: float) -> None:
        """``r`` was skipped for a load landing at ``until``: that wait is exposed load time
        (counted up to the landing or the admission, whichever comes first)."""
        if r.wait_since is None:
            r.wait_since, r.wait_until = self.t, until
        else:
            r.wait_until = max(r.wait_until, until)

    def _prefill(self, batch: list[Req]) -> None:
        t0 = self.t
        compute = self.p.prefill_s([(r.n_new, r.cached) for r in batch])
        load_left = max(r.ready for r in batch) - t0
        if load_left <= 0:
            dt = compute
        elif self.layerwise:
            dt = max(compute, load_left + compute / self.p.layers)
        else:  # load first, then compute (HiCache without layer-wise overlap)
            dt = load_left + compute
        self.exposed_s += dt - compute
        if dt > compute:
            for r in batch:
                if r.ready > t0:
                    r.load_wait_s += dt - compute
        self.t = t0 + dt
        stall = [(t0, t0 + dt - compute)] if dt > compute else []
        for r in batch:
            if r.session.inline_loads:  # what its prefill hid of them is hidden (the core's count)
                r.session.overlapped(stall if r.ready > t0 else [])
            r.session.commit()  # the prompt joins the tree; the agent's fixed prefix is tagged
            r.first_token, r.generated = self.t, 1
            if r.generated >= len(r.out):
                self._finish(r)
            else:
                self.running.append(r)

    def _decode(self) -> None:
        run = self.running
        k = min(len(r.out) - r.generated for r in run)
        stop = math.inf
        if self.events:
            stop = self.events[0][0]
        if self.mgr.loads_in_flight:
            stop = min(stop, self.mgr.next_load_at)
        stop = min(stop, self._next_inline_at())
        b = len(run)
        ctx = sum(len(r.prompt) + r.generated for r in run)
        p = self.p
        t, steps = self.t, 0
        while steps < k:
            t += p.decode_s(b, ctx + steps * b)
            steps += 1
            if t >= stop:
                break
        self.t = t
        still = []
        for r in run:
            r.generated += steps
            if r.generated >= len(r.out):
                self._finish(r)
            else:
                still.append(r)
        self.running = still

    def run(self, progress: Optional[Callable[[int], None]] = None) -> SimResult:
        for wf in self.wfs:
            self.t = wf.plan.start_s
            self._schedule_step(wf, wf.plan.start_s)
        self.t = 0.0
        total = self.w.num_calls()
        mgr = self.mgr
        while True:
            self.iterations += 1
            while self.events and self.events[0][0] <= self.t:
                _, _, wf = heapq.heappop(self.events)
                self._arrive(wf)
            mgr.tick(self.t)
            before = len(self.finished)
            batch = self._admit() if self.waiting else []
            if batch:
                self._prefill(batch)
            elif self.running:
                self._decode()
            else:
                nxt = [self.events[0][0]] if self.events else []
                if mgr.loads_in_flight:
                    nxt.append(mgr.next_load_at)
                if (wake := self._next_inline_at()) < math.inf:
                    nxt.append(wake)
                if not nxt:
                    if self.waiting:
                        raise RuntimeError(f"sim deadlock at t={self.t:.3f}: {len(self.waiting)} "
                                           "requests wait and nothing can free memory")
                    break
                self.t = max(self.t, min(nxt))
            if progress is not None and len(self.finished) > before:
                progress(len(self.finished) - before)
        if len(self.finished) != total:
            raise AssertionError(f"sim: {len(self.finished)} of {total} requests finished")
        return self._result()

    # ------------------------------------------------------------------ results
    def _result(self) -> SimResult:
        lat, spans = [], []
        for wf in self.wfs:
            rounds = {st.round for st in wf.plan.steps if st.measured}
            for rd in rounds:
                lat.append(wf.round_end[rd] - wf.round_start[rd])
                spans.append((wf.round_start[rd], wf.round_end[rd]))
        meas = [r for r in self.finished if r.measured] or self.finished
        # exposed: engine time lost to loads (batch stalls) + time requests were skipped for them
        exposed = self.exposed_s + sum(r.skip_wait_s for r in self.finished)
        need = sum(r.load_need_s for r in self.finished)
        hid = sum(max(0.0, r.load_need_s - r.load_wait_s) for r in self.finished)
        load = self.backend.load_busy_s
        hidden = hid / need if need > 0 else None
        cache = self.mgr.metrics.as_dict()
        return SimResult(
            policy=self.policy.name, workload=self.w.name,
            latency_s=sum(lat) / len(lat) if lat else 0.0,
            latency_p90_s=sorted(lat)[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else 0.0,
            makespan_s=(max(e for _, e in spans) - min(s for s, _ in spans)) if spans else self.t,
            ttft_mean_s=sum(r.first_token - r.arrival for r in meas) / len(meas),
            requests=len(self.finished),
            recomputed_tokens=sum(r.n_new for r in self.finished),
            cached_tokens=sum(r.cached for r in self.finished),
            load_s=load, exposed_load_s=exposed, hidden_fraction=hidden,
            cache={k: cache[k] for k in ("device_hit_rate", "hit_rate", "demand_loads",
                                          "prefetch_issued", "prefetch_used", "prefetch_wasted",
                                          "backup_pages", "load_hidden_fraction")},
            extra={"device_tokens": self.device_tokens, "host_tokens": self.host_tokens,
                   "iterations": self.iterations, "end_t": self.t,
                   "link_gbps": self.p.link_gbps, "profile": self.p.name})


def simulate(profile: Profile, workload: Workload, policy: str, **kw) -> SimResult:
    return Simulator(profile, workload, policy, **kw).run()


def compare(profile: Profile, workload: Workload, policies=("lru", "hicache", "kvflow", "oracle"),
            **kw) -> dict[str, SimResult]:
    return {p: simulate(profile, workload, p, **kw) for p in policies}
