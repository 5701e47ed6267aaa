"""AutoGen agentchat team → Agent Step Graph (structure only; runtime tracking is in
:mod:`kvflow_agents.adapters.autogen`).

Mapping (autogen-agentchat 0.7.x, read from the team's own attributes):

``GraphFlow`` (``team._graph``, a ``DiGraph``)
    Follow the *edges*, as ``GraphFlowManager`` does at run time. Per target and per
    ``activation_group``: ``activation_condition="all"`` → one AND join over the group's
    sources (a single source is a plain edge); ``"any"`` → OR edges. Groups are OR'ed. An edge
    with a ``condition`` (string or callable) is a conditional OR edge. Node-level
    ``add_node(activation=...)`` is ignored: AutoGen never reads it. ``START`` → the start
    nodes (``get_start_nodes()``: the entry point, or the nodes without parents); leaf nodes
    → ``END``.
``RoundRobinGroupChat``
    A ring ``p0 → p1 → … → p0``; ``START → p0``; every agent may end the run (conditional).
``SelectorGroupChat``
    Any participant may follow any (conditional edges; self-loops only with
    ``allow_repeated_speaker``), start or end the run. The selector itself is an extra agent,
    ``selector`` (``<team>/selector`` when nested): it runs between every two turns, so it is
    not an edge of the graph but an *overlay* whose STE the adapter sets (0 while it chooses,
    1 while a participant of its team runs). ``llm=False`` when a ``selector_func`` is set.
``Swarm``
    ``p → h.target`` for each hand-off of ``p`` (to a participant), and ``p → p`` (without a
    hand-off the same agent speaks again), all conditional; ``START → p0``; any may end.
Nested teams
    A participant that is itself a team is recursed into with ``team/agent`` names: edges into
    it go to its entry agents, edges out of it leave from its exit agents (leaves of a
    ``GraphFlow``; any agent of the other teams), conditionally when there are several.
    (``GraphFlow`` itself only takes ``ChatAgent`` participants, so joins are over agents.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvflow_agents.graph import END, START, AgentStepGraph

SELECTOR = "selector"


def _cls_names(obj: Any) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def team_kind(team: Any) -> Optional[str]:
    names = _cls_names(team)
    for cls, kind in (("GraphFlow", "graphflow"), ("SelectorGroupChat", "selector"),
                      ("Swarm", "swarm"), ("RoundRobinGroupChat", "roundrobin"),
                      ("MagenticOneGroupChat", "magentic")):
        if cls in names:
            return kind
    if "BaseGroupChat" in names:
        return "team"
    return None


def is_team(obj: Any) -> bool:
    try:
        from autogen_agentchat.base import Team
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, Team)


def uses_llm(agent: Any) -> bool:
    """Does this participant send LLM requests of its own? (Has a model client.)"""
    return getattr(agent, "_model_client", None) is not None


@dataclass
class TeamSpec:
    """One (possibly nested) team of an instrumented app, with its names in the ASG."""

    team: Any
    kind: str
    prefix: str                        # "" for the root, "inner/" for a nested team
    team_id: str
    manager_name: str                  # AutoGen's group chat manager agent name
    participants: dict[str, str] = field(default_factory=dict)   # local name -> ASG name
    children: dict[str, "TeamSpec"] = field(default_factory=dict)  # local name -> nested team
    router: Optional[str] = None       # ASG name of the selector overlay agent
    router_llm: bool = False
    entries: list[tuple[str, bool]] = field(default_factory=list)
    exits: list[str] = field(default_factory=list)
    parent: Optional["TeamSpec"] = None

    def all_specs(self) -> list["TeamSpec"]:
        out = [self]
        for c in self.children.values():
            out.extend(c.all_specs())
        return out

    def members(self) -> list[str]:
        """ASG names of the agents this team runs directly or through nested teams."""
        out = [n for local, n in self.participants.items() if local not in self.children]
        for c in self.children.values():
            out.extend(c.members())
        return out


class _Builder:
    def __init__(self, graph: AgentStepGraph) -> None:
        self.g = graph

    # ins: where edges into a participant land; outs: where edges out of it leave from
    def emit(self, team: Any, prefix: str, parent: Optional[TeamSpec]) -> TeamSpec:
        kind = team_kind(team) or "team"
        spec = TeamSpec(team=team, kind=kind, prefix=prefix, team_id=str(team._team_id),
                        manager_name=str(getattr(team, "_group_chat_manager_name", "")), parent=parent)
        participants = list(getattr(team, "_participants", []))
        ins: dict[str, list[tuple[str, bool]]] = {}
        outs: dict[str, list[str]] = {}
        for p in participants:
            local = p.name
            full = prefix + local
            spec.participants[local] = full
            if is_team(p):
                child = self.emit(p, full + "/", spec)
                spec.children[local] = child
                ins[local] = list(child.entries)
                outs[local] = list(child.exits)
            else:
                self.g.add_agent(full, llm=uses_llm(p), framework="autogen")
                ins[local] = [(full, False)]
                outs[local] = [full]
        names = [p.name for p in participants]

        def edge(src: str, dst: str, conditional: bool) -> None:
            multi_exit = len(outs[src]) > 1
            for o in outs[src]:
                for i, ci in ins[dst]:
                    self.g.add_edge(o, i, conditional=conditional or ci or multi_exit)

        def entry(local: str, conditional: bool) -> None:
            spec.entries.extend((i, conditional or ci) for i, ci in ins[local])

        if kind == "graphflow":
            dg = team._graph
            for s in sorted(dg.get_start_nodes()):
                entry(s, False)
            groups: dict[tuple[str, str], tuple[str, list[tuple[str, bool]]]] = {}
            for node in dg.nodes.values():
                for e in node.edges:
                    cond = e.condition is not None or getattr(e, "condition_function", None) is not None
                    key = (e.target, e.activation_group or e.target)
                    mode, srcs = groups.setdefault(key, (e.activation_condition, []))
                    srcs.append((node.name, cond))
            for (target, _group), (mode, srcs) in groups.items():
                distinct = list(dict.fromkeys(s for s, _ in srcs))
                if mode == "all" and len(distinct) > 1:
                    # GraphFlow participants are ChatAgents (it rejects teams): one out each
                    members = [outs[s][0] for s in distinct]
                    for i, _ci in ins[target]:
                        self.g.add_join(members, i)
                else:
                    for s, cond in srcs:
                        edge(s, target, cond)
            for leaf in sorted(dg.get_leaf_nodes()):
                spec.exits.extend(outs[leaf])
            spec.exits = list(dict.fromkeys(spec.exits))
        elif kind == "roundrobin":
            for a, b in zip(names, names[1:] + names[:1]):
                edge(a, b, False)
            if names:
                entry(names[0], False)
            spec.exits = [o for n in names for o in outs[n]]
        elif kind == "swarm":
            for p in participants:
                targets = [h.target for h in getattr(p, "_handoffs", {}).values()]
                for t in dict.fromkeys([p.name] + targets):
                    if t in ins:
                        edge(p.name, t, True)
            if names:
                entry(names[0], False)
            spec.exits = [o for n in names for o in outs[n]]
        else:  # selector, magentic, any other group chat: anyone may follow anyone
            repeat = bool(getattr(team, "_allow_repeated_speaker", kind != "selector"))
            for a in names:
                entry(a, True)
                for b in names:
                    if a != b or repeat:
                        edge(a, b, True)
            spec.exits = [o for n in names for o in outs[n]]
            if kind in ("selector", "magentic"):
                router = prefix + (SELECTOR if SELECTOR not in spec.participants else spec.manager_name)
                spec.router = router
                spec.router_llm = getattr(team, "_selector_func", None) is None
                self.g.add_agent(router, llm=spec.router_llm, framework="autogen", router=True)
        return spec


def compile_team(team: Any, name: Optional[str] = None) -> tuple[AgentStepGraph, TeamSpec]:
    """The Agent Step Graph of an AutoGen team, and the team tree with its ASG names."""
    graph = AgentStepGraph(name or str(getattr(team, "name", None) or type(team).__name__))
    spec = _Builder(graph).emit(team, "", None)
    for i, c in spec.entries:
        graph.add_edge(START, i, conditional=c)
    end_conditional = spec.kind != "graphflow"
    for o in spec.exits:
        graph.add_edge(o, END, conditional=end_conditional)
    return graph, spec


def compile_digraph(digraph: Any, name: str = "GraphFlow") -> AgentStepGraph:
    """The ASG of a bare ``DiGraph`` (``DiGraphBuilder.build()``), every node an LLM agent."""

    class _Stub:
        def __init__(self, n: str) -> None:
            self.name = n
            self._model_client = True

    class _Flow:
        _team_id = "digraph"
        _group_chat_manager_name = "GraphManager"

        def __init__(self) -> None:
            self._graph = digraph
            self._participants = [_Stub(n) for n in digraph.nodes]

    graph = AgentStepGraph(name)
    b = _Builder(graph)
    # team_kind() looks at class names: route the stub through the GraphFlow branch
    _Flow.__name__ = "GraphFlow"
    spec = b.emit(_Flow(), "", None)
    for i, c in spec.entries:
        graph.add_edge(START, i, conditional=c)
    for o in spec.exits:
        graph.add_edge(o, END)
    return graph
