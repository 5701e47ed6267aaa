"""Learned transition probabilities: how often each conditional transition was taken, per app.

Only *conditional* OR edges carry a choice. For an agent ``u`` with conditional successors
``C(u)`` (``END`` included when ``u → END`` is conditional)::

    P(v | u) = (n(u, v) + prior) / (sum over w in C(u) of n(u, w) + prior * |C(u)|)

a symmetric Dirichlet prior (``prior`` > 0; default 1, Laplace), so an unseen branch is
unlikely but never impossible. Unconditional edges always fire: ``P = 1``.
:meth:`TransitionModel.expected_ste` solves the STE recurrence with each OR edge stretched
to ``1 / P(v | u)`` (:mod:`.expected_ste`).

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
context changes nothing). The solver's pass runs over states ``(agent, reached from)``: a
running agent starts from the predecessors it was started after
(:meth:`~.learned.LearnedTracker.contexts`), an agent reached over ``u → v`` continues in
context ``u``, an AND join's target in none (first order). The solver's bounds hold unchanged
(every length is still >= 1).

Persistence: :func:`default_model` is the process-wide model the adapters share, bound to the
JSON file named by ``$KVFLOW_TRANSITIONS`` when set.

Pure Python: no framework import.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import GraphError, read_document
from .expected_ste import solve, view, wire_ste
from .step_graph import AgentStepGraph

log = logging.getLogger("kvflow_agents")

TRANSITIONS_ENV = "KVFLOW_TRANSITIONS"  # a JSON file: the default model persists there

__all__ = ["TransitionModel", "default_model", "expected_ste", "TRANSITIONS_ENV"]

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
        v_ = view(graph)
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
        """Expected STE (float; :mod:`.expected_ste`). ``app`` defaults to the graph's name.
        ``min_evidence``: a choice observed fewer times than this keeps the best case (length 1
        on each of its edges): no evidence, no claim (the LangGraph adapter uses 1).
        ``after``: for running agents, the predecessors they were started after (context)."""
        app = graph.name if app is None else app
        v_ = view(graph)
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

        return solve(graph, running, arrived, length, after)

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
        doc = read_document(text, "kvflow_transitions", "a transition model")
        try:
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


def expected_ste(graph: AgentStepGraph, model: TransitionModel, running: Iterable[str] = (),
                 arrived: Mapping[str, Iterable[str]] | None = None, *, app: str | None = None
                 ) -> dict[str, float]:
    return model.expected_ste(graph, running, arrived, app=app)
