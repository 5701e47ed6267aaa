"""Scoring next-agent predictions of learned transitions on recorded runs: what
``kvflow bench predict`` and the tests use (the adapters need only :mod:`.learned`).

* :func:`train` learns a :class:`~.learned.TransitionModel` from runs;
  :func:`evaluate_predictions` replays runs and measures how often the true next agent had the
  lowest STE, exact vs learned (:class:`PredictionReport`);
* :func:`selector_graph` / :func:`synthetic_selector_traces`: seeded runs of a Selector-like
  workflow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .errors import GraphError
from .learned import LearnedTracker, TraceRun, TransitionModel, conditional_successors, wire_ste
from .step_graph import END, INF, START, AgentStepGraph

__all__ = ["PredictionReport", "evaluate_predictions", "train", "selector_graph",
           "synthetic_selector_traces"]

@dataclass
class PredictionReport:
    """How often the true next agent had the lowest STE (ties split: 1/k credit for k tied)."""

    decisions: int = 0
    exact_hits: float = 0.0
    learned_hits: float = 0.0
    exact_unique: int = 0     # decisions where the true next was the *only* lowest
    learned_unique: int = 0
    per_app: dict[str, list[float]] = field(default_factory=dict)

    @property
    def exact_accuracy(self) -> float:
        return self.exact_hits / self.decisions if self.decisions else 0.0

    @property
    def learned_accuracy(self) -> float:
        return self.learned_hits / self.decisions if self.decisions else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "exact_accuracy": round(self.exact_accuracy, 4),
                "learned_accuracy": round(self.learned_accuracy, 4),
                "exact_unique_hits": self.exact_unique, "learned_unique_hits": self.learned_unique}


def _score(ste: Mapping[str, float], running: set[str], truth: Sequence[str]) -> tuple[float, bool]:
    cand = {a: v for a, v in ste.items() if a not in running and v < INF}
    if not cand:
        return 0.0, False
    best = min(cand.values())
    lowest = [a for a, v in cand.items() if v == best]
    hit = sum(1 for a in lowest if a in truth) / len(lowest)
    return hit, (len(lowest) == 1 and lowest[0] in truth)


def evaluate_predictions(graphs: Mapping[str, AgentStepGraph], runs: Iterable[TraceRun],
                         model: TransitionModel, *, learn: bool = True,
                         only_choices: bool = True, use_wire: bool = True) -> PredictionReport:
    """Replay ``runs``: before each step, is a true next agent the one with the lowest STE?

    Exact = the graph's best-case STE; learned = :meth:`TransitionModel.wire_ste` (or the float
    expected STE with ``use_wire=False``). ``learn`` updates ``model`` after each run (online).
    ``only_choices`` scores only steps where the next agent was chosen at run time (the state
    has a conditional successor); deterministic steps are right by construction.
    """
    report = PredictionReport()
    for run in runs:
        g = graphs.get(run.app)
        if g is None:
            raise GraphError(f"no graph for app {run.app!r} in the trace")
        tr = LearnedTracker(g, model, app=run.app, learn=False)
        prev: list[str] = [START]
        for i, step in enumerate(run.steps):
            running = set(prev)
            if not only_choices or any(conditional_successors(g, u) for u in running):
                arrived = tr.arrived if i else {}
                exact = g.steps_to_execution(running, arrived, validate=False)
                learned_f = model.expected_ste(g, running, arrived, app=run.app,
                                               after=tr.contexts() if i else None)
                learned = wire_ste(exact, learned_f) if use_wire else learned_f
                eh, eu = _score(exact, running - {START}, step)
                lh, lu = _score(learned, running - {START}, step)
                report.decisions += 1
                report.exact_hits += eh
                report.learned_hits += lh
                report.exact_unique += eu
                report.learned_unique += lu
                app_row = report.per_app.setdefault(run.app, [0, 0.0, 0.0])
                app_row[0] += 1
                app_row[1] += eh
                app_row[2] += lh
            # advance the tracker through this step
            for a in prev:
                if a != START and a in tr.running:
                    tr.finish(a)
            for a in step:
                tr.start(a)
            prev = step
        if learn:
            _learn_run(model, g, run)
    return report


def _learn_run(model: TransitionModel, graph: AgentStepGraph, run: TraceRun) -> None:
    """Count one recorded run, as a live :class:`LearnedTracker` would have (contexts included)."""
    tr = LearnedTracker(graph, model, app=run.app)
    for step in run.steps:
        for a in list(tr.running):
            tr.finish(a)
        for a in step:
            tr.start(a)
    for a in list(tr.running):
        tr.finish(a)
    tr.end()


def train(model: TransitionModel, graphs: Mapping[str, AgentStepGraph], runs: Iterable[TraceRun]) -> None:
    """Count the conditional transitions of ``runs`` into ``model``."""
    for run in runs:
        _learn_run(model, graphs[run.app], run)


# ---------------------------------------------------------------------------- synthetic
def selector_graph(agents: Sequence[str], *, app: str = "selector", repeat: bool = False) -> AgentStepGraph:
    """A Selector-like workflow: any agent may follow any (conditional), and start or end it."""
    g = AgentStepGraph(app)
    for a in agents:
        g.add_edge(START, a, conditional=True)
        g.add_edge(a, END, conditional=True)
        for b in agents:
            if a != b or repeat:
                g.add_edge(a, b, conditional=True)
    return g


def synthetic_selector_traces(n_agents: int = 5, runs: int = 200, *, seed: int = 0,
                              skew: float = 0.7, min_len: int = 4, max_len: int = 12,
                              app: str = "selector") -> tuple[dict[str, AgentStepGraph], list[TraceRun]]:
    """Seeded runs of a Selector-like workflow whose hidden router prefers one successor per
    agent with probability ``skew`` (else uniform over the others). Run lengths are uniform in
    ``[min_len, max_len]``. Returns ``(graphs, runs)`` as :func:`read_traces` does."""
    if n_agents < 2:
        raise GraphError("a selector workflow needs at least two agents")
    rng = random.Random(seed)
    agents = [f"agent_{i}" for i in range(n_agents)]
    favourite = {a: rng.choice([b for b in agents if b != a]) for a in agents}
    first = rng.choice(agents)
    out: list[TraceRun] = []
    for r in range(runs):
        length = rng.randint(min_len, max_len)
        cur = first if rng.random() < skew else rng.choice(agents)
        steps = [[cur]]
        for _ in range(length - 1):
            others = [b for b in agents if b != cur]
            cur = favourite[cur] if rng.random() < skew else rng.choice(others)
            steps.append([cur])
        out.append(TraceRun(app=app, steps=steps, workflow=f"{app}-{r}"))
    return {app: selector_graph(agents, app=app)}, out
