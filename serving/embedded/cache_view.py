"""What ``GET /kvflow/v1/cache`` shows: per workflow and agent, where its fixed prefix lives.

Built on the engine thread from ``KVCacheManager.snapshot()`` (after a ``tick`` so finished
loads read as ``device``). Sizes are in tokens, not pages, for a person debugging an app:

    {"policy": "kvflow", "page_size": 16,
     "pools": {"device": {"capacity_tokens", "used_tokens", "tree_tokens", "free_tokens",
                          "evictable_tokens", "reserved_tokens"},
               "host": {...}},
     "workflows": [{"workflow": "thread-7", "expired": false, "step": 3,
                    "agents": [{"agent": "planner", "residency": "device|loading|host|none",
                                "ste": 1, "priority": 1, "tokens": 480}]}],
     "queue": {"waiting", "loading", "running"}, "loads_in_flight": 0,
     "link": {"emulated_gbps": 0.5 | null}, "metrics": {...},
     "gaps": {"turn_gaps", "open_tool", "open_turn", "tool_opened", "turns_opened",
              "closed_by_request", "tool_expired", "agents_learned", "turns_tracked"},
     "engine": {"steps", "decode_steps", "prefill_forward_s", "decode_forward_s",
                "layerwise_loads", "layerwise_wait_s", "copy_s", "busy_s",
                "thread_cpu_s", "process_cpu_s"},
     "http": {"process_cpu_s"}}   # (added by the server: its HTTP process)

``engine.copy_s``: wall seconds copying KV between the tiers (loads and backups; CPU: on the
engine thread, or on the copy thread with ``--copy-thread``; CUDA: the launches and the
backups' synchronous reads). A GPU's copy engine does the loads beside the forwards; on a CPU
they take the forwards' cores, which is what this counter shows. ``engine.layerwise_loads``:
prefills admitted while a load on their prefix was in flight (``--layerwise-load``), each
reading a layer as it landed; ``layerwise_wait_s``: the seconds they waited on those layers
(their compute hid the rest, counted in ``metrics.load_hidden_s``). ``engine.busy_s``: wall
seconds of the engine's steps that did something (forwards, copies, scheduling and cache work
between them); ``thread_cpu_s`` / ``process_cpu_s``: CPU seconds so far of the engine thread
and of the process holding it (its own with ``--engine-process``). The benches take their
differences over measured rounds: what a policy's engine costs per call beside its forwards.

``ste``/``priority`` ``null`` mean infinity (never again / not protected). With a ``tenant``
(the server's tenancy), only that tenant's workflows are listed, under the ids it sent.
"""

from __future__ import annotations

import math
import time
from typing import Optional


# the engine's own counters a report carries beside the cache's: the benches read a process's
# speed off them (model seconds per decode step) to pair trials run on different processes
ENGINE_COUNTERS = ("steps", "decode_steps", "prefill_forward_s", "decode_forward_s",
                   "layerwise_loads", "layerwise_wait_s", "busy_s")


def engine_cpu_times() -> dict:
    """CPU seconds so far of the calling thread and of its process. Called on the engine thread
    (``EngineLoop._publish``, :func:`cache_report`), it reads the engine thread's own CPU and
    that of the process holding the engine (the engine's process with ``--engine-process``,
    else the whole server): against ``busy_s``, what the engine spends beside its steps."""
    return {"thread_cpu_s": time.thread_time(), "process_cpu_s": time.process_time()}


def cache_report(engine, tenant: Optional[str] = None) -> dict:
    from ..tenancy import visible_key

    mgr = engine.manager
    mgr.tick(engine.pool.now())
    snap = mgr.snapshot()
    ps = snap["page_size"]

    def tokens(pool: dict) -> dict:
        return {"capacity_tokens": pool["capacity"] * ps, "used_tokens": pool["used"] * ps,
                "free_tokens": pool["free"] * ps, "tree_tokens": pool["tree"] * ps,
                **({"evictable_tokens": pool["evictable"] * ps} if "evictable" in pool else {}),
                **({"reserved_tokens": pool["reserved"] * ps} if "reserved" in pool else {})}

    def num(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        return int(x) if isinstance(x, float) and x.is_integer() else x

    workflows: dict[str, dict] = {}
    for wf, info in snap["workflows"].items():
        name = visible_key(wf, tenant)
        if name is not None:
            workflows[wf] = {"workflow": name, **{k: num(v) for k, v in info.items()}, "agents": []}
    for a in snap["agents"]:
        name = visible_key(a["workflow"], tenant)
        if name is None:
            continue
        wf = workflows.setdefault(a["workflow"], {"workflow": name, "agents": []})
        wf["agents"].append({"agent": a["agent"], "residency": a["residency"], "ste": num(a["ste"]),
                             "priority": num(a["priority"]), "tokens": a["tokens"],
                             "demoted": a["demoted"]})
    return {
        "policy": snap["policy"], "page_size": ps, "model": engine.model_name,
        "pools": {"device": tokens(snap["pools"]["device"]), "host": tokens(snap["pools"]["host"])},
        "workflows": list(workflows.values()),
        "queue": engine.scheduler.counts(),
        "loads_in_flight": snap["loads_in_flight"],
        "link": {"emulated_gbps": engine.config.host_link_gbps},
        "metrics": {k: num(v) for k, v in snap["metrics"].items()},
        "gaps": snap["gaps"],
        "engine": {**{k: engine.counters[k] for k in ENGINE_COUNTERS},
                   "copy_s": engine.pool.stats["load_s"] + engine.pool.stats["backup_s"],
                   **engine_cpu_times()},  # (this runs on the engine thread)
    }


def residency_of(report: dict, workflow: str, agent: str) -> str:
    """Convenience for tests and tools: one agent's residency in a report ("none" if absent)."""
    for wf in report["workflows"]:
        if wf["workflow"] == workflow:
            for a in wf["agents"]:
                if a["agent"] == agent:
                    return a["residency"]
    return "none"


def render_text(report: dict) -> str:
    """A plain-text table of a report, for ``curl .../kvflow/v1/cache?format=text``."""
    def inf(x):
        return "inf" if x is None else str(x)
    dev, host = report["pools"]["device"], report["pools"]["host"]
    lines = [f"policy {report['policy']}  page {report['page_size']}  "
             f"device {dev['used_tokens']}/{dev['capacity_tokens']} tokens  "
             f"host {host['used_tokens']}/{host['capacity_tokens']} tokens  "
             f"loads in flight {report['loads_in_flight']}  queue {report['queue']}",
             f"{'workflow':<24} {'agent':<20} {'residency':<9} {'ste':>5} {'prio':>5} {'tokens':>7}"]
    for wf in report["workflows"]:
        for a in wf["agents"]:
            lines.append(f"{wf['workflow'][:24]:<24} {a['agent'][:20]:<20} {a['residency']:<9} "
                         f"{inf(a['ste']):>5} {inf(a['priority']):>5} {a['tokens']:>7}")
    return "\n".join(lines) + "\n"
