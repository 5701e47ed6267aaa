"""Prefetch planner: which host-only fixed prefixes to load, in which order.

Engine-agnostic: it sees candidates (an agent's tag, its STE, how many pages are still on host
only, its workflow's measured step time) and returns an ordered plan. The manager (or an
adapter for another engine) executes the plan under its own limits: in-flight loads, free device
space, and the no-thrash rule (never evict a node whose priority is <= the fetched agent's STE).

Order = urgency, not arrival: ``urgency = transfer time still needed / time left before the
agent runs`` with ``transfer = pages x seconds-per-page`` and ``time left = STE x step time``
less the time already spent in the current step.
Most urgent first. Loads share one link, so the planner walks the list accumulating link time;
a load that would finish after its agent starts yields (moves behind every load that can still
finish in time) instead of delaying them all.

Load versus recompute: a candidate may carry ``recompute_s`` (the engine's estimate of
recomputing its host-only pages). A load that cannot finish before its agent runs is dropped
from the plan (listed in ``last_skipped``) when the agent would still wait longer for it than
recomputing takes (``finish - deadline > recompute_s``). Without ``recompute_s``: always loaded.

Budget: ``plan(..., budget_pages=N)`` keeps only loads that fit in ``N`` pages in all (most
urgent first; those that do not fit go to ``last_skipped`` too), for engines that compute the
room a prefetch may take (free + evictable-by-larger-priority - pages queued work will need).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable

INF = math.inf


@dataclass
class PrefetchCandidate:
    tag: Hashable
    ste: float
    pages: int              # pages still host-only on the agent's fixed-prefix path
    step_s: float           # measured seconds per workflow step
    node: Any = None        # engine handle for the tagged node
    elapsed_s: float = 0.0  # time already spent in the workflow's current step
    recompute_s: float | None = None  # engine's estimate of recomputing those pages; None: load


@dataclass
class PlannedLoad:
    candidate: PrefetchCandidate
    transfer_s: float
    deadline_s: float       # seconds until the agent is expected to run
    urgency: float
    on_time: bool           # finishes before the deadline given the loads ahead of it
    finish_s: float = field(default=0.0)


class PrefetchPlanner:
    def __init__(self, *, lookahead: float = 1, secs_per_page: float = 0.0) -> None:
        self.lookahead = lookahead
        self.secs_per_page = secs_per_page  # 0 = unknown: every load counts as instant
        self.last_skipped: list[PlannedLoad] = []  # dropped by the last plan() (recompute/budget)

    def eligible(self, ste: float) -> bool:
        return ste <= self.lookahead

    def plan(self, candidates: Iterable[PrefetchCandidate], *, link_busy_s: float = 0.0,
             budget_pages: int | None = None) -> list[PlannedLoad]:
        """Order candidates by urgency; loads that cannot finish in time go last (or are
        dropped when recomputing is cheaper than waiting for them; see the module doc)."""
        spp = self.secs_per_page
        self.last_skipped = skipped = []
        items = []
        for c in candidates:
            if c.pages <= 0 or not self.eligible(c.ste):
                continue
            transfer = c.pages * spp
            deadline = max(0.0, c.ste * c.step_s - c.elapsed_s)
            if transfer <= 0:
                urgency = 0.0
            elif deadline <= 0:
                urgency = INF
            else:
                urgency = transfer / deadline
            items.append(PlannedLoad(c, transfer, deadline, urgency, True))
        items.sort(key=lambda p: (-p.urgency, p.candidate.ste, p.candidate.pages))
        if budget_pages is not None:
            kept, left = [], budget_pages
            for p in items:
                if p.candidate.pages <= left:
                    left -= p.candidate.pages
                    kept.append(p)
                else:
                    skipped.append(p)
            items = kept
        on_time, late = [], []
        t = link_busy_s
        for p in items:
            if p.transfer_s == 0 or t + p.transfer_s <= p.deadline_s:
                t += p.transfer_s
                p.finish_s = t
                on_time.append(p)
            else:
                p.on_time = False
                late.append(p)
        late.sort(key=lambda p: (p.deadline_s, p.transfer_s))
        kept_late = []
        for p in late:
            rec = p.candidate.recompute_s
            if rec is not None and t + p.transfer_s - p.deadline_s > rec:
                skipped.append(p)  # the agent would wait longer than recomputing takes
                continue
            t += p.transfer_s
            p.finish_s = t
            kept_late.append(p)
        return on_time + kept_late
