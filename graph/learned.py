"""Learned transitions: an expected STE where the next agent is chosen at run time.

The exact STE of :class:`AgentStepGraph` is a *best case* (a lower bound): over a conditional
edge — a LangGraph branch, a GraphFlow edge condition, a Selector's choice, a Swarm hand-off —
it assumes the branch towards the agent is taken. Where the choice is an LLM's, every
candidate then looks equally close. This module learns, per workflow app, how often each
conditional transition ``u → v`` was taken in observed runs, and turns the counts into an
**expected STE**.

Transition probabilities
    Only *conditional* OR edges carry a choice. For an agent ``u`` with conditional successors
    ``C(u)`` (``END`` included when ``u → END`` is conditional)::

        P(v | u) = (n(u, v) + prior) / (sum over w in C(u) of n(u, w) + prior * |C(u)|)

    a symmetric Dirichlet prior (``prior`` > 0; default 1, Laplace), so an unseen branch is
    unlikely but never impossible. Unconditional edges always fire: ``P = 1``.

Expected STE (the value in ``kvflow_ste``)
    The STE recurrence of the exact solver with each OR edge stretched to length ``1 / P(v|u)``::

        X(a) = 0                                            if a is running
        X(a) = min( min over OR preds u    (X(u) + 1 / P(a | u)),
                    min over AND groups G  (max over m in G not yet arrived (X(m)) + 1) )

    ``1 / P`` is the expected number of times ``u`` must run before it picks ``a`` (geometric
    trials), so ``X`` is an *expected distance* in steps. It is solved like the exact STE, by a
    Dijkstra pass (``min``/``max`` plus a length >= 1 are superior functions, Knuth 1977), and:

    * equals the exact STE wherever nothing is chosen at run time (every ``P`` is 1);
    * is never below the exact STE (every length is >= 1), so it never claims an agent is
      closer than the graph allows, and is infinite exactly where the exact STE is;
    * orders the candidates of a choice by probability: from ``u``, the likeliest successor
      is the closest (``1/P`` is decreasing in ``P``), and composes along paths, through
      parallel steps and AND barriers, which a Markov chain over single agents cannot.

    **Evidence.** With ``min_evidence=k`` a choice observed fewer than ``k`` times keeps the
    best case (every candidate at distance 1, as the exact STE): a fresh app sends the exact
    STE and its hints change only where runs have shown how the choice goes. The LangGraph
    adapter uses ``k = 1``; the AutoGen adapter ``k = 0`` (the prior alone already spreads a
    selector's candidates).

    **Context.** Where the choice at ``u`` depends on how ``u`` was reached, the model also
    counts it per predecessor (second order): ``n(w → u → v)`` for the agent ``w`` whose step
    came right before ``u``'s over an OR edge. A ReAct agent is the common case: reached from
    its caller it calls the tool; reached from the tool it answers (``agent → tools | END``
    is 50/50 in first order, certain in second). The context distribution backs off to what
    the *other* contexts saw (so no observation is counted twice)::

        P(v | u, after w) = (n(w → u → v) + a * R(v)) / (sum over v' of n(w → u → v') + a)
        R(v) = (n(u → v) - n(w → u → v) + prior) / (sum of the same over C(u))

    with ``a = prior * |C(u)|``: without evidence in that context it *is* the first-order
    distribution, and where ``u`` is always reached from ``w`` it is too (an uninformative
    context changes nothing). The pass runs over states ``(agent, reached from)``: a running agent starts
    from the predecessors it was started after (:meth:`LearnedTracker.contexts`), an agent
    reached over ``u → v`` continues in context ``u``, an AND join's target in none (first
    order). The bounds above hold unchanged (every length is still >= 1).

    **On the wire** (:func:`wire_ste`): ``kvflow_ste[a] = max(exact(a), round(X(a)))``
    (half up), ``null`` where the exact STE is infinite. The protocol carries integers, and the
    server uses the value as an eviction priority and a prefetch lookahead, both in steps: a
    branch taken with probability above 2/3 keeps distance 1 (prefetched as "next"), a
    50/50 choice costs 2, a 10 % branch 10 — its cache goes before the likely branch's.
    ``kvflow_next`` lists the agents with the smallest expected STE > 0 (the prediction).

Guaranteed STE
    :func:`guaranteed_ste` follows unconditional edges only: where it is finite the agent
    runs within that many steps unless the run stops early (termination, errors); infinite
    where some run-time choice decides. With the exact (best-case) STE it brackets the truth.

Traces
    Runs are recorded as JSONL (:mod:`.traces`: :class:`TraceRecorder`, :func:`write_traces`,
    :func:`read_traces`, re-exported here).
    Scoring predictions on them (``evaluate_predictions``, ``train``) and synthetic Selector
    runs for ``kvflow bench predict`` live in :mod:`.prediction`.

Pure Python: no framework import (adapters for LangGraph and AutoGen both use it).
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import threading
import weakref
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import GraphError
from .step_graph import END, INF, START, AgentStepGraph, next_agents
from .tracker import WorkflowTracker
from .traces import TraceRecorder, TraceRun, read_traces, write_traces  # re-exported: their old home

log = logging.getLogger("kvflow_agents")

TRANSITIONS_ENV = "KVFLOW_TRANSITIONS"  # a JSON file: the default model persists there

__all__ = [
    "TransitionModel", "LearnedTracker", "TraceRun", "TraceRecorder",
    "expected_ste", "guaranteed_ste", "wire_ste", "write_traces", "read_traces",
    "conditional_successors", "ste_between_steps", "default_model",
]


# ---------------------------------------------------------------------------- graph views
@dataclass(frozen=True)
class _View:
    """What the expected-STE pass needs from an :class:`AgentStepGraph`."""

    or_succ: dict[str, tuple[tuple[str, bool], ...]]  # u -> ((v, conditional), ...), v may be END
    or_pred: dict[str, frozenset[str]]                # v -> its OR predecessors (START included)
    cond_succ: dict[str, tuple[str, ...]]             # u -> conditional successors (END included)
    groups: tuple[tuple[str, tuple[str, ...]], ...]   # (target, members)
    member_groups: dict[str, tuple[int, ...]]
    agents: tuple[str, ...]
    has_start: bool


_views: "weakref.WeakKeyDictionary[AgentStepGraph, tuple[Any, _View]]" = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def _view(graph: AgentStepGraph) -> _View:
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
    view = _View(
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
    return _view(graph).cond_succ.get(agent, ())


def _solve(graph: AgentStepGraph, running: Iterable[str], arrived: Mapping[str, Iterable[str]] | None,
           length: Any, contexts: Mapping[str, Iterable[str | None]] | None = None) -> dict[str, float]:
    """Dijkstra over the STE recurrence, on states ``(agent, reached from)``.

    ``length(u, v, conditional, came_from)`` >= 1 or ``inf``, where ``came_from`` is the agent
    ``u`` was reached from on this path (``None``: unknown). ``contexts``: for a running
    agent, the predecessors it was started after (``None`` among them: unknown); without, every
    running agent starts in context ``None``. An agent's STE is its best state's; AND groups
    count an agent once, at that distance. A state of an agent whose STE is already known still
    continues: reached from elsewhere, its choices may differ (a ReAct agent after its tool)."""
    v_ = _view(graph)
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
    return _solve(graph, running, arrived, lambda u, v, c, _: INF if c else 1.0)


# ---------------------------------------------------------------------------- the model
_default: "TransitionModel | None" = None
_default_lock = threading.Lock()


def default_model() -> "TransitionModel":
    """The process-wide model the adapters (LangGraph and AutoGen) share unless given one; bound
    to the file named by ``$KVFLOW_TRANSITIONS`` when set, so learning persists across runs."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TransitionModel()
            path = os.environ.get(TRANSITIONS_ENV)
            if path:
                _default.bind_file(path)
        return _default


