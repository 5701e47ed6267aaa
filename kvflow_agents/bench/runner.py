"""Run a workload on one ``kvflow serve`` per cache policy, all with identical flags.

The policies' servers are started one after the other and then run side by side; only one is
ever busy. Each **trial** runs the workload once on every server in turn (the order rotated per
trial), so a noisy neighbour on the machine slows every policy alike. Per policy and trial: one
tiny request (warms the kernels) → the workload's warm-up rounds (not measured: the paper
measures a warmed-up steady state) → read the server's cache counters (``GET
/kvflow/v1/cache``; the client collects its garbage and freezes the heap) → the measured
rounds → read them again. The counters' difference gives
the hit tokens per tier at match time, prefetch outcomes and load time hidden behind compute vs
exposed; per-request ``usage`` gives TTFT and per-tier hits. With ``interleave="round"`` the
servers take turns round by round instead of trial by trial (``run_workflow_bench``).

With ``base_url`` an already running (external) server is measured instead, as one column.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from statistics import mean, median
from typing import Any, Callable, Mapping, Optional, Sequence

from kvflow_agents.serving.policy.policies import POLICIES as _REGISTRY
from kvflow_agents.serving.policy.policies import is_reference

from .driver import WorkflowDriver
from .server import BenchServer, serve_args
from .workload import CallRecord, TokenCounter, WorkloadResult, WorkloadSpec, summarize_calls

POLICIES = tuple(_REGISTRY)   # every registered policy can be a column
ORACLES = tuple(p for p in POLICIES if is_reference(p))   # references, not contenders
INTERLEAVE = ("trial", "round")   # what one policy runs before the next (run_workflow_bench)

_COUNTERS = ("requests", "hit_tokens_device", "hit_tokens_host", "hit_tokens_loading", "miss_tokens",
             "backup_pages", "dropped_pages", "demand_loads", "demand_load_pages", "prefetch_issued",
             "prefetch_pages", "prefetch_used", "prefetch_wasted", "prefetch_evicted_pages",
             "prefetch_stale", "prefetch_deferred", "prefetch_budget_skips", "prefetch_fill_overflows",
             "prefetch_fill_link_busy",
             "load_hidden_s", "load_exposed_s", "retractions",
             "loads_declined", "declined_pages",  # host hits recomputed as cheaper than the link
             # the engine's own (``/kvflow/v1/cache``'s "engine", prefixed): how fast the process ran
             "engine_steps", "engine_decode_steps", "engine_prefill_forward_s", "engine_decode_forward_s",
             "engine_copy_s", "engine_layerwise_loads", "engine_layerwise_wait_s",
             # where the engine's time and CPU go beside its forwards: its busy steps' wall time,
             # the engine thread's CPU, the engine's process's CPU, the HTTP process's CPU
             "engine_busy_s", "engine_thread_cpu_s", "engine_process_cpu_s", "http_process_cpu_s")
_BY_REASON = ("evictions", "evicted_pages", "prefetch_wasted_by")   # counters keyed by reason


@dataclass
class ServerConfig:
    model: str
    device_tokens: int
    host_tokens: int
    page_size: int = 16
    host_link_gbps: Optional[float] = None
    lookahead: int = 1
    max_batch: int = 16
    torch_threads: Optional[int] = None  # None: the server's default (torch's)
    extra_args: Sequence[str] = ()
    startup_timeout_s: float = 300.0
    # column label -> (policy, its own extra serve options): one policy served twice, e.g. with
    # and without an engine setting, measured side by side (``bench workflow --policy-variant``)
    variants: Mapping[str, tuple] = field(default_factory=dict)
    # column label -> the command that starts its ``kvflow serve`` (default: this interpreter's):
    # another checkout's venv served beside this one (``bench workflow|peer --other-python``)
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def args(self, policy: str) -> list[str]:
        policy, own = self.variants.get(policy, (policy, ()))
        return serve_args(model=self.model, policy=policy, device_tokens=self.device_tokens,
                          host_tokens=self.host_tokens, page_size=self.page_size,
                          host_link_gbps=self.host_link_gbps, lookahead=self.lookahead,
                          max_batch=self.max_batch, torch_threads=self.torch_threads,
                          extra=(*self.extra_args, *own))

    # Another engine's config (bench/sglang_engine.py) overrides these three.
    def make_server(self, policy: str) -> BenchServer:
        return BenchServer(self.args(policy), timeout_s=self.startup_timeout_s,
                           command=self.commands.get(policy))

    def display_argv(self, policy: str) -> list[str]:
        return [*self.commands.get(policy, ("kvflow", "serve")), *self.args(policy)]

    request_extra: Optional[dict] = None   # added to every request body


@contextlib.contextmanager
def settled_heap():
    """Measured client work runs on a collected heap whose survivors are frozen, so it never
    stops for a full collection of what came before (on this box one paused the bench's
    clients 70 ms mid-run, RESULTS.md §6.24); unfrozen on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def parse_policies(text: str) -> list[str]:
    got = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in got if p not in POLICIES]
    if bad or not got:
        raise ValueError(f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}")
    if len(set(got)) != len(got):
        raise ValueError("a policy is listed twice")
    return got


