"""Hint registry: per (workflow, agent) STE from hints v1, with leases and step-time measurement.

- A workflow's hints hold for ``lease_s`` seconds after its last hint; after that every agent of
  it counts as STE = +inf (a vanished client pins nothing). A new hint revives it.
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
"""

from __future__ import annotations

import math
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
    step: int | None = None
    step_at: float | None = None
    step_s: float | None = None       # EMA of seconds per step, None until measured
    trust: float = 1.0                # EMA of "the previous map predicted this agent next"
    trusted: bool = True
    scored: int = 0                   # predictions scored
    missed: int = 0


class HintRegistry:
    """STE per (workflow, agent) with leases; who is a client (for per-client caps)."""

    def __init__(self, *, lease_s: float = 60.0, step_ema: float = 0.3, trust_ema: float = 0.25,
                 distrust_below: float = 0.5, trust_above: float = 0.7) -> None:
        self.lease_s = lease_s
        self.step_ema = step_ema
        self.trust_ema, self.distrust_below, self.trust_above = trust_ema, distrust_below, trust_above
        self.workflows: dict[str, WorkflowHints] = {}

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
            w = self.workflows[wf] = WorkflowHints(wf, client or wf, last_hint=now)
        flipped = self._score(w, agent) if agent is not None else False
        revived = w.expired or flipped
        w.expired = False
        w.last_hint = now
        if client:
            w.client = client
        changed = {}
        cur = w.ste
        for agent, value in ste.items():
            v = value if type(value) is int and value >= 0 else as_ste(value)
            if cur.get(agent, INF) != v or agent not in cur:
                changed[agent] = v
            cur[agent] = v
        if step is not None:
            self._observe_step(w, int(step), now)
        return (changed if w.trusted else {}), revived

    def _observe_step(self, w: WorkflowHints, step: int, now: float) -> None:
        if w.step is not None and step > w.step and w.step_at is not None and now > w.step_at:
            per = (now - w.step_at) / (step - w.step)
            w.step_s = per if w.step_s is None else (1 - self.step_ema) * w.step_s + self.step_ema * per
        if w.step is None or step != w.step:
            w.step, w.step_at = step, now

    def ste(self, wf: str, agent: str) -> float:
        """Effective STE (inf if unknown or the lease expired at the last :meth:`expire`)."""
        w = self.workflows.get(wf)
        if w is None or w.expired or not w.trusted:
            return INF
        return w.ste.get(agent, INF)

    def trusted(self, wf: str) -> bool:
        w = self.workflows.get(wf)
        return w is None or w.trusted

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

    def expire(self, now: float) -> list[str]:
        """Mark workflows quiet for longer than the lease as expired; return the newly expired."""
        out = []
        for w in self.workflows.values():
            if not w.expired and now - w.last_hint > self.lease_s:
                w.expired = True
                out.append(w.key)
        return out

    def release(self, wf: str) -> WorkflowHints | None:
        return self.workflows.pop(wf, None)
