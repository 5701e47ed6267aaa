"""Runtime state of one workflow instance: who runs, who arrived at which barrier, which step.

Adapters call :meth:`WorkflowTracker.start` / :meth:`finish` as the framework runs nodes;
every LLM request then carries :meth:`ste` and :meth:`next_agents`. The tracker keeps the
running set and barrier arrivals *incrementally* (O(1) per transition) and recomputes the STE
map lazily with one O(V+E) pass, cached until the next transition.

Step semantics follow LangGraph's Pregel super-steps: agents that run in parallel share a
step. Adapters that know the step (``langgraph_step``) pass it; otherwise a start opens a new
step when nothing is running (the previous step is over).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Mapping

from .errors import GraphError
from .step_graph import INF, START, AgentStepGraph, next_agents


class WorkflowTracker:
    """Tracks one workflow run over an :class:`AgentStepGraph`. Thread-safe."""

    def __init__(self, graph: AgentStepGraph, workflow_id: str | None = None) -> None:
        self.graph = graph
        self.workflow_id = workflow_id
        self._lock = threading.RLock()
        self._running: Counter[str] = Counter()  # Send fan-out runs one agent several times
        self._arrived: dict[str, set[str]] = {}
        self._step = 0
        self._started = False
        self._ended = False
        self._ste_cache: dict[str, float] | None = None
        self.history: list[tuple[int, str, str]] = []  # (step, "start"|"finish", agent)

    # ------------------------------------------------------------------ transitions
    def start(self, agent: str, *, step: int | None = None) -> None:
        """``agent`` begins executing. Consumes its barrier arrivals (as LangGraph's
        ``NamedBarrierValue`` is consumed when the joined node runs)."""
        self.graph._known(agent)
        with self._lock:
            if step is not None:
                if step < self._step:
                    raise GraphError(f"step went backwards: {step} < {self._step}")
                self._step = step
            elif not self._running:
                self._step += 1
            self._started = True
            self._ended = False
            self._running[agent] += 1
            self._arrived.pop(agent, None)
            self._ste_cache = None
            self.history.append((self._step, "start", agent))

    def finish(self, agent: str) -> None:
        """``agent`` finished one execution: it arrives at every barrier it belongs to."""
        self.graph._known(agent)
        with self._lock:
            if self._running[agent] <= 0:
                raise GraphError(f"finish({agent!r}) without a matching start")
            self._running[agent] -= 1
            if self._running[agent] == 0:
                del self._running[agent]
            c = self.graph._compile()  # cached: finish is on the hot path of every node
            for gid in c.member_groups[c.index[agent]]:
                self._arrived.setdefault(c.names[c.group_target[gid]], set()).add(agent)
            self._ste_cache = None
            self.history.append((self._step, "finish", agent))

    def cancel(self, agent: str) -> None:
        """``agent`` stopped without finishing (an interrupt, an error): it leaves the running
        set without arriving at any barrier, so it runs again from the start on resume."""
        with self._lock:
            if self._running.get(agent, 0) > 0:
                self._running[agent] -= 1
                if self._running[agent] == 0:
                    del self._running[agent]
                self._ste_cache = None
                self.history.append((self._step, "cancel", agent))

    def end(self) -> None:
        """The run is over: every agent is unreachable (STE inf) until a new start."""
        with self._lock:
            self._running.clear()
            self._arrived.clear()
            self._ended = True
            self._ste_cache = None

    # ------------------------------------------------------------------ reading
    @property
    def step(self) -> int:
        return self._step

    @property
    def running(self) -> set[str]:
        with self._lock:
            return set(self._running)

    @property
    def arrived(self) -> Mapping[str, frozenset[str]]:
        with self._lock:
            return {k: frozenset(v) for k, v in self._arrived.items() if v}

    @property
    def ended(self) -> bool:
        return self._ended

    def ste(self) -> dict[str, float]:
        """Current STE map: 0 running, ``math.inf`` for agents that cannot run again."""
        with self._lock:
            if self._ste_cache is None:
                if self._ended:
                    self._ste_cache = {a: INF for a in self.graph.agents}
                else:
                    running = set(self._running) if self._started else {START}
                    self._ste_cache = self.graph.steps_to_execution(
                        running, self._arrived, validate=False)
            return dict(self._ste_cache)

    def next_agents(self) -> list[str]:
        """Agents that can run soonest after the current ones (smallest STE > 0)."""
        return next_agents(self.ste())

    def __repr__(self) -> str:
        return (f"WorkflowTracker({self.graph.name!r}, workflow={self.workflow_id!r}, "
                f"step={self._step}, running={sorted(self._running)})")
