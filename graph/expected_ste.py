"""The expected-STE solver: the STE recurrence with each OR edge stretched by how likely it is.

The exact STE of :class:`~.step_graph.AgentStepGraph` is a *best case* (a lower bound): over a
conditional edge (a LangGraph branch, a GraphFlow edge condition, a Selector's choice, a Swarm
hand-off) it assumes the branch towards the agent is taken. :func:`solve` takes the length of
each edge from the caller (:class:`~.transitions.TransitionModel` gives ``1 / P(v | u)``)::

    X(a) = 0                                            if a is running
    X(a) = min( min over OR preds u    (X(u) + length(u, a)),
                min over AND groups G  (max over m in G not yet arrived (X(m)) + 1) )

``1 / P`` is the expected number of times ``u`` must run before it picks ``a`` (geometric
trials), so ``X`` is an *expected distance* in steps. It is solved like the exact STE, by a
Dijkstra pass (``min``/``max`` plus a length >= 1 are superior functions, Knuth 1977), and:

* equals the exact STE wherever nothing is chosen at run time (every length is 1);
* is never below the exact STE (every length is >= 1), so it never claims an agent is
  closer than the graph allows, and is infinite exactly where the exact STE is;
* orders the candidates of a choice by probability: from ``u``, the likeliest successor
  is the closest (``1/P`` is decreasing in ``P``), and composes along paths, through
  parallel steps and AND barriers, which a Markov chain over single agents cannot.

The pass runs over states ``(agent, reached from)``, so a length may depend on how ``u`` was
reached (the model's second order, :mod:`.transitions`).

On the wire (:func:`wire_ste`)
    ``kvflow_ste[a] = max(exact(a), round(X(a)))`` (half up), ``null`` where the exact STE is
    infinite. The protocol carries integers, and the server uses the value as an eviction
    priority and a prefetch lookahead, both in steps: a branch taken with probability above
    2/3 keeps distance 1 (prefetched as "next"), a 50/50 choice costs 2, a 10 % branch 10: its
    cache goes before the likely branch's. ``kvflow_next`` lists the agents with the smallest
    expected STE > 0 (the prediction).

Guaranteed STE
    :func:`guaranteed_ste` follows unconditional edges only: where it is finite the agent
    runs within that many steps unless the run stops early (termination, errors); infinite
    where some run-time choice decides. With the exact (best-case) STE it brackets the truth.

Pure Python: no framework import.
"""

from __future__ import annotations

import heapq
import math
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .step_graph import END, INF, START, AgentStepGraph

__all__ = ["EdgeLength", "View", "view", "solve", "conditional_successors", "guaranteed_ste",
           "wire_ste"]

# length(u, v, conditional, came_from) >= 1 or inf; came_from: the agent u was reached from
EdgeLength = Callable[[str, str, bool, "str | None"], float]


@dataclass(frozen=True)
class View:
    """What the expected-STE pass needs from an :class:`AgentStepGraph`."""

    or_succ: dict[str, tuple[tuple[str, bool], ...]]  # u -> ((v, conditional), ...), v may be END
    or_pred: dict[str, frozenset[str]]                # v -> its OR predecessors (START included)
    cond_succ: dict[str, tuple[str, ...]]             # u -> conditional successors (END included)
    groups: tuple[tuple[str, tuple[str, ...]], ...]   # (target, members)
    member_groups: dict[str, tuple[int, ...]]
    agents: tuple[str, ...]
    has_start: bool


_views: "weakref.WeakKeyDictionary[AgentStepGraph, tuple[Any, View]]" = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def view(graph: AgentStepGraph) -> View:
    compiled = graph._compile()  # rebuilt by the graph after any mutation: our cache key
    with _views_lock:
        hit = _views.get(graph)
        if hit is not None and hit[0] is compiled:
            return hit[1]
    g = graph.nx_graph
    or_succ: dict[str, list[tuple[str, bool]]] = defaultdict(list)
    cond: dict[str, list[str]] = defaultdict(list)
    for s, d, k, attrs in g.edges(keys=True, data=True):
        if k != "or":
            continue
        c = bool(attrs.get("conditional"))
        or_succ[s].append((d, c))
        if c:
            cond[s].append(d)
    groups: list[tuple[str, tuple[str, ...]]] = []
    member_groups: dict[str, list[int]] = defaultdict(list)
    for a in graph.agents:
        for grp in graph.joins(a):
            gid = len(groups)
            groups.append((a, tuple(grp)))
            for m in grp:
                member_groups[m].append(gid)
    has_start = START in g
    if not has_start:  # as the exact solver: agents nothing triggers are the entries
        for a in graph.agents:
            if not any(True for _ in g.predecessors(a)):
                or_succ[START].append((a, False))
    or_pred: dict[str, set[str]] = defaultdict(set)
    for u, vs in or_succ.items():
        for v, _ in vs:
            or_pred[v].add(u)
    view = View(
        or_succ={u: tuple(dict.fromkeys(v)) for u, v in or_succ.items()},
        or_pred={v: frozenset(us) for v, us in or_pred.items()},
        cond_succ={u: tuple(dict.fromkeys(v)) for u, v in cond.items()},
        groups=tuple(groups),
        member_groups={m: tuple(v) for m, v in member_groups.items()},
        agents=tuple(graph.agents),
        has_start=has_start,
    )
    with _views_lock:
        _views[graph] = (compiled, view)
    return view