# ------------------------------------------------------------------------------ server counters
async def fetch_cache_metrics(base_url: str, api_key: Optional[str] = None) -> Optional[dict]:
    """``GET /kvflow/v1/cache``'s ``metrics``, with its ``engine`` counters as ``engine_*`` and
    its ``http`` ones as ``http_*`` (``None`` when the server has no such endpoint)."""
    import httpx

    from kvflow_agents.oob import server_root

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            r = await c.get(server_root(base_url) + "/kvflow/v1/cache", headers=headers)
            if r.status_code != 200:
                return None
            doc = r.json()
            m = doc.get("metrics")
            if not isinstance(m, dict):
                return None
            for part in ("engine", "http"):
                got = doc.get(part)
                m.update({f"{part}_{k}": v for k, v in got.items()} if isinstance(got, dict) else {})
            return m
    except Exception:  # noqa: BLE001
        return None


def metrics_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    if before is None or after is None:
        return None
    out = {k: after.get(k, 0) - before.get(k, 0) for k in _COUNTERS if k in after}
    for k in _BY_REASON:
        a, b = after.get(k) or {}, before.get(k) or {}
        out[k] = {r: a.get(r, 0) - b.get(r, 0) for r in a if a.get(r, 0) - b.get(r, 0)}
    tot = sum(out.get(k, 0) for k in ("hit_tokens_device", "hit_tokens_host", "hit_tokens_loading",
                                      "miss_tokens"))
    for k, name in (("hit_tokens_device", "device"), ("hit_tokens_host", "host"),
                    ("hit_tokens_loading", "loading"), ("miss_tokens", "miss")):
        out[f"{name}_rate"] = out.get(k, 0) / tot if tot else None
    hid, exp = out.get("load_hidden_s", 0.0), out.get("load_exposed_s", 0.0)
    out["load_hidden_fraction"] = hid / (hid + exp) if hid + exp > 0 else None
    return out