class TransitionModel:
    """Per-app counts of conditional transitions ``(u → v)``, also per predecessor ``w`` of
    ``u`` (``w → u → v``, the module doc's context), and what follows from them.

    Thread-safe. ``app`` names a workflow *application* (all runs of one graph share counts);
    ``u`` and ``w`` may be ``START`` and ``v`` may be ``END``.
    """

    def __init__(self, prior: float = 1.0) -> None:
        if not prior > 0:
            raise GraphError(f"prior must be > 0, got {prior!r}")
        self.prior = float(prior)
        self._counts: dict[str, dict[str, dict[str, int]]] = {}
        self._after: dict[str, dict[str, dict[str, dict[str, int]]]] = {}  # app -> u -> w -> v -> n
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._loaded: set[Path] = set()

    # -------------------------------------------------------------- counting
    def observe(self, app: str, src: str, dst: str, n: int = 1) -> None:
        with self._lock:
            row = self._counts.setdefault(app, {}).setdefault(src, {})
            row[dst] = row.get(dst, 0) + n

    def observe_after(self, app: str, before: str, src: str, dst: str, n: int = 1) -> None:
        """Count ``src → dst`` where ``src`` was reached from ``before`` (the context row only;
        :meth:`observe` counts the first-order row)."""
        with self._lock:
            row = self._after.setdefault(app, {}).setdefault(src, {}).setdefault(before, {})
            row[dst] = row.get(dst, 0) + n

    def count(self, app: str, src: str, dst: str, *, after: str | None = None) -> int:
        if after is not None:
            return self._after.get(app, {}).get(src, {}).get(after, {}).get(dst, 0)
        return self._counts.get(app, {}).get(src, {}).get(dst, 0)

    def counts(self, app: str) -> dict[tuple[str, str], int]:
        with self._lock:
            return {(u, v): n for u, row in self._counts.get(app, {}).items() for v, n in row.items()}

    def context_counts(self, app: str) -> dict[tuple[str, str, str], int]:
        """``{(before, u, v): n}``: the transitions counted per predecessor."""
        with self._lock:
            return {(w, u, v): n for u, by in self._after.get(app, {}).items()
                    for w, row in by.items() for v, n in row.items()}

    def observations(self, app: str) -> int:
        return sum(self.counts(app).values())

    @property
    def apps(self) -> list[str]:
        return list(dict.fromkeys([*self._counts, *self._after]))

    def reset(self, app: str | None = None) -> None:
        with self._lock:
            if app is None:
                self._counts.clear()
                self._after.clear()
            else:
                self._counts.pop(app, None)
                self._after.pop(app, None)

    # -------------------------------------------------------------- probabilities
    def distribution(self, app: str, src: str, candidates: Sequence[str], *,
                     after: str | None = None) -> dict[str, float]:
        """``P(v | src)`` over ``candidates`` (the conditional successors of ``src``); with
        ``after``, ``P(v | src reached from after)``, backed off to the first order (module doc)."""
        if not candidates:
            return {}
        row = self._counts.get(app, {}).get(src, {})
        ns = [row.get(v, 0) for v in candidates]
        total = sum(ns) + self.prior * len(candidates)
        first = {v: (n + self.prior) / total for v, n in zip(candidates, ns)}
        ctx = self._after.get(app, {}).get(src, {}).get(after) if after is not None else None
        if not ctx:
            return first
        strength = self.prior * len(candidates)  # the back-off's weight, as the prior's
        rest = [max(0, n - ctx.get(v, 0)) for v, n in zip(candidates, ns)]
        rest_total = sum(rest) + strength
        total = sum(ctx.get(v, 0) for v in candidates) + strength
        return {v: (ctx.get(v, 0) + strength * (r + self.prior) / rest_total) / total
                for v, r in zip(candidates, rest)}

    def probability(self, app: str, graph: AgentStepGraph, src: str, dst: str, *,
                    after: str | None = None) -> float:
        """``P(dst | src)`` on ``graph`` (``after``: ``src`` was reached from that agent): 1 over
        an unconditional edge, 0 with no edge."""
        v_ = _view(graph)
        edges = dict(v_.or_succ.get(src, ()))
        if dst not in edges:
            return 0.0
        if not edges[dst]:
            return 1.0
        return self.distribution(app, src, v_.cond_succ.get(src, ()), after=after)[dst]

    # -------------------------------------------------------------- STE
    def expected_ste(self, graph: AgentStepGraph, running: Iterable[str] = (),
                     arrived: Mapping[str, Iterable[str]] | None = None, *, app: str | None = None,
                     min_evidence: int = 0,
                     after: Mapping[str, Iterable[str | None]] | None = None) -> dict[str, float]:
        """Expected STE (float; see the module doc). ``app`` defaults to the graph's name.
        ``min_evidence``: a choice observed fewer times than this keeps the best case (length 1
        on each of its edges): no evidence, no claim (the LangGraph adapter uses 1).
        ``after``: for running agents, the predecessors they were started after (context)."""
        app = graph.name if app is None else app
        v_ = _view(graph)
        cache: dict[tuple[str, str | None], dict[str, float]] = {}
        rows = self._counts.get(app, {})

        def length(u: str, v: str, c: bool, came_from: str | None) -> float:
            if not c:
                return 1.0
            dist = cache.get((u, came_from))
            if dist is None:
                if min_evidence and sum(rows.get(u, {}).values()) < min_evidence:
                    dist = {w: 1.0 for w in v_.cond_succ.get(u, ())}
                else:
                    dist = self.distribution(app, u, v_.cond_succ.get(u, ()), after=came_from)
                cache[(u, came_from)] = dist
            return 1.0 / dist[v]

        return _solve(graph, running, arrived, length, after)

    def wire_ste(self, graph: AgentStepGraph, running: Iterable[str] = (),
                 arrived: Mapping[str, Iterable[str]] | None = None, *, app: str | None = None,
                 exact: Mapping[str, float] | None = None, min_evidence: int = 0,
                 after: Mapping[str, Iterable[str | None]] | None = None) -> dict[str, float]:
        """The ``kvflow_ste`` map: expected STE rounded half up, never below the exact STE."""
        running = set(running)
        if exact is None:
            exact = graph.steps_to_execution(running, arrived or {}, validate=False)
        return wire_ste(exact, self.expected_ste(graph, running, arrived, app=app,
                                                 min_evidence=min_evidence, after=after))

    # -------------------------------------------------------------- persistence
    def to_json(self) -> str:
        with self._lock:
            doc: dict[str, Any] = {"kvflow_transitions": 1, "prior": self.prior, "counts": self._counts}
            if self._after:  # older readers ignore it; older files simply lack it
                doc["after"] = self._after
            return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TransitionModel":
        try:
            doc = json.loads(text)
            if doc.get("kvflow_transitions") != 1:
                raise GraphError("not a transition-model document (missing kvflow_transitions: 1)")
            m = cls(prior=doc.get("prior", 1.0))
            for app, rows in doc["counts"].items():
                for u, row in rows.items():
                    for v, n in row.items():
                        m.observe(app, u, v, int(n))
            for app, rows in (doc.get("after") or {}).items():
                for u, by in rows.items():
                    for w, row in by.items():
                        for v, n in row.items():
                            m.observe_after(app, w, u, v, int(n))
            return m
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GraphError(f"cannot read transition model: {e}") from e

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One temp file per thread: runs ending on several threads flush at once.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)

    def merge(self, other: "TransitionModel") -> None:
        """Add ``other``'s counts to this model's."""
        for app in other.apps:
            for (u, v), n in other.counts(app).items():
                self.observe(app, u, v, n)
            for (w, u, v), n in other.context_counts(app).items():
                self.observe_after(app, w, u, v, n)

    def bind_file(self, path: str | Path) -> "TransitionModel":
        """Persist this model in ``path`` across runs and processes: the counts already there
        are merged in now (once per path), and :meth:`flush` (called by the adapters when a run
        ends) writes the model back. An unreadable file is reported and then overwritten."""
        path = Path(path).expanduser()
        with self._lock:
            already = path in self._loaded
            self._loaded.add(path)
            self._path = path
        if not already and path.exists():
            try:
                self.merge(TransitionModel.load(path))
            except (GraphError, OSError) as e:
                log.warning("kvflow: ignoring the transition file %s (%s)", path, e)
        return self

    @property
    def path(self) -> Path | None:
        return self._path

    def flush(self) -> None:
        """Write the model to its bound file (no-op when unbound; errors are logged, never raised:
        persistence must not fail the user's run)."""
        if self._path is None:
            return
        try:
            self.save(self._path)
        except OSError as e:
            log.warning("kvflow: could not write the transition file %s (%s)", self._path, e)

    @classmethod
    def load(cls, path: str | Path) -> "TransitionModel":
        return cls.from_json(Path(path).read_text())

    def __repr__(self) -> str:
        return f"TransitionModel(apps={self.apps}, prior={self.prior})"


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


