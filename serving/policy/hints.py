"""Hint registry: per (workflow, agent) STE from hints v1, with leases and step-time measurement.

- A workflow's hints hold for ``lease_s`` seconds after its last hint; after that every agent of
  it counts as STE = +inf (a vanished client pins nothing). A new hint revives it.
- ``None`` / null in a hint means "unreachable": +inf.
- Updates merge: agents missing from a hint keep their last value (out-of-band transitions may
  carry a subset).
- Step time: when a workflow's ``step`` advances, the elapsed time per step feeds an EMA; the
  prefetch planner turns STE into seconds with it.
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


class HintRegistry:
    """STE per (workflow, agent) with leases; who is a client (for per-client caps)."""

    def __init__(self, *, lease_s: float = 60.0, step_ema: float = 0.3) -> None:
        self.lease_s = lease_s
        self.step_ema = step_ema
        self.workflows: dict[str, WorkflowHints] = {}

    def update(self, wf: str, ste: dict, *, now: float, step: int | None = None,
               client: str | None = None) -> tuple[dict[str, float], bool]:
        """Merge a hint. Returns ({agent: new raw STE} for agents whose value changed,
        whether the workflow was expired before (then every agent's effective value changed))."""
        w = self.workflows.get(wf)
        if w is None:
            w = self.workflows[wf] = WorkflowHints(wf, client or wf, last_hint=now)
        revived = w.expired
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
        return changed, revived

    def _observe_step(self, w: WorkflowHints, step: int, now: float) -> None:
        if w.step is not None and step > w.step and w.step_at is not None and now > w.step_at:
            per = (now - w.step_at) / (step - w.step)
            w.step_s = per if w.step_s is None else (1 - self.step_ema) * w.step_s + self.step_ema * per
        if w.step is None or step != w.step:
            w.step, w.step_at = step, now

    def ste(self, wf: str, agent: str) -> float:
        """Effective STE (inf if unknown or the lease expired at the last :meth:`expire`)."""
        w = self.workflows.get(wf)
        if w is None or w.expired:
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
