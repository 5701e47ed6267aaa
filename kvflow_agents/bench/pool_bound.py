"""What no policy could have had on device with this pool: a same-pool bound for a bench run.

The oracle's pool never fills, so "(baseline - kvflow) / (baseline - oracle)" asks a bounded
pool for what only an unbounded one can do. This module asks the bounded question instead,
from a ``--raw`` run's per-call records (one server per policy, so every call of a policy's
run shares its pool). Call ``c`` wants its reusable prefix (what it found cached in any tier)
on device when it arrives at ``s``. At any moment ``t <= s`` the requests running then
(``holders(t)``) lock the pages they wrote, a prefix shared by one agent's requests once;
after ``t`` the link can bring back at most ``(s - t) / secs_per_page`` pages before ``c``
arrives. So however clairvoyant, a policy has at most ``room`` pages of it on device::

    room(c) = min over t in {s, the ends of earlier requests} of
              pool - pages(holders(t)) + (s - t + slack) / secs_per_page   (t < s; at s: no load)
    bound(c) = max(0, want(c) - room(c))       (moments where c's own agent holds: no limit)

Summed over the measured calls, ``device miss`` (reusable tokens not on device at arrival) is
compared with the bound, and the share of hicache's excess over the bound that a policy
removes is its **same-pool saving** (1.0: nothing left to win). ``slack`` (GAP_SLACK_S) keeps
it a lower bound although the records are the client's (no call of the runs checked beats it;
``beat_bound`` counts those that do). The oracle's pool grows: no bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from kvflow_agents.serving.policy.policies import is_reference


@dataclass(frozen=True)
class CallBound:
    workflow: int
    agent: str
    want_tokens: int      # reusable prefix: cached in any tier at arrival
    device_miss: int      # of it, not on device at arrival
    held_pages: int       # pages it could not have had: pool minus the tightest room
    bound_tokens: int     # misses no policy avoids with this pool


GAP_SLACK_S = 0.02
"""Seconds added to every gap: the records are client-side, and a request reaches the server
a few ms after the client sends it and finishes there a few ms before the client reads its
last chunk (HTTP, SSE, the framework's hand-off), so the server's gaps are longer."""


def call_bounds(calls: Sequence[dict], pool_tokens: int, page_size: int,
                secs_per_page: float = 0.0, slack_s: float = GAP_SLACK_S) -> list[CallBound]:
    """Per measured call (records as ``kvflow bench peer --raw`` writes them). ``secs_per_page``:
    the host link's time per page (0: loads are instant, so any gap hides any load)."""
    pool = pool_tokens // page_size
    out: list[CallBound] = []
    done = [c for c in calls if c.get("ok", True) and c.get("latency_s") is not None]
    for c in done:
        if not c.get("measured"):
            continue
        start = c["start"]
        others = [q for q in done if q is not c]  # every workflow on this server
        # moments that constrain: its arrival (requests still running: nothing can be loaded
        # into their pages) and each earlier request's end (loads may follow, in the gap)
        moments = [(start, False)] + [(_end(q), True) for q in others if _end(q) <= start]
        room = pool
        for t, ended in moments:
            loadable = 0
            if ended:
                gap = start - t + slack_s
                loadable = int(gap / secs_per_page) if secs_per_page > 0 else pool
                if loadable >= pool:
                    continue  # the link could refill the whole pool since: no limit (and O(n))
            holders = [q for q in others if q["start"] < t < _end(q) or (ended and _end(q) == t)]
            if not holders or any(q["agent"] == c["agent"] for q in holders):
                continue  # nothing held, or its own prefix is held (on device) then
            room = min(room, pool - _pages_held(holders, page_size) + loadable)
        host = c.get("host_hit_tokens") or 0  # None: the server does not say (then 0)
        want = (c.get("device_hit_tokens") or 0) + host
        bound_pages = max(0, -(-want // page_size) - max(0, room))
        out.append(CallBound(c["workflow"], c["agent"], want, host,
                             pool - room if room < pool else 0, min(want, bound_pages * page_size)))
    return out


def _end(q: dict) -> float:
    return q["start"] + q["latency_s"]


def _pages_held(holders: Sequence[dict], page_size: int) -> int:
    """Pages the holders' requests occupy, a prefix shared by holders of one agent once (each
    reused its agent's prefix: the smallest such reuse is what they all share)."""
    groups: dict[str, list[dict]] = {}
    for q in holders:
        groups.setdefault(q["agent"], []).append(q)
    total = 0
    for g in groups.values():
        # KV written: the prompt and every output token but the last (never fed back)
        total += sum(math.ceil((q["prompt_tokens"] + max(0, q["completion_tokens"] - 1)) / page_size)
                     for q in g)
        if len(g) > 1:
            shared = min(((q.get("device_hit_tokens") or 0) + (q.get("host_hit_tokens") or 0)) // page_size
                         for q in g)
            total -= (len(g) - 1) * shared
    return total


def totals(calls: Sequence[dict], *, pool_tokens: int, page_size: int, secs_per_page: float = 0.0,
           slack_s: float = GAP_SLACK_S, growable: bool = False) -> dict:
    """One policy's run: reusable tokens, those missing from device at arrival, the bound (None
    for a growable pool, the oracle's), calls that beat it (then it is not one), by agent."""
    cb = call_bounds(calls, pool_tokens, page_size, secs_per_page, slack_s)
    return {"calls": len(cb), "want_tokens": sum(b.want_tokens for b in cb),
            "device_miss": sum(b.device_miss for b in cb),
            "bound": None if growable else sum(b.bound_tokens for b in cb),
            "beat_bound": 0 if growable else sum(1 for b in cb if b.device_miss < b.bound_tokens),
            "by_agent": _by_agent(cb)}


def same_pool_saving(base_miss: Optional[int], miss: Optional[int], bound: Optional[int]) -> Optional[float]:
    """(hicache's miss - this miss) / (hicache's miss - this run's bound): 1.0 = at the bound
    (each run's own bound: outputs and timing differ a little between runs)."""
    if base_miss is None or miss is None or bound is None or base_miss - bound <= 0:
        return None
    return (base_miss - miss) / (base_miss - bound)


def secs_per_page(model: str, page_size: int, link_gbps: Optional[float]) -> float:
    """The emulated link's time per page for an embedded model preset (0: real copy speed)."""
    if not link_gbps:
        return 0.0
    from kvflow_agents.serving.embedded.model.config import get_preset

    return get_preset(model).kv_bytes_per_token * page_size / (link_gbps * 1e9)


def summarize(doc: dict, slack_s: float = GAP_SLACK_S) -> dict:
    """Per policy: device-missing reusable tokens, the same-pool bound, and (against hicache)
    the same-pool saving. ``doc`` is a ``kvflow bench peer --raw --json`` file."""
    server = doc.get("server") or {}
    pool, ps = server.get("device_tokens"), server.get("page_size")
    if not pool or not ps:
        raise ValueError("the JSON has no server.device_tokens / page_size (a --base-url run?)")
    link = server.get("host_link_gbps")
    bpt = (doc.get("calibration") or {}).get("kv_bytes_per_token")
    spp = (bpt * ps / (link * 1e9) if link and bpt
           else secs_per_page(server.get("model") or "", ps, link) if link else 0.0)
    variants = server.get("variants") or {}
    rows: dict[str, dict] = {}
    for name, res in (doc.get("policies") or {}).items():
        calls = ((res.get("raw") or {}).get("calls"))
        if not calls:
            raise ValueError(f"{name}: no per-call records; run the bench with --raw")
        policy = (variants.get(name) or [name])[0]
        rows[name] = totals(calls, pool_tokens=pool, page_size=ps, secs_per_page=spp, slack_s=slack_s,
                            growable=is_reference(policy))
    base = rows.get("hicache")
    for name, r in rows.items():
        r["same_pool_saving"] = (same_pool_saving(base["device_miss"], r["device_miss"], r["bound"])
                                 if base is not None and name != "hicache" else None)
    return rows


def _by_agent(cb: Sequence[CallBound]) -> dict:
    agents: dict[str, list] = {}
    for b in cb:
        a = agents.setdefault(b.agent, [0, 0])
        a[0] += b.device_miss
        a[1] += b.bound_tokens
    return {k: {"device_miss": v[0], "bound": v[1]} for k, v in sorted(agents.items())}