def expected_ste(graph: AgentStepGraph, model: TransitionModel, running: Iterable[str] = (),
                 arrived: Mapping[str, Iterable[str]] | None = None, *, app: str | None = None
                 ) -> dict[str, float]:
    return model.expected_ste(graph, running, arrived, app=app)


# ---------------------------------------------------------------------------- tracking
@dataclass
class _StepLog:
    """What :class:`LearnedTracker` keeps of one step of the run."""

    n: Counter = field(default_factory=Counter)        # agent -> instances started
    ctx: dict = field(default_factory=dict)            # agent -> predecessors it came from
    out: dict = field(default_factory=dict)            # agent -> Counter of successors counted


class LearnedTracker(WorkflowTracker):
    """A :class:`WorkflowTracker` that learns conditional transitions as the run goes and
    answers the expected STE. Hook-free: it wraps ``start``/``end`` of the base tracker.

    A transition ``u → v`` is counted when ``v`` starts the step after the one ``u`` ran in
    (``u = START`` for the first step) and ``u → v`` is a conditional edge; ``u → END`` when
    the run ends after ``u`` and that edge is conditional (once per instance of ``u``).
    ``end()`` closes the run and, with a ``recorder``, appends its steps as a :class:`TraceRun`.

    Fan-in: ``k`` instances of ``u`` (a Send fan-out) whose step is followed by fewer than
    ``k`` starts of its successors, all of one agent ``v``, each chose ``v`` (the executors of a
    map-reduce all leave for the one reducer): when the step after ``v``'s opens (or the run
    ends), ``u → v`` is topped up to ``k``. Without it a map-reduce's exit looks ``k`` times
    rarer than the loop beside it.

    Context: an agent started after a step that ran some of its OR predecessors was reached
    from those (:meth:`contexts`); its transitions are also counted in their rows
    (:meth:`TransitionModel.observe_after`). Several running instances of one agent (a Send
    fan-out) keep their contexts in start order, and a finish drops the oldest.
    """

    def __init__(self, graph: AgentStepGraph, model: TransitionModel | None = None, *,
                 app: str | None = None, workflow_id: str | None = None, learn: bool = True,
                 recorder: TraceRecorder | None = None, min_evidence: int = 0) -> None:
        super().__init__(graph, workflow_id=workflow_id)
        self.model = model if model is not None else TransitionModel()
        self.app = app or graph.name
        self.learn = learn
        self.min_evidence = min_evidence
        self.recorder = recorder
        if recorder is not None:
            recorder.add_graph(self.app, graph)
        self._steps: list[list[str]] = []   # this run's steps
        self._log: list[_StepLog] = []      # per step: instances, contexts, successors counted
        self._step_no: int | None = None    # tracker step number of self._steps[-1]
        self._run_ctx: dict[str, deque[frozenset[str]]] = {}  # running instances' contexts, oldest first

    def _observe(self, u: str, v: str, log: "_StepLog", n: int = 1) -> None:
        """Count ``u → v`` ``n`` times for instances of ``u`` in ``log``'s step, in ``u``'s
        first-order row and in each of its contexts' rows."""
        self.model.observe(self.app, u, v, n)
        for w in log.ctx.get(u, ()):
            self.model.observe_after(self.app, w, u, v, n)
        log.out.setdefault(u, Counter())[v] += n

    def _top_up_fan_in(self, i: int) -> None:
        """Step ``i + 1`` is complete: credit step ``i``'s uncounted instances (class doc)."""
        if not self.learn or i < 0 or i + 1 >= len(self._log):
            return
        log = self._log[i]
        for u, k in log.n.items():
            out = log.out.get(u)
            if out and len(out) == 1:
                (v, got), = out.items()
                if got < k:
                    self._observe(u, v, log, k - got)

    def start(self, agent: str, *, step: int | None = None) -> None:
        with self._lock:
            was_ended = self._ended or not self._started
            super().start(agent, step=step)
            if was_ended:
                self._steps, self._log, self._step_no = [], [], None
                self._run_ctx.clear()
            if self._step_no != self._step:
                i = len(self._steps) - 1  # the previous step (-1: none, START)
                self._top_up_fan_in(i - 1)
                self._steps.append([])
                self._log.append(_StepLog())
                self._step_no = self._step
            else:
                i = len(self._steps) - 2
            prev = self._steps[i] if i >= 0 else [START]
            prev_log = self._log[i] if i >= 0 else _StepLog()
            preds = _view(self.graph).or_pred.get(agent, frozenset())
            ctx = frozenset(u for u in prev if u in preds)
            self._run_ctx.setdefault(agent, deque()).append(ctx)
            log = self._log[-1]
            log.ctx.setdefault(agent, set()).update(ctx)
            log.n[agent] += 1
            if agent not in self._steps[-1]:
                self._steps[-1].append(agent)
            if self.learn:
                for u in prev:
                    if agent in conditional_successors(self.graph, u):
                        self._observe(u, agent, prev_log)

    def finish(self, agent: str) -> None:
        with self._lock:
            super().finish(agent)
            self._drop_context(agent)

    def cancel(self, agent: str) -> None:
        with self._lock:
            was = self._running.get(agent, 0)
            super().cancel(agent)
            if was:
                self._drop_context(agent)

    def _drop_context(self, agent: str) -> None:
        q = self._run_ctx.get(agent)
        if q:
            q.popleft()
            if not q:
                del self._run_ctx[agent]

    def end(self) -> None:
        with self._lock:
            if self._ended:
                return
            steps = self._steps
            if self.learn and steps:
                self._top_up_fan_in(len(steps) - 2)
                last = self._log[-1]
                for u in steps[-1]:
                    if END in conditional_successors(self.graph, u):
                        self._observe(u, END, last, last.n[u])
            super().end()
            if self.recorder is not None and steps:
                self.recorder.add_run(TraceRun(self.app, [list(s) for s in steps], self.workflow_id))
            self._steps, self._log, self._step_no = [], [], None
            self._run_ctx.clear()

    @property
    def steps(self) -> list[list[str]]:
        """The agents of each step of the current (or last ended) run."""
        with self._lock:
            return [list(s) for s in self._steps]

    def contexts(self) -> dict[str, set[str | None]]:
        """For each running agent, the predecessors its instances were started after (``None``
        for an instance started after none of them: an entry, a join's target)."""
        with self._lock:
            return {a: {w for ctx in q for w in (ctx or (None,))} for a, q in self._run_ctx.items()}

    def step_contexts(self) -> dict[str, set[str]]:
        """The predecessors each agent of the last step was started after (between steps)."""
        with self._lock:
            return {a: set(c) for a, c in self._log[-1].ctx.items()} if self._log else {}

    def _state(self) -> tuple[set[str], dict[str, set[str]]]:
        with self._lock:
            running = set(self._running) if self._started else {START}
            return running, {k: set(v) for k, v in self._arrived.items()}

    def expected_ste(self) -> dict[str, float]:
        if self._ended:
            return {a: INF for a in self.graph.agents}
        with self._lock:
            running, arrived = self._state()
            after = self.contexts()
        return self.model.expected_ste(self.graph, running, arrived, app=self.app,
                                       min_evidence=self.min_evidence, after=after)

    def guaranteed_ste(self) -> dict[str, float]:
        if self._ended:
            return {a: INF for a in self.graph.agents}
        running, arrived = self._state()
        return guaranteed_ste(self.graph, running, arrived)

    def wire_ste(self) -> dict[str, float]:
        """What the hints carry as ``kvflow_ste``: see :func:`wire_ste`."""
        exact = self.ste()
        if self._ended:
            return exact
        return wire_ste(exact, self.expected_ste())

    def predicted_next(self) -> list[str]:
        """The next agents by the STE this tracker sends (:func:`~.step_graph.next_agents`)."""
        return next_agents(self.wire_ste())


