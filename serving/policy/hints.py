"""Hint registry: per (workflow, agent) STE from hints v1, with leases, bounds and step timing.

- A workflow's hints hold for ``lease_s`` seconds after its last hint; after that every agent of
  it counts as STE = +inf (a vanished client pins nothing). A new hint revives it.
- An expired workflow is *removed* ``forget_after_s`` later (default: one more lease): its key
  goes on the removed list, which the owner (:class:`~.manager.KVCacheManager`) drains with
  :meth:`HintRegistry.drain_removed` to drop the workflow's tags. So memory follows the live
  workflows, not every workflow ever seen.
- Bounded: at most ``max_workflows`` workflows and ``max_agents`` agents in all; a new one beyond
  that removes the oldest quiet workflow first (expired before live, least recently hinted
  first), never the one being updated. A workflow holds at most ``max_agents_per_workflow``
  agents: beyond it the agents absent from the current hint go, unreachable ones (+inf) and then
  the farthest first; they come back as changed to +inf.
- ``None`` / null in a hint means "unreachable": +inf.
- Updates merge: agents missing from a hint keep their last value (out-of-band transitions may
  carry a subset).
- Step time: when a workflow's ``step`` advances, the elapsed time per step feeds an EMA; the
  prefetch planner turns STE into seconds with it.
- Trust: hints are advisory, and a wrong one must not make the cache worse than none. Each
  request (a hint naming its ``agent``) checks the workflow's previous map: did it predict this
  agent next (its STE was at most the smallest positive STE there)? Hits and misses feed an
  EMA (``trust_ema``, starting at 1: a new workflow is trusted). Below ``distrust_below`` the
  workflow's hints count as absent (every agent +inf: LRU order, no prefetch), until the
  score climbs back above ``trust_above`` (hysteresis). Its predictions keep being scored.
- Clients (tenants) are counted over live workflows (:meth:`active_clients`), for fair shares.

Cost: every operation is O(agents in the hint) or amortised O(1) per workflow; :meth:`expire`
walks only the workflows that expire or are forgotten (two queues ordered by time).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

INF = math.inf


def workflow_key(workflow: str, app: str | None = None) -> str:
    """The id tags are filed under: ``app/workflow`` when an app is named, else ``workflow``."""
    return f"{app}/{workflow}" if app else str(workflow)


def as_ste(value) -> float:
    """Wire value -> STE: int/float >= 0, or +inf for None / negative / garbage (advisory)."""
    if value is None or isinstance(value, bool):
        return INF
    try:
        v = float(value)
    except (TypeError, ValueError):
        return INF
    return v if v >= 0 and not math.isnan(v) else INF


@dataclass
class WorkflowHints:
    key: str
    client: str
    ste: dict[str, float] = field(default_factory=dict)
    last_hint: float = 0.0
    expired: bool = False
    expired_at: float | None = None
    step: int | None = None
    step_at: float | None = None
    step_s: float | None = None       # EMA of seconds per step, None until measured
    trust: float = 1.0                # EMA of "the previous map predicted this agent next"
    trusted: bool = True
    scored: int = 0                   # predictions scored
    missed: int = 0
    since: tuple | None = None        # its first request's (arrival, sequence): admission order


class HintRegistry:
    """STE per (workflow, agent) with leases and bounds; who is a client (for per-client caps)."""

    def __init__(self, *, lease_s: float = 60.0, step_ema: float = 0.3, trust_ema: float = 0.25,
                 distrust_below: float = 0.5, trust_above: float = 0.7,
                 forget_after_s: float | None = None, max_workflows: int = 10_000,
                 max_agents_per_workflow: int = 1024, max_agents: int = 262_144) -> None:
        self.lease_s = lease_s
        self.step_ema = step_ema
        self.trust_ema, self.distrust_below, self.trust_above = trust_ema, distrust_below, trust_above
        self.forget_after_s = forget_after_s
        self.max_workflows = max_workflows
        self.max_agents_per_workflow = max_agents_per_workflow
        self.max_agents = max_agents
        self.workflows: dict[str, WorkflowHints] = {}
        # Invariant: every workflow is in exactly one of these, each ordered by time
        # (last hint / expiry), so the oldest quiet one is first.
        self._live: dict[str, None] = {}
        self._expired: dict[str, None] = {}
        self._removed: list[str] = []
        self._client_live: Counter = Counter()
        self.num_agents = 0
        self.counters = {"evicted": 0, "forgotten": 0, "released": 0, "agents_dropped": 0}

    def configure(self, **limits) -> None:
        """Set ``lease_s``, ``forget_after_s``, ``max_workflows``, ``max_agents_per_workflow``
        or ``max_agents`` (the engine does, from its config)."""
        for k, v in limits.items():
            if k not in ("lease_s", "forget_after_s", "max_workflows", "max_agents_per_workflow",
                         "max_agents"):
                raise TypeError(f"unknown registry limit {k!r}")
            if v is not None and k != "lease_s" and k != "forget_after_s" and v < 1:
                raise ValueError(f"{k} must be >= 1")
            setattr(self, k, v)

    # ---------------------------------------------------------------- updates
    def _score(self, w: WorkflowHints, agent: str) -> bool:
        """Score the previous map's prediction of ``agent``; True when ``w.trusted`` flipped."""
        prev = w.ste
        if not prev:
            return False
        nearest = min((v for v in prev.values() if 0 < v < INF), default=None)
        if nearest is None:
            return False  # the map named no future agent (only running ones): nothing to score
        hit = prev.get(agent, INF) <= nearest
        w.scored += 1
        w.missed += not hit
        w.trust = (1 - self.trust_ema) * w.trust + self.trust_ema * (1.0 if hit else 0.0)
        if w.trusted and w.trust < self.distrust_below:
            w.trusted = False
            return True
        if not w.trusted and w.trust > self.trust_above:
            w.trusted = True
            return True
        return False

    def update(self, wf: str, ste: dict, *, now: float, step: int | None = None,
               client: str | None = None, agent: str | None = None) -> tuple[dict[str, float], bool]:
        """Merge a hint. Returns ({agent: new raw STE} for agents whose value changed,
        whether every agent's effective value changed: the workflow was expired before, or its
        trust flipped). ``agent``: the agent sending the request (scores the previous map);
        while a workflow is distrusted, nothing is reported as changed (all count as +inf)."""
        w = self.workflows.get(wf)
        if w is None:
            self._make_room(wf)
            w = self.workflows[wf] = WorkflowHints(wf, client or wf, last_hint=now)
            self._client_live[w.client] += 1
        elif w.expired:
            self._expired.pop(wf, None)
            self._client_live[client or w.client] += 1
        else:
            self._live.pop(wf, None)
            if client and client != w.client:
                self._uncount(w.client)
                self._client_live[client] += 1
        self._live[wf] = None
        flipped = self._score(w, agent) if agent is not None else False
        revived = w.expired or flipped
        w.expired, w.expired_at = False, None
        w.last_hint = now
        if client:
            w.client = client
        changed = {}
        cur = w.ste
        before = len(cur)
        for a, value in ste.items():
            v = value if type(value) is int and value >= 0 else as_ste(value)
            if cur.get(a, INF) != v or a not in cur:
                changed[a] = v
            cur[a] = v
        self.num_agents += len(cur) - before
        if len(cur) > self.max_agents_per_workflow:
            for a in self._trim_agents(w, ste):
                changed[a] = INF
        if step is not None:
            self._observe_step(w, int(step), now)
        if self.num_agents > self.max_agents:
            self._make_room(wf, agents_only=True)
        return (changed if w.trusted else {}), revived

    def _trim_agents(self, w: WorkflowHints, keep) -> list[str]:
        """Drop agents beyond the per-workflow cap (not those in ``keep``): +inf, then farthest."""
        over = len(w.ste) - self.max_agents_per_workflow
        victims = sorted((a for a in w.ste if a not in keep), key=lambda a: -w.ste[a])[:over]
        for a in victims:
            del w.ste[a]
        self.num_agents -= len(victims)
        self.counters["agents_dropped"] += len(victims)
        return victims

    def _make_room(self, keep: str, agents_only: bool = False) -> None:
        """Remove the oldest quiet workflows (expired first, then least recently hinted) until a
        new workflow fits and the agent budget holds; never ``keep``."""
        def over() -> bool:
            return (self.num_agents > self.max_agents
                    or (not agents_only and len(self.workflows) >= self.max_workflows))
        while over():
            victim = next((k for q in (self._expired, self._live) for k in q if k != keep), None)
            if victim is None:
                return
            self._remove(victim)
            self.counters["evicted"] += 1

    def _observe_step(self, w: WorkflowHints, step: int, now: float) -> None:
        if w.step is not None and step > w.step and w.step_at is not None and now > w.step_at:
            per = (now - w.step_at) / (step - w.step)
            w.step_s = per if w.step_s is None else (1 - self.step_ema) * w.step_s + self.step_ema * per
        if w.step is None or step != w.step:
            w.step, w.step_at = step, now

    # ---------------------------------------------------------------- reads
    def ste(self, wf: str, agent: str) -> float:
        """Effective STE (inf if unknown or the lease expired at the last :meth:`expire`)."""
        w = self.workflows.get(wf)
        if w is None or w.expired or not w.trusted:
            return INF
        return w.ste.get(agent, INF)

    def step_seconds(self, wf: str, default: float) -> float:
        w = self.workflows.get(wf)
        return w.step_s if w is not None and w.step_s else default

    def step_elapsed(self, wf: str, now: float) -> float:
        """Seconds since the workflow's current step began (0 if unknown)."""
        w = self.workflows.get(wf)
        if w is None or w.step_at is None:
            return 0.0
        return max(0.0, now - w.step_at)

    def client_of(self, wf: str) -> str:
        w = self.workflows.get(wf)
        return w.client if w is not None else wf

    def active_clients(self) -> int:
        """Distinct clients with at least one live (not expired) workflow."""
        return len(self._client_live)

    def stats(self) -> dict:
        return {"workflows": len(self.workflows), "live": len(self._live),
                "expired": len(self._expired), "agents": self.num_agents,
                "clients": len(self._client_live), **self.counters}

    # ---------------------------------------------------------------- time and removal
    def expire(self, now: float) -> list[str]:
        """Mark workflows quiet for longer than the lease as expired; return the newly expired.
        Workflows expired for longer than ``forget_after_s`` are removed (see
        :meth:`drain_removed`)."""
        out = []
        while self._live:
            wf = next(iter(self._live))
            w = self.workflows[wf]
            if now - w.last_hint <= self.lease_s:
                break  # ordered by last hint: the rest are newer
            del self._live[wf]
            self._uncount(w.client)
            w.expired, w.expired_at = True, now
            self._expired[wf] = None
            out.append(wf)
        grace = self.lease_s if self.forget_after_s is None else self.forget_after_s
        while self._expired:
            wf = next(iter(self._expired))
            w = self.workflows[wf]
            if now - (w.expired_at if w.expired_at is not None else now) <= grace:
                break
            self._remove(wf)
            self.counters["forgotten"] += 1
        return out

    def release(self, wf: str) -> WorkflowHints | None:
        """The workflow ended: forget it now (the caller drops its tags itself)."""
        w = self.workflows.get(wf)
        if w is None:
            return None
        self._remove(wf, report=False)
        self.counters["released"] += 1
        return w

    def drain_removed(self) -> list[str]:
        """Keys removed by expiry or by the bounds since the last call (their tags must go)."""
        out, self._removed = self._removed, []
        return out

    def _remove(self, wf: str, report: bool = True) -> None:
        w = self.workflows.pop(wf)
        if wf in self._live:
            del self._live[wf]
            self._uncount(w.client)
        self._expired.pop(wf, None)
        self.num_agents -= len(w.ste)
        if report:
            self._removed.append(wf)

    def _uncount(self, client: str) -> None:
        self._client_live[client] -= 1
        if self._client_live[client] <= 0:
            del self._client_live[client]
