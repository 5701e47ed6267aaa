"""``kvflow bench cluster``: one instance vs N kvflow workers behind SGLang's gateway (``smg``).

The same many-workflow workload (:mod:`.workload`: ``workflows`` concurrent cycles of ``agents``
agents, hints v1 with every call) runs, side by side in one command,

1. on one worker, directly (the baseline);
2. on ``workers`` workers behind the gateway, once per routing policy (``cache_aware``,
   ``round_robin``, ``manual`` + ``x-smg-routing-key`` with ``min_group`` assignment,
   ``consistent_hashing``): the same workers every time, caches flushed in between, a fresh
   gateway per policy;
3. a fault run with the cluster's default policy: when ``kill_at`` of the measured calls are done
   the busiest worker is SIGKILLed, restarted ``down_s`` later on its port, and the run goes on.

Per run: share of workflows whose calls all reached one instance (``x-kvflow-instance``
response header), prompt-token hit rate (``usage.prompt_tokens_details.cached_tokens``) and its
ratio to the single instance, calls per instance and max/mean, throughput, and hints accepted by
the workers (their ``kvflow_hints_total`` counters) vs hinted calls sent. The fault run adds
failed requests, workflows moved, and the hit-rate recovery time: from the restart (and from the
kill) until the rolling hit rate of the last ``workflows`` calls is back to 90% of its value
before the kill.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from .server import serve_args
from .driver import WorkflowDriver
from .workload import CallRecord, WorkloadSpec, summarize_calls, token_counter

DEFAULT_POLICIES = ("cache_aware", "round_robin", "manual", "consistent_hashing")
RECOVERY_FRACTION = 0.9


@dataclass
class ClusterBenchConfig:
    spec: WorkloadSpec = field(default_factory=lambda: WorkloadSpec(
        agents=10, fixed=256, dynamic=32, output=8, rounds=2, warmup_rounds=1, workflows=24))
    workers: int = 3
    model: str = "tiny-random"
    serve_policy: str = "kvflow"
    device_tokens: int = 16384
    host_tokens: int = 65536
    page_size: int = 16
    max_batch: int = 16
    policies: Sequence[str] = DEFAULT_POLICIES
    fault: bool = True
    fault_policy: str = "manual"
    fault_rounds: int = 6
    kill_at: float = 0.3
    down_s: float = 5.0
    stream: bool = False

    def validate(self) -> None:
        from kvflow_agents.cluster import POLICIES

        self.spec.validate()
        if self.workers < 2:
            raise ValueError("workers: a cluster needs at least 2")
        for p in [*self.policies, self.fault_policy]:
            if p not in POLICIES:
                raise ValueError(f"policy {p!r}: choose from {', '.join(POLICIES)}")
        if not 0 < self.kill_at < 1:
            raise ValueError("kill_at: a fraction of the measured calls, in (0, 1)")
        if self.fault_rounds < 2:
            raise ValueError("fault_rounds: at least 2 (one before the kill, one after)")

    def serve_args(self) -> list[str]:
        return serve_args(model=self.model, policy=self.serve_policy, device_tokens=self.device_tokens,
                          host_tokens=self.host_tokens, page_size=self.page_size, host_link_gbps=None,
                          lookahead=1, max_batch=self.max_batch)


# ------------------------------------------------------------------------------ measuring
_HINTS_RE = re.compile(r'^kvflow_hints_total\{result="accepted"\}\s+([0-9.eE+-]+)', re.M)


def hints_accepted(urls: Sequence[str]) -> int:
    """Sum of the workers' ``kvflow_hints_total{result="accepted"}`` (0 for a dead worker)."""
    import httpx

    total = 0
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        for u in urls:
            try:
                m = _HINTS_RE.search(c.get(u + "/metrics").text)
                total += int(float(m.group(1))) if m else 0
            except httpx.HTTPError:
                pass
    return total