def conditional_successors(graph: AgentStepGraph, agent: str) -> tuple[str, ...]:
    """The successors of ``agent`` (or ``START``) over conditional edges, ``END`` included."""
    return view(graph).cond_succ.get(agent, ())


def solve(graph: AgentStepGraph, running: Iterable[str], arrived: Mapping[str, Iterable[str]] | None,
          length: EdgeLength, contexts: Mapping[str, Iterable[str | None]] | None = None) -> dict[str, float]:
    """Dijkstra over the STE recurrence, on states ``(agent, reached from)``.

    ``length(u, v, conditional, came_from)`` >= 1 or ``inf``, where ``came_from`` is the agent
    ``u`` was reached from on this path (``None``: unknown). ``contexts``: for a running
    agent, the predecessors it was started after (``None`` among them: unknown); without, every
    running agent starts in context ``None``. An agent's STE is its best state's; AND groups
    count an agent once, at that distance. A state of an agent whose STE is already known still
    continues: reached from elsewhere, its choices may differ (a ReAct agent after its tool)."""
    v_ = view(graph)
    arrived = arrived or {}
    running = set(running)
    contexts = contexts or {}
    dist: dict[str, float] = {}                     # agent -> STE (its first state popped)
    best: dict[tuple[str, str | None], float] = {}  # state -> tentative distance
    heap: list[tuple[float, int, str, str | None]] = []
    tie = 0

    def push(node: str, came_from: str | None, d: float) -> None:
        nonlocal tie
        key = (node, came_from)
        if d < best.get(key, INF):
            best[key] = d
            tie += 1
            heapq.heappush(heap, (d, tie, node, came_from))

    for a in running:
        if a == START:
            continue
        for c in (contexts.get(a) or (None,)):
            push(a, c, 0.0)
    remaining: list[int] = []
    arrived_in: list[frozenset[str]] = []
    for target, members in v_.groups:
        got = frozenset(arrived.get(target, ()))
        arrived_in.append(got)
        remaining.append(sum(1 for m in members if m not in got))
    for gid, r in enumerate(remaining):
        if r == 0:
            push(v_.groups[gid][0], None, 1.0)
    if START in running:
        for v, c in v_.or_succ.get(START, ()):
            if v != END:
                push(v, START, length(START, v, c, None))
    done: set[tuple[str, str | None]] = set()
    while heap:
        d, _, u, came_from = heapq.heappop(heap)
        state = (u, came_from)
        if state in done or d > best.get(state, INF):
            continue
        done.add(state)
        first = u not in dist
        if first:
            dist[u] = d
        for v, c in v_.or_succ.get(u, ()):
            if v == END or (v, u) in done:
                continue
            w = length(u, v, c, came_from)
            if w < INF:
                push(v, u, d + w)
        if not first:
            continue
        for gid in v_.member_groups.get(u, ()):
            if u in arrived_in[gid]:
                continue
            remaining[gid] -= 1
            if remaining[gid] == 0:  # u is the last member reached: it holds the max
                push(v_.groups[gid][0], None, d + 1.0)
    return {a: dist.get(a, INF) for a in v_.agents}


def guaranteed_ste(graph: AgentStepGraph, running: Iterable[str] = (),
                   arrived: Mapping[str, Iterable[str]] | None = None) -> dict[str, float]:
    """STE over unconditional edges only: an upper bound where finite (barring early stops)."""
    return solve(graph, running, arrived, lambda u, v, c, _: INF if c else 1.0)



def _round_half_up(x: float) -> float:
    return INF if math.isinf(x) else float(math.floor(x + 0.5))


def wire_ste(exact: Mapping[str, float], expected: Mapping[str, float]) -> dict[str, float]:
    """Combine exact and expected STE into the value sent as ``kvflow_ste`` (module doc)."""
    out: dict[str, float] = {}
    for a, e in exact.items():
        if math.isinf(e):
            out[a] = INF
        else:
            x = expected.get(a, e)
            out[a] = max(e, _round_half_up(x)) if not math.isinf(x) else e
    return out