async def warm_kernels(base_url: str, model: str, api_key: Optional[str] = None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as c:
        await c.post(base_url.rstrip("/") + "/chat/completions", headers=headers,
                     json={"model": model, "messages": [{"role": "user", "content": "warm up"}],
                           "max_tokens": 2, "temperature": 0})


# ------------------------------------------------------------------------------ results
@dataclass
class PolicyResult:
    policy: str
    workload: dict                      # summarize_calls of the measured calls + workflow latency
    server: Optional[dict] = None       # counter deltas over the measured phase
    serve_argv: list = field(default_factory=list)
    startup_s: float = 0.0
    raw: Optional[dict] = None          # per-call / per-round records (JSON only)

    def as_dict(self, raw: bool = False) -> dict:
        d = {"policy": self.policy, "workload": self.workload, "server": self.server,
             "serve_argv": self.serve_argv, "startup_s": self.startup_s}
        if raw and self.raw is not None:
            d["raw"] = self.raw
        return d


def summarize_workload(res: WorkloadResult) -> dict:
    calls = [c for c in res.calls if c.measured]
    rounds = [r.latency_s for r in res.rounds if r.measured]
    out = summarize_calls(calls)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else None
    by_trial: dict[int, list[float]] = {}
    for r in res.rounds:
        if r.measured:
            by_trial.setdefault(r.trial, []).append(r.latency_s)
    out.update({
        # [trial, median workflow latency of that trial]: policies are paired per trial
        "workflow_latency_trials_s": [[t, median(v)] for t, v in sorted(by_trial.items())],
        "workflow_latency_mean_s": mean(rounds) if rounds else None,
        "workflow_latency_p50_s": median(rounds) if rounds else None,
        "workflow_latency_p90_s": pct(rounds, 0.9),
        "workflow_rounds": len(rounds),
        "measured_s": res.measured_s,
        "calls_per_s": len(calls) / res.measured_s if res.measured_s else None,
    })
    return out


def _raw(res: WorkloadResult) -> dict:
    from dataclasses import asdict
    return {"calls": [asdict(c) for c in res.calls], "rounds": [asdict(r) for r in res.rounds]}


# ------------------------------------------------------------------------------ running
ProgressHook = Callable[[str, int], Any]   # (event, n): ("start:<policy>", total) / ("advance", 1)


def _add_counters(acc: Optional[dict], d: Optional[dict]) -> Optional[dict]:
    if d is None:
        return acc
    if acc is None:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for k, v in d.items():
        if isinstance(v, dict):
            for r, x in v.items():
                acc.setdefault(k, {})[r] = acc.get(k, {}).get(r, 0) + x
        elif isinstance(v, (int, float)) and not k.endswith(("_rate", "_fraction")):
            acc[k] = acc.get(k, 0) + v
    return acc


def decode_step_s(delta: Optional[dict]) -> Optional[float]:
    """Model seconds per batched decode step over a counter delta: how fast the serving process
    ran over it (up to ~20 % apart for the same code, RESULTS.md §6.25: mostly the machine's
    speed drifting over seconds to minutes, §6.55), read off work every policy does alike.
    ``None`` without engine counters or decode steps."""
    n = (delta or {}).get("engine_decode_steps")
    return delta["engine_decode_forward_s"] / n if n else None


def finish_counters(acc: Optional[dict]) -> Optional[dict]:
    """Recompute the rates of summed counters."""
    if acc is None:
        return None
    base = {k: 0 for k in _COUNTERS}
    return metrics_delta(base, {**acc, **{k: acc.get(k, {}) for k in _BY_REASON}})


class ServerSet:
    """One running ``kvflow serve`` per policy (started one after the other, stopped together).
    Idle servers use no CPU, so trials can interleave the policies (see ``run_workflow_bench``)."""

    def __init__(self, config: ServerConfig, policies: Sequence[str],
                 log: Callable[[str], Any] = lambda s: None) -> None:
        self.config, self.policies, self.log = config, list(policies), log
        self.servers: dict[str, BenchServer] = {}

    def __enter__(self) -> "ServerSet":
        try:
            for p in self.policies:
                self.log(f"[{p}] starting: {' '.join(self.config.display_argv(p))}")
                self.servers[p] = self.config.make_server(p).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for srv in self.servers.values():
            srv.stop()

    def argv(self, p: str) -> list[str]:
        return self.config.display_argv(p)


def rotated(items: Sequence[str], k: int) -> list[str]:
    """Trial ``k`` runs the policies in a rotated order, so no policy always goes first."""
    items = list(items)
    k %= max(1, len(items))
    return items[k:] + items[:k]


def run_workflow_bench(spec: WorkloadSpec, policies: Sequence[str], server: Optional[ServerConfig], *,
                       counter: TokenCounter, base_url: Optional[str] = None,
                       model: Optional[str] = None, api_key: Optional[str] = None, trials: int = 1,
                       progress: Optional[ProgressHook] = None, keep_raw: bool = False, stream: bool = True,
                       fresh_servers: bool = False, interleave: str = "trial",
                       log: Callable[[str], Any] = lambda s: None) -> list[PolicyResult]:
    """``trials`` x (warm-up + measured rounds) per policy. All policy servers run side by side
    and the trials interleave them (policy order rotated per trial), so a noisy neighbour on the
    machine slows every policy alike; each trial uses fresh workflow ids and starts with its
    own (unmeasured) warm-up rounds. ``fresh_servers``: every trial starts its own servers, so
    what one process drew (two servers of the same code measured 10 % apart over 30 trials,
    RESULTS.md §6.22; the oracle's pool grows all run) is drawn again each trial.

    ``interleave``: ``"trial"`` runs a policy's whole trial (warm-up and every measured round)
    before the next policy's; ``"round"`` runs every policy's warm-up (all at once: nothing of
    them is measured), then measured round 1 of each policy, round 2 of each, ... (order
    rotated per round), each round a barrier across the workflows. On this box the model's
    speed drifts by up to a third within one process over seconds to a minute (RESULTS.md
    §6.55): the shorter the stretch between two policies' measurements, the less of that drift
    lands between them (per-trial spread of the ratios to the oracle halved at one workflow,
    side by side)."""
    if interleave not in INTERLEAVE:
        raise ValueError(f"interleave: one of {', '.join(INTERLEAVE)}, not {interleave!r}")
    per_trial = spec.workflows * spec.calls_per_round * (spec.rounds + spec.warmup_rounds)
    merged: dict[str, WorkloadResult] = {}
    counters: dict[str, Optional[dict]] = {}
    speeds: dict[str, list] = {}           # [trial, decode_step_s] per policy

    def on_call_of(label: str) -> Callable[[CallRecord], None]:
        def on_call(rec: CallRecord) -> None:
            if progress is not None:
                progress(f"advance:{label}", 1)
        return on_call

    def run_one(label: str, url: str, mdl: str, trial: int) -> None:
        res, delta = _run_workload(label, trial, spec, url, mdl, counter=counter, api_key=api_key,
                                   on_call=on_call_of(label), stream=stream,
                                   extra=server.request_extra if server is not None else None)
        record(label, trial, res, delta)

    def record(label: str, trial: int, res: WorkloadResult, delta: Optional[dict]) -> None:
        acc = merged.setdefault(label, WorkloadResult())
        acc.calls.extend(res.calls)
        acc.rounds.extend(res.rounds)
        acc.measured_s += res.measured_s
        counters[label] = _add_counters(counters.get(label), delta)
        if (v := decode_step_s(delta)) is not None:
            speeds.setdefault(label, []).append([trial, v])

    if base_url:
        labels = ["external"]
        if progress is not None:
            progress("start:external", per_trial * trials)
        for t in range(trials):
            run_one("external", base_url, model or "default", t)
        argv = {"external": [base_url]}
        startup = {"external": 0.0}
    else:
        assert server is not None
        labels = list(policies)
        started: dict[str, list[float]] = {p: [] for p in labels}

        def run_trials(ss: ServerSet, trial_ids: range) -> None:
            for p in labels:
                started[p].append(ss.servers[p].started_s)
            for t in trial_ids:
                if interleave == "round":
                    order = rotated(labels, t)
                    got = _run_interleaved(order, t, spec, {p: ss.servers[p].base_url for p in order},
                                           server.model, counter=counter, api_key=api_key,
                                           on_call={p: on_call_of(p) for p in order}, stream=stream,
                                           extra=server.request_extra)
                    for p in order:
                        record(p, t, *got[p])
                    continue
                for p in rotated(labels, t):
                    run_one(p, ss.servers[p].base_url, server.model, t)

        if progress is not None:
            for p in labels:
                progress(f"start:{p}", per_trial * trials)
        quiet: Callable[[str], Any] = lambda s: None  # noqa: E731
        for t in range(trials) if fresh_servers else [0]:
            # started in the trial's rotated order too: no column always starts first or last
            with ServerSet(server, rotated(labels, t), log=log if t == 0 else quiet) as ss:
                run_trials(ss, range(t, t + 1) if fresh_servers else range(trials))
        argv = {p: server.display_argv(p) for p in labels}
        startup = {p: sum(v) / len(v) for p, v in started.items()}
    out = []
    for p in labels:
        res = merged[p]
        summary = summarize_workload(res)
        summary["trials"] = trials
        summary["decode_step_trials_s"] = speeds.get(p, [])
        out.append(PolicyResult(p, summary, finish_counters(counters.get(p)), argv[p], startup[p],
                                _raw(res) if keep_raw else None))
        if summary.get("errors"):
            log(f"[{p}] {summary['errors']} request(s) failed; first: {summary.get('first_error')}")
    return out


def _run_interleaved(order: Sequence[str], trial: int, spec: WorkloadSpec, urls: Mapping[str, str],
                     model: str, *, counter: TokenCounter, api_key: Optional[str],
                     on_call: Mapping[str, Callable[[CallRecord], None]], stream: bool = True,
                     extra: Optional[dict] = None) -> dict:
    """One trial with ``interleave="round"`` (see ``run_workflow_bench``): every server's
    warm-up at once, every server's counters, then measured round k on each server in
    ``order`` rotated by k, then every server's counters again. Returns
    ``{label: (WorkloadResult, counter delta)}``.

    The warm-ups run concurrently because nothing of them is measured: on a real model they
    are most of a trial (each recomputes every prompt), and one after the other they left the
    first-warmed server idle for the others' whole warm-ups before its first measured round
    (minutes on smollm2, long enough for its hint leases to lapse), the last one not at all
    (RESULTS.md §6.62). A failed warm-up cancels the others (``TaskGroup``)."""
    async def main() -> dict:
        before: dict = {}
        async with contextlib.AsyncExitStack() as stack:
            sessions = {}
            for p in order:
                drv = WorkflowDriver(spec, urls[p], model, counter=counter, api_key=api_key,
                                     stream=stream, run_id=f"{p}-t{trial}-{int(time.time())}",
                                     trial=trial, on_call=on_call[p], extra=extra)
                sessions[p] = await stack.enter_async_context(drv.session())

            async def warm(p: str) -> None:
                await warm_kernels(urls[p], model, api_key)
                await sessions[p].warmup()

            async with asyncio.TaskGroup() as tg:
                for p in order:
                    tg.create_task(warm(p))
            for p in order:
                before[p] = await fetch_cache_metrics(urls[p], api_key)
            with settled_heap():
                for k in range(spec.rounds):
                    for p in rotated(order, k):
                        await sessions[p].measured_round(k)
            after = {p: await fetch_cache_metrics(urls[p], api_key) for p in order}
            for p in order:
                await sessions[p].end()
        return {p: (sessions[p].result, metrics_delta(before[p], after[p])) for p in order}
    return asyncio.run(main())


def _run_workload(label: str, trial: int, spec: WorkloadSpec, base_url: str, model: str, *,
                  counter: TokenCounter, api_key: Optional[str], on_call, stream: bool = True,
                  extra: Optional[dict] = None) -> tuple[WorkloadResult, Optional[dict]]:
    box: dict = {}

    async def main() -> WorkloadResult:
        await warm_kernels(base_url, model, api_key)
        drv = WorkflowDriver(spec, base_url, model, counter=counter, api_key=api_key, stream=stream,
                             run_id=f"{label}-t{trial}-{int(time.time())}", trial=trial,
                             on_call=on_call, extra=extra)

        with contextlib.ExitStack() as measured:
            async def between() -> None:
                box["before"] = await fetch_cache_metrics(base_url, api_key)
                measured.enter_context(settled_heap())
            res = await drv.run(between=between)
        box["after"] = await fetch_cache_metrics(base_url, api_key)
        return res
    res = asyncio.run(main())
    return res, metrics_delta(box.get("before"), box.get("after"))
