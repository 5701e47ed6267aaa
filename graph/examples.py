"""Agent Step Graphs used in docs, demos and benchmarks (no framework needed)."""

from __future__ import annotations

import random

from .step_graph import END, START, AgentStepGraph


def peer_graph(executors: int = 3, *, jump: str = "expressing") -> AgentStepGraph:
    """PEER (Plan / Execute / Express / Review): the planner fans out to parallel executors,
    an AND barrier joins them into the expresser, the reviewer sends failed answers back to
    the expresser (default) or the planner (``jump="planning"``)."""
    g = AgentStepGraph("peer")
    g.add_edge(START, "planner")
    names = [f"executor_{i + 1}" for i in range(executors)]
    for e in names:
        g.add_edge("planner", e)
    g.add_join(names, "expresser")
    g.add_edge("expresser", "reviewer")
    back = {"expressing": "expresser", "planning": "planner"}[jump]
    g.add_edge("reviewer", back, conditional=True)
    g.add_edge("reviewer", END, conditional=True)
    return g


def cycle_graph(n: int = 4, names: list[str] | None = None) -> AgentStepGraph:
    """The paper's cyclic workflow: agent 0 → 1 → … → n-1 → 0."""
    names = names or [f"agent_{i}" for i in range(n)]
    g = AgentStepGraph(f"cycle{len(names)}")
    g.add_edge(START, names[0])
    for a, b in zip(names, names[1:] + names[:1]):
        g.add_edge(a, b)
    return g


def random_graph(n: int, *, seed: int = 0, extra_edges: float = 1.5, join_fraction: float = 0.1) -> AgentStepGraph:
    """A random workflow of ``n`` agents: a ring (so every agent recurs), extra random OR
    edges (``extra_edges`` per agent) and AND joins on ``join_fraction`` of the agents."""
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(n)]
    g = AgentStepGraph(f"random{n}")
    g.add_edge(START, names[0])
    for a, b in zip(names, names[1:] + names[:1]):
        g.add_edge(a, b)
    for _ in range(int(extra_edges * n)):
        a, b = rng.sample(names, 2)
        g.add_edge(a, b, conditional=True)
    for _ in range(max(1, int(join_fraction * n)) if n >= 3 else 0):
        dst = rng.choice(names)
        members = rng.sample([x for x in names if x != dst], k=min(3, n - 1))
        g.add_join(members, dst)
    return g
