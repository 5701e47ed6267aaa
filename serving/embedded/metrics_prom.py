"""Prometheus exposition for ``GET /metrics``: a collector over the engine's published snapshot.

Each app gets its own ``CollectorRegistry`` (several servers can live in one test process). The
collector only reads ``engine.stats()``, which the engine thread publishes between steps, so a
scrape never waits for a model step. Names (all prefixed ``kvflow_``):

- ``prompt_tokens_by_tier_total{tier=device|host|loading|miss}``: where each prompt token's KV
  was found when its request was first matched (miss = recomputed);
- ``evictions_total{tier,reason}``, ``evicted_pages_total{tier,reason}``, ``backup_pages_total``,
  ``dropped_pages_total``;
- ``prefetch_total{outcome=issued|used|wasted|stale|deferred}``, ``prefetch_wasted_total{reason=
  alloc|grow|load|prefetch|flush|workflow_end}`` (what took each wasted one),
  ``prefetch_evicted_pages_total`` (unread prefetched pages evicted, wasted or a tail),
  ``demand_loads_total``;
- ``load_seconds_total{kind=hidden|exposed}``: load time overlapped with compute vs waited for;
- ``queue_depth{state=waiting|loading|running}``, ``loads_in_flight``,
  ``pool_pages{tier,kind=capacity|used|reserved}`` (reserved: running requests' decode pages
  not allocated yet), ``device_hit_rate``;
- ``requests_total``, ``requests_finished_total{reason}``, ``tokens_total{kind}``,
  ``hints_total{result=accepted|rejected}``, ``engine_step_failures_total`` (failures no single
  request caused; request-caused ones finish that request with reason ``error``),
  ``kv_cache_resets_total`` (a copy failed on the copy thread: requests failed, cache dropped);
  ``engine_steps_total{kind=all|decode}``, ``model_forward_seconds_total{phase=prefill|decode}``
  (the model's share of the engine thread; per decode step, how fast this process runs),
  ``engine_busy_seconds_total`` (steps that did something, all of their wall time),
  ``engine_cpu_seconds_total{scope=thread|process}`` (the engine thread's CPU, and its
  process's);
- ``process_cpu_seconds_total`` and the rest of prometheus_client's process collector: this
  (the HTTP) process;
- the hint registry's bounded state: ``hint_workflows{state=live|expired}``, ``hint_agents``,
  ``hint_clients`` (tenants with a live workflow), ``hint_workflows_removed_total{reason=
  forgotten|evicted|released}``, ``hint_agents_dropped_total``; ``client_cap_pages`` (the
  per-tenant cap in force, 0 = none).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# (tier:reason) keys of the manager's eviction counters: device evictions to make room for an
# admission ("alloc"), a decode page ("grow"), a demand load ("load"), a prefetch ("prefetch")
# or a flush; host evictions to make room for a backup.
EVICTION_KEYS = ("device:alloc", "device:grow", "device:load", "device:prefetch", "device:flush",
                 "host:backup")
WASTE_REASONS = ("alloc", "grow", "load", "prefetch", "flush", "workflow_end")


class EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        c, m = s["counters"], s["cache"]

        def counter(name, doc, value=None, labels=None, samples=()):
            fam = CounterMetricFamily("kvflow_" + name, doc, value=value, labels=labels)
            for lv, v in samples:
                fam.add_metric(lv, v)
            return fam

        def gauge(name, doc, value=None, labels=None, samples=()):
            fam = GaugeMetricFamily("kvflow_" + name, doc, value=value, labels=labels)
            for lv, v in samples:
                fam.add_metric(lv, v)
            return fam

        yield counter("requests", "Requests submitted.", c["requests"])
        yield counter("requests_finished", "Requests finished, by reason.", labels=["reason"], samples=[
            (["completed"], c["finished"] - c["aborted"] - c["errors"]), (["abort"], c["aborted"]),
            (["error"], c["errors"])])
        yield counter("tokens", "Tokens processed.", labels=["kind"], samples=[
            (["prompt"], c["prompt_tokens"]), (["generated"], c["generation_tokens"]),
            (["cached"], c["cached_tokens"])])
        yield counter("hints", "Requests' kvflow hints, by parse result.", labels=["result"], samples=[
            (["accepted"], c["hints_accepted"]), (["rejected"], c["hints_rejected"])])
        yield counter("prompt_tokens_by_tier", "Prompt tokens by where their KV was found at match time.",
                      labels=["tier"], samples=[
                          (["device"], m["hit_tokens_device"]), (["host"], m["hit_tokens_host"]),
                          (["loading"], m["hit_tokens_loading"]), (["miss"], m["miss_tokens"])])

        def split(d):
            # Every (tier, reason) the manager can report, zero until it happens: a family's
            # series must not appear and vanish between scrapes or differ between instances
            # (SGLang's gateway merges the workers' families for /engine_metrics).
            for key, v in sorted({**dict.fromkeys(EVICTION_KEYS, 0), **d}.items()):
                tier, _, reason = key.partition(":")
                yield [tier, reason or "-"], v
        yield counter("evictions", "Nodes evicted, by tier and reason.", labels=["tier", "reason"],
                      samples=split(m["evictions"]))
        yield counter("evicted_pages", "Pages evicted, by tier and reason.", labels=["tier", "reason"],
                      samples=split(m["evicted_pages"]))
        yield counter("backup_pages", "Device pages written through to host.", m["backup_pages"])
        yield counter("dropped_pages", "Device pages evicted with no host copy.", m["dropped_pages"])
        yield counter("prefetch", "Prefetches, by outcome.", labels=["outcome"], samples=[
            ([k], m["prefetch_" + k]) for k in ("issued", "used", "wasted", "stale", "deferred")])
        wasted_by = {**dict.fromkeys(WASTE_REASONS, 0), **m.get("prefetch_wasted_by", {})}
        yield counter("prefetch_wasted", "Prefetches evicted (or their workflow ended) before any "
                      "use, by what took them.", labels=["reason"],
                      samples=[([r], v) for r, v in sorted(wasted_by.items())])
        yield counter("prefetch_evicted_pages", "Prefetched pages evicted unread (a whole "
                      "prefetch, or a tail whose head stayed).", m.get("prefetch_evicted_pages", 0))
        yield counter("demand_loads", "Host->device loads started on demand.", m["demand_loads"])
        yield counter("retractions", "Running requests sent back to wait: no room to decode past "
                      "their optimistic reserve (--decode-reserve).", m.get("retractions", 0))
        yield counter("load_seconds", "Host->device load time, hidden behind compute or exposed.",
                      labels=["kind"], samples=[(["hidden"], m["load_hidden_s"]),
                                                (["exposed"], m["load_exposed_s"])])
        yield counter("admission_passed_over", "Waiting requests an admission pass went past "
                      "(once per pass), by why: not ready, their prefix loading or its load "
                      "waiting for room (the status-aware skip), or another workflow's call "
                      "loading ahead of them (--skip-scope workflow).",
                      labels=["reason"], samples=[([k], v) for k, v in
                                                  sorted(s.get("admission_passes", {}).items())])
        yield gauge("queue_depth", "Requests by scheduler state.", labels=["state"],
                    samples=[([k], s["queue"].get(k, 0)) for k in ("waiting", "loading", "running")])
        yield gauge("loads_in_flight", "Host->device loads in flight.", s["loads_in_flight"])
        yield gauge("pool_pages", "KV pool pages.", labels=["tier", "kind"], samples=[
            (["device", "capacity"], s["device_pages"]["capacity"]),
            (["device", "used"], s["device_pages"]["used"]),
            (["device", "reserved"], s["device_pages"].get("reserved", 0)),
            (["host", "capacity"], s["host_pages"]["capacity"]),
            (["host", "used"], s["host_pages"]["used"])])
        yield gauge("device_hit_rate", "Prompt tokens found on device / all prompt tokens.",
                    m["device_hit_rate"])
        yield counter("engine_step_failures", "Engine steps that failed for no single request.",
                      c.get("step_failures", 0))
        yield counter("kv_cache_resets", "Cache resets after a KV copy failed on the copy thread "
                      "(every request held then failed).", c.get("cache_resets", 0))
        yield counter("engine_steps", "Engine steps, and those that ran a batched decode.",
                      labels=["kind"], samples=[(["all"], c.get("steps", 0)),
                                                (["decode"], c.get("decode_steps", 0))])
        yield counter("model_forward_seconds", "Wall time in the model's forwards on the engine "
                      "thread, by phase (the rest of a step is scheduling, cache and sampling).",
                      labels=["phase"], samples=[(["prefill"], c.get("prefill_forward_s", 0.0)),
                                                 (["decode"], c.get("decode_forward_s", 0.0))])
        yield counter("engine_busy_seconds", "Wall time of the engine steps that did something "
                      "(forwards, KV copies, scheduling and cache work between them).",
                      c.get("busy_s", 0.0))
        cpu = s.get("cpu") or {}
        yield counter("engine_cpu_seconds", "CPU time of the engine thread, and of the process "
                      "holding the engine (its own with --engine-process; else this one).",
                      labels=["scope"], samples=[(["thread"], cpu.get("thread_cpu_s", 0.0)),
                                                 (["process"], cpu.get("process_cpu_s", 0.0))])
        kc = s.get("kv_copies") or {}
        yield counter("kv_copy_seconds", "Wall time copying KV between the tiers, by direction "
                      "(CPU: on the engine thread unless --copy-thread).",
                      labels=["direction"], samples=[(["load"], kc.get("load_s", 0.0)),
                                                     (["backup"], kc.get("backup_s", 0.0))])
        yield counter("kv_copy_pages", "KV pages copied between the tiers, by direction.",
                      labels=["direction"], samples=[(["load"], kc.get("load_pages", 0)),
                                                     (["backup"], kc.get("backup_pages", 0))])
        h = s.get("hints")
        if h is not None:
            yield gauge("hint_workflows", "Workflows in the hint registry.", labels=["state"],
                        samples=[(["live"], h["live"]), (["expired"], h["expired"])])
            yield gauge("hint_agents", "Agents held by the hint registry.", h["agents"])
            yield gauge("hint_clients", "Clients (tenants) with a live workflow.", h["clients"])
            yield counter("hint_workflows_removed", "Workflows removed from the hint registry.",
                          labels=["reason"], samples=[([k], h[k]) for k in ("forgotten", "evicted", "released")])
            yield counter("hint_agents_dropped", "Agents dropped over the per-workflow bound.",
                          h["agents_dropped"])
        yield gauge("client_cap_pages", "Device pages one client's hints may protect (0: no cap).",
                    s.get("client_cap_pages") or 0)


def make_registry(engine) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))
    ProcessCollector(registry=reg)  # process_* of this (the HTTP) process; Linux only, else none
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