# ---------------------------------------------------------------------------- between steps
def ste_between_steps(graph: AgentStepGraph, model: TransitionModel, last_step: Iterable[str],
                      arrived: Mapping[str, Iterable[str]] | None = None, *, app: str | None = None,
                      after: Mapping[str, Iterable[str | None]] | None = None
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """``(exact, expected)`` STE after the agents of ``last_step`` finished and before the next
    step starts (a router — an LLM selector — is choosing). Agents of the next step are at 1;
    an agent of ``last_step`` is one step after its nearest OR predecessor (itself, over a
    self-loop). AND joins into ``last_step`` agents are not re-derived (rare after a step).
    ``after``: the predecessors the agents of ``last_step`` were started after
    (:meth:`LearnedTracker.step_contexts`): the router's choice in their context."""
    last = [a for a in last_step if a in graph]
    app = graph.name if app is None else app
    exact = graph.steps_to_execution(set(last), arrived or {}, validate=False)
    expected = model.expected_ste(graph, set(last), arrived, app=app, after=after)
    base_e, base_x = dict(exact), dict(expected)
    for a in last:
        best_e, best_x = INF, INF
        for u in dict.fromkeys(graph.or_predecessors(a)):
            if u in (START, END):
                continue
            p = model.probability(app, graph, u, a)
            if p <= 0:
                continue
            best_e = min(best_e, base_e[u] + 1)
            best_x = min(best_x, base_x[u] + 1.0 / p)
        exact[a], expected[a] = best_e, best_x
    return exact, expected