def flush_all(urls: Sequence[str], timeout_s: float = 30.0) -> None:
    """``/flush_cache`` on every worker (retried while a request is still finishing)."""
    import httpx

    with httpx.Client(timeout=10.0, trust_env=False) as c:
        for u in urls:
            deadline = time.monotonic() + timeout_s
            while c.post(u + "/flush_cache").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{u}/flush_cache kept refusing")
                time.sleep(0.2)


def affinity(calls: Sequence[CallRecord]) -> tuple[float, dict[int, set]]:
    """(share of workflows whose answered calls all came from one instance, workflow → set)."""
    where: dict[int, set] = defaultdict(set)
    for c in calls:
        if c.ok and c.instance:
            where[c.workflow].add(c.instance)
    if not where:
        return 0.0, where
    return sum(1 for s in where.values() if len(s) == 1) / len(where), where


def load_balance(calls: Sequence[CallRecord]) -> tuple[dict[str, int], Optional[float]]:
    per = Counter(c.instance for c in calls if c.ok and c.instance)
    if not per:
        return {}, None
    mean = sum(per.values()) / len(per)
    return dict(sorted(per.items())), max(per.values()) / mean


def run_summary(name: str, calls: Sequence[CallRecord], measured_s: float, *, instances: int,
                hints_sent: int, hints_accepted_delta: Optional[int]) -> dict[str, Any]:
    measured = [c for c in calls if c.measured]
    s = summarize_calls(measured)
    share, _ = affinity(calls)
    per, imbalance = load_balance(measured)
    ok = [c for c in measured if c.ok]
    toks = sum(c.prompt_tokens + c.completion_tokens for c in ok)
    return {"name": name, "instances": instances, "calls": len(calls),
            "errors": sum(1 for c in calls if not c.ok), "measured_calls": len(measured),
            "hit_rate": s["hit_rate"], "device_hit_rate": s["device_hit_rate"], "affinity": share, "calls_per_instance": per,
            "load_max_over_mean": imbalance,
            # counted over the instances that answered; with an idle instance the mean is lower
            "idle_instances": max(0, instances - len(per)) if per else instances,
            "throughput_calls_s": len(ok) / measured_s if measured_s else None,
            "throughput_tokens_s": toks / measured_s if measured_s else None,
            "call_latency_mean_s": s["call_latency_mean_s"], "measured_s": measured_s,
            "hints_sent": hints_sent, "hints_accepted": hints_accepted_delta,
            "first_error": s["first_error"]}


def rolling_hit_rate(calls: Sequence[CallRecord], window: int) -> list[tuple[float, float]]:
    """(end time, hit rate of the last ``window`` answered calls), by completion order."""
    done = sorted((c for c in calls if c.ok and c.prompt_tokens), key=lambda c: c.start + c.latency_s)
    out, prompt, cached = [], 0, 0
    for i, c in enumerate(done):
        prompt += c.prompt_tokens
        cached += c.cached_tokens
        if i >= window:
            old = done[i - window]
            prompt -= old.prompt_tokens
            cached -= old.cached_tokens
        if i + 1 >= window:
            out.append((c.start + c.latency_s, cached / prompt if prompt else 0.0))
    return out


def recovery(points: Sequence[tuple[float, float]], target: float
             ) -> tuple[Optional[float], Optional[float]]:
    """(lowest rolling hit rate, the time from which it stays >= ``target`` to the end of
    ``points``): the first point after the last one below the target; the first point when none
    is below; ``None`` when the last point is still below (not recovered in this interval)."""
    if not points:
        return None, None
    dip = min(h for _, h in points)
    last_below = max((i for i, (_, h) in enumerate(points) if h < target), default=-1)
    if last_below == len(points) - 1:
        return dip, None
    return dip, points[last_below + 1][0]


