"""What no policy could have had on device with this pool: a same-pool bound for a bench run.

The oracle's pool never fills, so "(baseline - kvflow) / (baseline - oracle)" asks a bounded
pool for what only an unbounded one can do. This module asks the bounded question instead,
from a ``--raw`` run's per-call records (one server per policy, so every call of a policy's
run shares its pool): when call ``c`` arrives, the requests that held device
pages just before it (those still running, and the one that finished last, whose pages were
locked until ``gap`` seconds before) are ``held`` pages; ``c``'s reusable prefix (what it found
cached in any tier) is ``want`` pages. Any policy, however clairvoyant, has at most ``pool -
held`` of them on device while those run, and can load at most ``gap x link`` pages more in the
gap (none if a holder still runs), so at least this many are missing at arrival::

    bound(c) = max(0, want(c) + held(c) - pool - gap(c) x link / page bytes)
                                                        (pages; 0 if a holder is c's agent)

A holder of ``c``'s own agent shares its prefix (counted once), so those calls get 0: the
bound stays a lower bound. Summed over the measured calls, ``device miss`` (reusable tokens
not on device at arrival) is compared with the bound, and the share of hicache's excess over
the bound that a policy removes is its **same-pool saving** (1.0: nothing left to win).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class CallBound:
    workflow: int
    agent: str
    want_tokens: int      # reusable prefix: cached in any tier at arrival
    device_miss: int      # of it, not on device at arrival
    held_pages: int       # pages of the requests holding the pool just before it arrived
    bound_tokens: int     # misses no policy avoids with this pool


def call_bounds(calls: Sequence[dict], pool_tokens: int, page_size: int,
                secs_per_page: float = 0.0) -> list[CallBound]:
    """Per measured call (records as ``kvflow bench peer --raw`` writes them). ``secs_per_page``:
    the host link's time per page (0: loads are instant, so a gap hides any load)."""
    pool = pool_tokens // page_size
    out: list[CallBound] = []
    done = [c for c in calls if c.get("ok", True) and c.get("latency_s") is not None]
    for c in done:
        if not c.get("measured"):
            continue
        start = c["start"]
        others = [q for q in done if q is not c]  # every workflow on this server
        running = [q for q in others if q["start"] < start < q["start"] + q["latency_s"]]
        ended = [q for q in others if q["start"] + q["latency_s"] <= start]
        last = max(ended, key=lambda q: q["start"] + q["latency_s"]) if ended else None
        holders = running + ([last] if last is not None else [])
        held = sum(math.ceil((q["prompt_tokens"] + q["completion_tokens"]) / page_size) for q in holders)
        if running or last is None:
            in_gap = 0
        else:
            gap = max(0.0, start - (last["start"] + last["latency_s"]))
            in_gap = int(gap / secs_per_page) if secs_per_page > 0 else (pool if gap > 0 else 0)
        want = c["device_hit_tokens"] + c["host_hit_tokens"]
        shares = any(q["agent"] == c["agent"] for q in holders)
        bound_pages = 0 if shares else max(0, -(-want // page_size) + held - pool - in_gap)
        out.append(CallBound(c["workflow"], c["agent"], want, c["host_hit_tokens"], held,
                             min(want, bound_pages * page_size)))
    return out


def summarize(doc: dict) -> dict:
    """Per policy: device-missing reusable tokens, the same-pool bound, and (against hicache)
    the same-pool saving. ``doc`` is a ``kvflow bench peer --raw --json`` file."""
    server = doc.get("server") or {}
    pool, ps = server.get("device_tokens"), server.get("page_size")
    if not pool or not ps:
        raise ValueError("the JSON has no server.device_tokens / page_size (a --base-url run?)")
    link = server.get("host_link_gbps")
    bpt = (doc.get("calibration") or {}).get("kv_bytes_per_token")
    spp = bpt * ps / (link * 1e9) if link and bpt else 0.0
    rows: dict[str, dict] = {}
    for name, res in (doc.get("policies") or {}).items():
        calls = ((res.get("raw") or {}).get("calls"))
        if not calls:
            raise ValueError(f"{name}: no per-call records; run the bench with --raw")
        cb = call_bounds(calls, pool, ps, spp)
        rows[name] = {"calls": len(cb), "want_tokens": sum(b.want_tokens for b in cb),
                      "device_miss": sum(b.device_miss for b in cb),
                      "bound": sum(b.bound_tokens for b in cb),
                      "by_agent": _by_agent(cb)}
    for name in rows:  # a growable pool (the oracle's) has no bound
        if _policy_of(doc, name) == "oracle":
            rows[name]["bound"] = None
    base = rows.get("hicache")
    for name, r in rows.items():
        ok = base is not None and name != "hicache" and r["bound"] is not None
        r["same_pool_saving"] = _saving(base, r) if ok else None
    return rows


def _policy_of(doc: dict, name: str) -> str:
    """A column's policy (a ``--policy-variant`` column names its own)."""
    return ((doc.get("policies") or {}).get(name) or {}).get("policy") or name


def _by_agent(cb: Sequence[CallBound]) -> dict:
    agents: dict[str, list] = {}
    for b in cb:
        a = agents.setdefault(b.agent, [0, 0])
        a[0] += b.device_miss
        a[1] += b.bound_tokens
    return {k: {"device_miss": v[0], "bound": v[1]} for k, v in sorted(agents.items())}


def _saving(base: dict, me: dict) -> Optional[float]:
    """(hicache's miss - this miss) / (hicache's miss - the bound): 1.0 = at the bound."""
    room = base["device_miss"] - me["bound"]  # its own run's bound (outputs, timing differ a little)
    return (base["device_miss"] - me["device_miss"]) / room if room > 0 else None
