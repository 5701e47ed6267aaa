"""Learned transitions: an expected STE where the next agent is chosen at run time.

Where an LLM picks the next agent, every candidate looks equally close to the exact STE of
:class:`~.step_graph.AgentStepGraph` (a best case). Three parts turn observed runs into an
**expected STE**, the value sent as ``kvflow_ste``:

* :mod:`.transitions`: :class:`TransitionModel`, per-app counts of conditional transitions
  (also per predecessor) and the probabilities they give, persisted across runs;
* :mod:`.expected_ste`: the solver (each OR edge stretched to ``1 / P``), the guaranteed STE,
  and :func:`wire_ste`, what goes on the wire;
* this module: :class:`LearnedTracker`, a :class:`~.tracker.WorkflowTracker` that counts the
  transitions of the run it tracks and answers its expected STE, and
  :func:`ste_between_steps` (while a router chooses).

Traces
    Runs are recorded as JSONL (:mod:`.traces`: :class:`TraceRecorder`, :func:`write_traces`,
    :func:`read_traces`, re-exported here).
    Scoring predictions on them (``evaluate_predictions``, ``train``) and synthetic Selector
    runs for ``kvflow bench predict`` live in :mod:`.prediction`.

Pure Python: no framework import (adapters for LangGraph and AutoGen both use it).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .expected_ste import conditional_successors, guaranteed_ste, view, wire_ste
from .step_graph import END, INF, START, AgentStepGraph, next_agents
from .tracker import WorkflowTracker
from .traces import TraceRecorder, TraceRun, read_traces, write_traces  # re-exported: their old home
from .transitions import TRANSITIONS_ENV, TransitionModel, default_model, expected_ste

__all__ = [
    "TransitionModel", "LearnedTracker", "TraceRun", "TraceRecorder",
    "expected_ste", "guaranteed_ste", "wire_ste", "write_traces", "read_traces",
    "conditional_successors", "ste_between_steps", "default_model", "TRANSITIONS_ENV",
]


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
            preds = view(self.graph).or_pred.get(agent, frozenset())
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
