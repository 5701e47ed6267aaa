"""The Agent Step Graph (ASG) and steps-to-execution (STE), after KVFlow §3.

An ASG node is an agent: one LLM-invoking node of a workflow (tool nodes are agents with
``llm=False``: they send no request, but still take a step). Predecessors come in two kinds:

- **OR** edges (``add_edge(p, a)``): any one predecessor finishing can trigger ``a``;
- **AND** groups (``add_join([m1, m2], a)``): a barrier, ``a`` waits for every member.

Steps-to-execution of agent ``a`` given the agents now running and the barrier arrivals::

    E(a) = 0                                           if a is running
    E(a) = min( min over OR preds p      (E(p) + 1),
                min over AND groups G    (max over m in G not yet arrived (E(m)) + 1) )

Cycles are allowed: E is the least fixpoint, ``math.inf`` for agents that cannot run again.
Both ``min+1`` and ``max+1`` are *superior functions* (Knuth 1977), and every step costs 1, so
the least fixpoint is found by one breadth-first pass in O(V+E): an agent's value is final the
first time it is reached, and an AND group fires when its last non-arrived member is reached.

The graph is stored in a networkx ``MultiDiGraph`` (validation, export, JSON round-trip); STE
is computed on a compiled integer form that is rebuilt lazily after a mutation.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import networkx as nx

from .errors import GraphError, read_document

if TYPE_CHECKING:  # pragma: no cover
    from .tracker import WorkflowTracker

START = "__start__"
END = "__end__"
_PSEUDO = (START, END)
INF = math.inf


def _check_name(name: Any, what: str = "agent") -> str:
    if not isinstance(name, str) or not name.strip():
        raise GraphError(f"{what} name must be a non-empty string, got {name!r}")
    return name


def next_agents(ste: Mapping[str, float]) -> list[str]:
    """The agents that can run soonest after the running ones: the smallest STE > 0 (``[]``
    if none can run again). What hints send as ``kvflow_next``; the one home of this rule for
    the tracker, the learned tracker and the framework adapters."""
    finite = [v for v in ste.values() if 0 < v < INF]
    if not finite:
        return []
    best = min(finite)
    return [a for a, v in ste.items() if v == best]


@dataclass(frozen=True)
class _Compiled:
    """Integer form of the graph for the BFS: built once per mutation."""

    names: tuple[str, ...]
    index: dict[str, int]
    or_succ: tuple[tuple[int, ...], ...]
    group_target: tuple[int, ...]
    group_members: tuple[tuple[int, ...], ...]
    member_groups: tuple[tuple[int, ...], ...]  # agent -> AND groups it belongs to
    start_succ: tuple[int, ...]


class AgentStepGraph:
    """A workflow's agents and how one triggers the next. Build it, then ask for STE.

    >>> g = AgentStepGraph("loop")
    >>> for a, b in [("planner", "executor"), ("executor", "expresser"),
    ...              ("expresser", "reviewer"), ("reviewer", "planner")]:
    ...     g.add_edge(a, b)
    >>> g.steps_to_execution(running={"executor"})["planner"]
    3
    """

    def __init__(self, name: str = "workflow") -> None:
        self.name = _check_name(name, "graph")
        self._g = nx.MultiDiGraph(name=name)
        self._compiled: _Compiled | None = None

    # ------------------------------------------------------------------ building
    def add_agent(self, name: str, *, llm: bool = True, **attrs: Any) -> "AgentStepGraph":
        """Add (or update) an agent. ``llm=False`` marks a tool node: it takes a step, sends no
        LLM request, so it holds no KV of its own."""
        _check_name(name)
        if name in _PSEUDO:
            raise GraphError(f"{name!r} is reserved for the workflow's start/end")
        if name in self._g:
            self._g.nodes[name].update(llm=bool(llm), **attrs)
        else:
            self._g.add_node(name, llm=bool(llm), and_groups=[], **attrs)
        self._compiled = None
        return self

    def _ensure(self, name: str) -> None:
        _check_name(name)
        if name in _PSEUDO:
            if name not in self._g:
                self._g.add_node(name, llm=False, and_groups=[], pseudo=True)
        elif name not in self._g:
            self.add_agent(name)

    def add_edge(self, src: str, dst: str, *, conditional: bool = False) -> "AgentStepGraph":
        """OR edge: ``dst`` may run one step after ``src`` finishes. ``conditional`` marks edges
        that are only taken on some runs (branches, ``Command``): still OR for STE, since
        STE is a lower bound on when the agent can run."""
        if src == END:
            raise GraphError("no edge can leave the workflow's end")
        if dst == START:
            raise GraphError("no edge can enter the workflow's start")
        self._ensure(src)
        self._ensure(dst)
        key = "or"
        if self._g.has_edge(src, dst, key):
            # A plain edge wins over a conditional one: it is always taken.
            self._g.edges[src, dst, key]["conditional"] &= bool(conditional)
        else:
            self._g.add_edge(src, dst, key=key, kind="or", conditional=bool(conditional))
        self._compiled = None
        return self

    def add_join(self, members: Iterable[str], dst: str) -> "AgentStepGraph":
        """AND barrier: ``dst`` runs one step after *all* ``members`` have finished."""
        members = list(members)
        for m in members:
            _check_name(m)
        _check_name(dst)
        if len(set(members)) < 2:
            raise GraphError(f"a join into {dst!r} needs at least two distinct members, got {members}")
        if dst in members:
            raise GraphError(f"self-join: {dst!r} cannot wait for itself")
        if dst in _PSEUDO or any(m in _PSEUDO for m in members):
            raise GraphError("joins connect agents, not the workflow's start/end")
        for m in members:
            self._ensure(m)
        self._ensure(dst)
        group = sorted(set(members))
        groups = self._g.nodes[dst]["and_groups"]
        if group not in groups:
            groups.append(group)
            gid = len(groups) - 1
            for m in group:
                self._g.add_edge(m, dst, key=f"and:{gid}", kind="and", group=gid)
        self._compiled = None
        return self

    # ------------------------------------------------------------------ reading
    @property
    def agents(self) -> list[str]:
        """Agents in insertion order (START/END excluded)."""
        return [n for n in self._g.nodes if n not in _PSEUDO]

    def is_llm(self, agent: str) -> bool:
        self._known(agent)
        return bool(self._g.nodes[agent]["llm"])

    def or_predecessors(self, agent: str) -> list[str]:
        self._known(agent)
        return [p for p, _, k in self._g.in_edges(agent, keys=True) if k == "or"]

    def successors(self, agent: str) -> list[str]:
        """Agents that may run right after ``agent`` (OR targets and joins it belongs to)."""
        self._known(agent, allow_start=True)
        return list(dict.fromkeys(d for d in self._g.successors(agent) if d != END))

    def joins(self, agent: str) -> list[list[str]]:
        """The AND groups ``agent`` waits on."""
        self._known(agent)
        return [list(g) for g in self._g.nodes[agent]["and_groups"]]

    def join_targets(self, member: str) -> list[str]:
        """Agents that have an AND group containing ``member``."""
        self._known(member)
        return list(dict.fromkeys(d for _, d, k in self._g.out_edges(member, keys=True)
                                  if k.startswith("and:")))

    @property
    def entry_agents(self) -> list[str]:
        return [d for d in self._g.successors(START)] if START in self._g else []

    def __contains__(self, agent: object) -> bool:
        return isinstance(agent, str) and agent in self._g and agent not in _PSEUDO

    def __len__(self) -> int:
        return len(self.agents)

    def _known(self, agent: str, *, allow_start: bool = False) -> None:
        if agent == START and allow_start and START in self._g:
            return
        if agent not in self:
            raise GraphError(f"unknown agent {agent!r} in graph {self.name!r}")

    @property
    def nx_graph(self) -> nx.MultiDiGraph:
        """The underlying networkx graph (read it; mutate through this class)."""
        return self._g

    # ------------------------------------------------------------------ STE
    def _compile(self) -> _Compiled:
        if self._compiled is not None:
            return self._compiled
        names = tuple(self.agents)
        index = {n: i for i, n in enumerate(names)}
        or_succ: list[list[int]] = [[] for _ in names]
        start_succ: list[int] = []
        for s, d, k in self._g.edges(keys=True):
            if k != "or" or d == END:
                continue
            if s == START:
                start_succ.append(index[d])
            else:
                or_succ[index[s]].append(index[d])
        group_target: list[int] = []
        group_members: list[tuple[int, ...]] = []
        member_groups: list[list[int]] = [[] for _ in names]
        for n in names:
            for grp in self._g.nodes[n]["and_groups"]:
                gid = len(group_target)
                group_target.append(index[n])
                group_members.append(tuple(index[m] for m in grp))
                for m in grp:
                    member_groups[index[m]].append(gid)
        if START not in self._g:
            # No declared entry: agents that nothing triggers are where a run begins.
            start_succ = [index[n] for n in names
                          if not any(True for _ in self._g.predecessors(n))]
        self._compiled = _Compiled(
            names=names, index=index,
            or_succ=tuple(tuple(dict.fromkeys(x)) for x in or_succ),
            group_target=tuple(group_target), group_members=tuple(group_members),
            member_groups=tuple(tuple(x) for x in member_groups),
            start_succ=tuple(dict.fromkeys(start_succ)),
        )
        return self._compiled

    def validate_state(self, running: Iterable[str], arrived: Mapping[str, Iterable[str]]) -> None:
        """Raise :class:`GraphError` for a runtime state that names what the graph lacks."""
        for a in running:
            if a != START:
                self._known(a)
        for target, members in arrived.items():
            self._known(target)
            allowed = {m for g in self._g.nodes[target]["and_groups"] for m in g}
            for m in members:
                if m not in allowed:
                    raise GraphError(f"{m!r} arrived at {target!r}, but {target!r} has no join "
                                     f"with {m!r} (joins: {self.joins(target)})")

    def steps_to_execution(self, running: Iterable[str] = (),
                           arrived: Mapping[str, Iterable[str]] | None = None,
                           *, validate: bool = True) -> dict[str, float]:
        """STE of every agent: ``{agent: int}``, ``math.inf`` where it cannot run again.

        ``running``: agents executing now (STE 0); ``START`` means "the run is about to begin".
        ``arrived``: per join target, the members that already finished at its barrier.
        """
        running = set(running)
        arrived = arrived or {}
        if validate:
            self.validate_state(running, arrived)
        c = self._compile()
        dist = self._bfs(c, running, arrived)
        return {n: (INF if d < 0 else d) for n, d in zip(c.names, dist)}

    def next_run_ste(self, ste: Mapping[str, float]) -> dict[str, float]:
        """``ste`` with the app's *next run* added: an app invoked again after this run ends (the
        next question, the next turn) starts at its entry agents one step after the last agent
        before END, so each entry agent gets min(its STE, min over END's predecessors of STE +
        1). Opt-in (``kvflow.instrument(..., next_run=True)``): it predicts a workflow the
        server has not seen yet, so the server can bring the entry agent's prefix back while
        the current run's last agent runs instead of after the next run's first request."""
        out = dict(ste)
        if END not in self._g:
            return out
        last = min((ste.get(u, INF) for u in self._g.predecessors(END) if u not in _PSEUDO),
                   default=INF)
        if last < INF:
            c = self._compile()
            for i in c.start_succ:
                a = c.names[i]
                out[a] = min(out.get(a, INF), last + 1)
        return out

    @staticmethod
    def _bfs(c: _Compiled, running: set[str], arrived: Mapping[str, Iterable[str]]) -> list[int]:
        """One breadth-first pass; the queue stays sorted by distance, so a node's first
        distance is final (unit steps, superior functions)."""
        index, names, group_target = c.index, c.names, c.group_target
        dist = [-1] * len(names)
        # Per AND group: the non-arrived members the BFS has not reached yet.
        remaining = [len(m) for m in c.group_members]
        arrived_in: list[frozenset[int]] = [frozenset()] * len(remaining)
        if arrived:
            for gid, members in enumerate(c.group_members):
                got = arrived.get(names[group_target[gid]])
                if got:
                    got_idx = frozenset(index[a] for a in got if a in index)
                    arrived_in[gid] = got_idx
                    remaining[gid] = sum(1 for m in members if m not in got_idx)
        queue: deque[int] = deque()
        for a in running:
            i = index.get(a)
            if i is not None and dist[i] < 0:
                dist[i] = 0
                queue.append(i)
        # Distance-1 seeds: entry agents before the run begins, and joins whose members
        # have all arrived (they fire on the next step). Queued after every distance-0 node.
        seeds = list(c.start_succ) if START in running else []
        seeds.extend(group_target[g] for g, r in enumerate(remaining) if r == 0)
        for i in seeds:
            if dist[i] < 0:
                dist[i] = 1
                queue.append(i)
        or_succ, member_groups = c.or_succ, c.member_groups
        while queue:
            u = queue.popleft()
            du1 = dist[u] + 1
            for v in or_succ[u]:
                if dist[v] < 0:
                    dist[v] = du1
                    queue.append(v)
            for gid in member_groups[u]:
                if u in arrived_in[gid]:
                    continue  # an arrived member no longer holds its barrier
                remaining[gid] -= 1
                if remaining[gid] == 0:
                    v = group_target[gid]
                    if dist[v] < 0:
                        dist[v] = du1
                        queue.append(v)
        return dist

    def tracker(self, workflow_id: str | None = None) -> "WorkflowTracker":
        """A runtime tracker for one workflow instance (one LangGraph thread, one team run)."""
        from .tracker import WorkflowTracker

        return WorkflowTracker(self, workflow_id=workflow_id)

    # ------------------------------------------------------------------ export
    def to_json(self) -> str:
        """JSON round-trip form (networkx node-link data)."""
        data = nx.node_link_data(self._g, edges="edges")
        return json.dumps({"kvflow_asg": 1, "name": self.name, "graph": data}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AgentStepGraph":
        doc = read_document(text, "kvflow_asg", "an Agent Step Graph")
        try:
            g = nx.node_link_graph(doc["graph"], directed=True, multigraph=True, edges="edges")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GraphError(f"cannot read Agent Step Graph JSON: {e}") from e
        out = cls(doc.get("name", "workflow"))
        for n, attrs in g.nodes(data=True):
            if n in _PSEUDO:
                out._ensure(n)
            else:
                extra = {k: v for k, v in attrs.items() if k not in ("llm", "and_groups")}
                out.add_agent(n, llm=attrs.get("llm", True), **extra)
        for s, d, k, attrs in g.edges(keys=True, data=True):
            if k == "or":
                out.add_edge(s, d, conditional=attrs.get("conditional", False))
        for n, attrs in g.nodes(data=True):
            for grp in attrs.get("and_groups", []):
                out.add_join(grp, n)
        return out

    def to_mermaid(self) -> str:
        """Mermaid flowchart: solid OR edges, dotted conditional ones, AND joins via a bar."""
        ids = {n: f"n{i}" for i, n in enumerate(self._g.nodes)}
        lines = ["flowchart TD"]
        for n in self._g.nodes:
            label = {START: "START", END: "END"}.get(n, n)
            shape = ("([", "])") if n in _PSEUDO else (("[", "]") if self._g.nodes[n]["llm"] else ("[[", "]]"))
            lines.append(f'    {ids[n]}{shape[0]}"{label}"{shape[1]}')
        for s, d, k, attrs in self._g.edges(keys=True, data=True):
            if k == "or":
                arrow = "-.->" if attrs.get("conditional") else "-->"
                lines.append(f"    {ids[s]} {arrow} {ids[d]}")
        for n in self._g.nodes:
            for gid, grp in enumerate(self._g.nodes[n]["and_groups"]):
                bar = f"{ids[n]}_and{gid}"
                lines.append(f'    {bar}{{"AND"}}')
                lines.extend(f"    {ids[m]} --> {bar}" for m in grp)
                lines.append(f"    {bar} --> {ids[n]}")
        return "\n".join(lines) + "\n"

    def to_dot(self) -> str:
        """Graphviz DOT: AND edges drawn bold with a shared join label."""
        def q(s: str) -> str:
            return '"' + s.replace('"', '\\"') + '"'

        lines = [f"digraph {q(self.name)} {{", "  rankdir=TB;"]
        for n in self._g.nodes:
            shape = "oval" if n in _PSEUDO else ("box" if self._g.nodes[n]["llm"] else "component")
            lines.append(f"  {q(n)} [shape={shape}];")
        for s, d, k, attrs in self._g.edges(keys=True, data=True):
            if k == "or":
                style = "dashed" if attrs.get("conditional") else "solid"
                lines.append(f"  {q(s)} -> {q(d)} [style={style}];")
            else:
                lines.append(f"  {q(s)} -> {q(d)} [style=bold, label={q('AND' + str(attrs['group']))}];")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"AgentStepGraph({self.name!r}, agents={len(self)}, edges={self._g.number_of_edges()})"