def fault_summary(calls: Sequence[CallRecord], t_kill: float, t_up: float, killed: str,
                  window: int) -> dict[str, Any]:
    measured = [c for c in calls if c.measured]
    before = [c for c in measured if c.ok and c.start + c.latency_s <= t_kill]
    base = summarize_calls(before)["hit_rate"] or 0.0
    series = rolling_hit_rate(measured, window)
    target = RECOVERY_FRACTION * base

    dip, back_at = recovery([(t, h) for t, h in series if t_kill < t <= t_up], target)
    dip_up, back_up = recovery([(t, h) for t, h in series if t > t_up], target)
    failed = [c for c in calls if not c.ok]
    pre: dict[int, set] = defaultdict(set)
    post: dict[int, set] = defaultdict(set)
    for c in calls:
        if c.ok and c.instance:
            (pre if c.start + c.latency_s <= t_kill else post)[c.workflow].add(c.instance)
    on_killed = {w for w, s in pre.items() if killed in s}
    moved = {w for w in on_killed if post.get(w, set()) - pre[w]}
    back = {w for w in moved if killed in post.get(w, set())}
    return {"killed": killed, "down_s": t_up - t_kill, "failed_requests": len(failed),
            "failed_errors": sorted({(c.error or "")[:80] for c in failed})[:3],
            "workflows_on_killed": len(on_killed), "workflows_moved": len(moved),
            "workflows_moved_back": len(back),
            "hit_rate_before": base, "hit_rate_dip": dip,
            # stays at >= 90% of before from then until the restart (None: not before it)
            "recovery_s_from_kill": None if back_at is None else back_at - t_kill,
            "hit_rate_dip_after_restart": dip_up,
            "recovery_s_from_restart": None if back_up is None else max(0.0, back_up - t_up),
            "calls_after_restart": sum(1 for t, _ in series if t > t_up),
            "window_calls": window,
            "timeline": [(round(t - t_kill, 3), round(h, 4)) for t, h in series]}


# ------------------------------------------------------------------------------ running
def _drive(spec: WorkloadSpec, base_url: str, model: str, *, run_id: str, stream: bool,
           on_call: Optional[Callable[[CallRecord], None]] = None):
    driver = WorkflowDriver(spec, base_url, model, counter=token_counter(model), run_id=run_id,
                            stream=stream, on_call=on_call)
    return asyncio.run(driver.run())


def run(config: ClusterBenchConfig, *, progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Everything above, in one process; returns the JSON-able report."""
    from kvflow_agents.cluster import Cluster, Gateway, GatewayConfig

    config.validate()
    say = progress or (lambda _m: None)
    spec = config.spec
    model = config.model
    hinted_calls = spec.workflows * spec.agents * (spec.warmup_rounds + spec.rounds) + spec.workflows
    report: dict[str, Any] = {"config": {**asdict(config), "spec": spec.as_dict()}, "runs": []}
    t_start = time.time()
    cluster = Cluster(config.workers, config.serve_args(), GatewayConfig(policy=config.fault_policy))
    say(f"starting {config.workers} workers ({model}, {config.serve_policy})")
    for s in cluster.servers:  # workers only; each run gets its own gateway
        s.start()
    try:
        urls = cluster.worker_urls
        # 1. the single instance: worker 0, directly
        say("single instance")
        h0 = hints_accepted(urls)
        res = _drive(spec, urls[0] + "/v1", model, run_id="single", stream=config.stream)
        single = run_summary("1 instance", res.calls, res.measured_s, instances=1,
                             hints_sent=hinted_calls, hints_accepted_delta=hints_accepted(urls) - h0)
        report["runs"].append({**single, "policy": "direct"})
        flush_all(urls)
        # 2. N workers behind the gateway, one policy at a time
        for pol in config.policies:
            say(f"{config.workers} workers, gateway policy {pol}")
            gw = Gateway(urls, GatewayConfig(policy=pol)).start()
            try:
                h0 = hints_accepted(urls)
                res = _drive(spec, gw.url + "/v1", model, run_id=f"gw-{pol}", stream=config.stream)
                r = run_summary(f"{config.workers} x {pol}", res.calls, res.measured_s,
                                instances=config.workers, hints_sent=hinted_calls,
                                hints_accepted_delta=hints_accepted(urls) - h0)
            finally:
                gw.stop()
            report["runs"].append({**r, "policy": pol})
            flush_all(urls)
        # 3. the fault run
        if config.fault:
            report["fault"] = _fault_run(config, cluster, say)
    finally:
        cluster.stop()
    single_hr = report["runs"][0]["hit_rate"] or 0.0
    for r in report["runs"]:
        r["hit_rate_vs_single"] = (r["hit_rate"] / single_hr) if (single_hr and r["hit_rate"] is not None) else None
        r["throughput_vs_single"] = (r["throughput_calls_s"] / report["runs"][0]["throughput_calls_s"]
                                     if r["throughput_calls_s"] and report["runs"][0]["throughput_calls_s"] else None)
    report["wall_s"] = time.time() - t_start
    report["targets"] = check_targets(report)
    return report


def _fault_run(config: ClusterBenchConfig, cluster, say) -> dict[str, Any]:
    from kvflow_agents.cluster import Gateway, GatewayConfig

    spec = replace(config.spec, rounds=config.fault_rounds)
    total_measured = spec.workflows * spec.agents * spec.rounds
    kill_after = max(1, int(config.kill_at * total_measured))
    seen: list[CallRecord] = []
    events: dict[str, Any] = {}

    def crash_and_restart(victim: int) -> None:
        events["t_kill"] = time.perf_counter()
        cluster.kill_worker(victim)
        time.sleep(config.down_s)
        events["t_restart"] = time.perf_counter()
        events["restart_s"] = cluster.restart_worker(victim)
        events["t_up"] = time.perf_counter()

    def on_call(rec: CallRecord) -> None:
        seen.append(rec)
        if rec.measured and "thread" not in events and sum(c.measured for c in seen) >= kill_after:
            per = Counter(c.instance for c in seen if c.ok and c.instance)
            victim_id = per.most_common(1)[0][0] if per else "w1"
            events["victim"] = victim_id
            t = threading.Thread(target=crash_and_restart, args=(int(victim_id[1:]),), daemon=True)
            events["thread"] = t
            t.start()

    say(f"fault run: {config.fault_policy}, kill the busiest worker after {kill_after} measured "
        f"calls, restart it {config.down_s:g}s later")
    gw = Gateway(cluster.worker_urls, GatewayConfig(policy=config.fault_policy)).start()
    try:
        res = _drive(spec, gw.url + "/v1", config.model, run_id=f"fault-{config.fault_policy}",
                     stream=config.stream, on_call=on_call)
    finally:
        if "thread" in events:
            events["thread"].join(120)
        gw.stop()
    if "t_up" not in events:
        return {"policy": config.fault_policy, "error": "the kill never happened (run too short?)"}
    out = fault_summary(res.calls, events["t_kill"], events["t_up"], events["victim"],
                        window=spec.workflows)
    out.update(policy=config.fault_policy, restart_s=events["restart_s"],
               summary=run_summary(f"fault {config.fault_policy}", res.calls, res.measured_s,
                                   instances=config.workers, hints_sent=0, hints_accepted_delta=None))
    return out


# ------------------------------------------------------------------------------ targets, output
def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """With the cluster's key-aware policies: >= 90% of the single instance's hit rate, no
    instance above 1.5x the mean load."""
    out = []
    for r in report["runs"][1:]:
        if r["policy"] not in ("manual", "consistent_hashing"):
            continue
        hr, lb = r.get("hit_rate_vs_single"), r.get("load_max_over_mean")
        out.append({"run": r["name"], "hit_rate_vs_single>=0.9": hr is not None and hr >= 0.9,
                    "load_max_over_mean<=1.5": lb is not None and lb <= 1.5 and not r["idle_instances"]})
    return out


def _pct(x: Optional[float]) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 170))
    t = Table(title="kvflow bench cluster: 1 instance vs N behind SGLang's gateway (smg)")
    for col in ("run", "workflows on 1 instance", "hit rate", "vs single", "device hits", "calls per instance",
                "max/mean load", "calls/s", "vs single", "hints accepted/sent", "errors"):
        t.add_column(col, justify="left" if col in ("run", "calls per instance") else "right")
    for r in report["runs"]:
        per = " ".join(f"{k}:{v}" for k, v in (r["calls_per_instance"] or {}).items())
        t.add_row(r["name"], _pct(r["affinity"]), _pct(r["hit_rate"]), _num(r["hit_rate_vs_single"]),
                  _pct(r["device_hit_rate"]), per, _num(r["load_max_over_mean"]), _num(r["throughput_calls_s"], "{:.1f}"),
                  _num(r["throughput_vs_single"]),
                  f"{r['hints_accepted']}/{r['hints_sent']}", str(r["errors"]))
    con.print(t)
    f = report.get("fault")
    if f and "error" not in f:
        con.print(f"[bold]fault run[/] ({f['policy']}): killed {f['killed']} (SIGKILL), restarted after "
                  f"{f['down_s']:.1f}s (up in {f['restart_s']:.1f}s): {f['failed_requests']} failed requests, "
                  f"{f['workflows_moved']} of {f['workflows_on_killed']} of its workflows moved "
                  f"({f['workflows_moved_back']} moved back), hit rate {_pct(f['hit_rate_before'])} before, "
                  f"dip {_pct(f['hit_rate_dip'])}, back to 90% of it for good {_num(f['recovery_s_from_kill'], '{:.1f}s')} "
                  f"after the kill; after the restart: dip {_pct(f['hit_rate_dip_after_restart'])}, "
                  f"recovered in {_num(f['recovery_s_from_restart'], '{:.1f}s')} "
                  f"({f['calls_after_restart']} calls after it)")
    elif f:
        con.print(f"[red]fault run: {f['error']}[/]")
    for tg in report.get("targets", []):
        con.print(f"target {tg['run']}: hit rate >= 90% of single: {tg['hit_rate_vs_single>=0.9']}; "
                  f"max load <= 1.5x mean: {tg['load_max_over_mean<=1.5']}")


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, 2 if report.get("fault", {}).get("timeline") else 1, figsize=(13, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    names = [r["name"] for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["hit_rate_vs_single"] or 0 for r in runs], 0.4, label="hit rate vs 1 instance")
    ax.bar([i + 0.2 for i in x], [r["load_max_over_mean"] or 0 for r in runs], 0.4, label="max/mean calls per instance")
    ax.plot([i for i in x], [r["affinity"] for r in runs], "ko", label="share of workflows on 1 instance")
    ax.axhline(0.9, color="tab:blue", ls=":", lw=1)
    ax.axhline(1.5, color="tab:orange", ls=":", lw=1)
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_title("routing policies (same workload, same workers)")
    ax.legend(fontsize=7)
    f = report.get("fault") or {}
    if f.get("timeline"):
        ax = axes[0][1]
        ts = f["timeline"]
        ax.plot([t for t, _ in ts], [h for _, h in ts], lw=1.2)
        ax.axvline(0, color="red", ls="--", label=f"kill {f['killed']}")
        ax.axvline(f["down_s"], color="green", ls="--", label="restarted")
        ax.axhline(RECOVERY_FRACTION * (f["hit_rate_before"] or 0), color="gray", ls=":", label="90% of before")
        ax.set_xlabel("seconds since the kill")
        ax.set_ylabel(f"hit rate, last {f['window_calls']} calls")
        ax.set_title(f"fault run ({f['policy']}): {f['failed_requests']} failed requests")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
