"""LangGraph builder -> Agent Step Graph.

Read from the ``StateGraph`` builder (``compiled.builder``), never from ``get_graph()``, which
drops AND joins and guesses edges. The mapping (see ``DESIGN.md``):

=====================================  =========================================================
``add_edge("a", "b")``                 OR edge ``a -> b``
``add_edge(["a", "b"], "c")``          AND group ``{a, b} -> c``
``add_conditional_edges(s, f, map)``   conditional OR edges to the ``path_map`` values (or the
                                       ``Literal[...]`` return hint); without either, to every
                                       node of that graph and END, with a warning
``add_node(n, destinations=...)`` /    conditional OR edges ``n -> each destination``
``-> Command[Literal[...]]``
``add_node(n, defer=True)``            AND over its unconditional predecessors (it runs once,
                                       when they all finished); conditional ones stay OR
``Send("w", ...)``                     an OR edge to ``w`` (from the branch's path_map); at run
                                       time N tasks of ``w`` share one step
error handler of a node                conditional OR edge ``node -> handler``
subgraph node ``sub``                  inlined: its nodes become agents ``sub/<inner>``; edges
                                       into ``sub`` go to its entry agents, edges out of it
                                       leave from its exit agents (those that reach its END);
                                       ``sub`` itself is not an agent (it takes no step of its
                                       own: its inner super-steps are the steps). A node whose
                                       function closes over exactly one compiled graph and
                                       invokes it (langgraph-supervisor's worker nodes) is
                                       inlined the same way
handoff tools (``Command(goto=...,     a ``ToolNode`` inside a subgraph whose tools carry
graph=Command.PARENT)``)               ``metadata["__handoff_destination"]`` (langgraph-supervisor,
                                       langgraph-swarm, or your own) is where the hand-off
                                       happens: conditional edges ``sub/tools -> destination``,
                                       and its edge back to the agent becomes conditional too
                                       (a hand-off leaves the subgraph instead)
a subgraph whose container has no way  its inner END is the outer END (a swarm agent that
out but ``Command`` destinations       answers ends the run): the run may end after its exits
=====================================  =========================================================

Which nodes call an LLM: all, except nodes marked ``add_node(..., metadata={"kvflow":
{"llm": False}})`` (shorthand ``metadata={"kvflow_llm": False}``), nodes whose runnable is
LangGraph's prebuilt ``ToolNode``, and nodes named in ``instrument(..., tool_nodes=[...])``.
Tool nodes are agents with ``llm=False``: they still take a step.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from langgraph.graph import StateGraph
from langgraph.graph.state import CompiledStateGraph

from ..graph import END, START, AgentStepGraph

log = logging.getLogger("kvflow_agents")

LG_START = "__start__"
LG_END = "__end__"
MAX_JOIN_EXPANSION = 64


class KVFlowGraphWarning(UserWarning):
    """The Agent Step Graph had to assume something (unknown branch targets, ...)."""


@dataclass
class _Scope:
    """One (sub)graph being inlined: agent-name prefix and how its names resolve."""

    builder: StateGraph
    prefix: str
    parent: Optional["_Scope"] = None
    # local node -> ASG names it stands for, as a *target* (entries) and as a *source* (exits)
    entries: dict[str, list[str]] = field(default_factory=dict)
    exits: dict[str, list[str]] = field(default_factory=dict)
    start_targets: list[str] = field(default_factory=list)  # ASG agents this graph starts with
    end_sources: list[str] = field(default_factory=list)  # ASG agents that end this graph
    sinks: list[str] = field(default_factory=list)  # ASG agents with no declared way out
    end_is_parent_end: bool = False  # the container has no way out: this END ends the parent
    end_cond: dict[str, bool] = field(default_factory=dict)  # exit agent -> its way out is a choice
    inner: dict[str, "_Scope"] = field(default_factory=dict)  # container node -> its scope
    handoffs: dict[str, list[str]] = field(default_factory=dict)  # tool node -> destinations


@dataclass
class ASGInfo:
    """The Agent Step Graph plus what the runtime needs to map LangGraph tasks onto it."""

    graph: AgentStepGraph
    containers: set[str]  # paths of subgraph nodes ("sub", "sub/inner_sub"): not agents
    warnings: list[str]


HANDOFF_KEY = "__handoff_destination"  # langgraph-supervisor / langgraph-swarm handoff tool metadata


def _is_subgraph(runnable: Any) -> bool:
    return isinstance(runnable, CompiledStateGraph) and getattr(runnable, "builder", None) is not None


def subgraph_of(runnable: Any) -> Optional[CompiledStateGraph]:
    """The compiled graph a node runs: the node itself, or the one compiled graph its function
    closes over (a node that invokes a subgraph, as langgraph-supervisor's ``call_agent``)."""
    if _is_subgraph(runnable):
        return runnable
    found = []
    for fn in (getattr(runnable, "func", None), getattr(runnable, "afunc", None)):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_subgraph(v) and all(v is not f for f in found):
                found.append(v)
    return found[0] if len(found) == 1 else None


def handoff_destinations(runnable: Any) -> list[str]:
    """Agents a prebuilt ``ToolNode`` can hand off to (its tools' ``__handoff_destination``)."""
    if not _is_tool_node(runnable):
        return []
    out = []
    for t in getattr(runnable, "tools_by_name", {}).values():
        md = getattr(t, "metadata", None) or {}
        if isinstance(md.get(HANDOFF_KEY), str):
            out.append(md[HANDOFF_KEY])
    return list(dict.fromkeys(out))


def _is_tool_node(runnable: Any) -> bool:
    try:
        from langgraph.prebuilt import ToolNode
    except Exception:  # noqa: BLE001 — prebuilt not installed
        return False
    return isinstance(runnable, ToolNode)


def node_is_llm(spec: Any, name: str, tool_nodes: Iterable[str] = ()) -> bool:
    md = getattr(spec, "metadata", None) or {}
    kv = md.get("kvflow")
    if isinstance(kv, dict) and "llm" in kv:
        return bool(kv["llm"])
    if "kvflow_llm" in md:
        return bool(md["kvflow_llm"])
    if name in set(tool_nodes):
        return False
    return not _is_tool_node(getattr(spec, "runnable", None))


def _ends_of(ends: Any) -> list[str]:
    """Destinations of a node's ``Command``: a tuple of names, or ``{name: edge label}``."""
    if not ends:
        return []
    return [str(v) for v in ends]  # a dict iterates over its keys: the node names


class _Builder:
    def __init__(self, name: str, tool_nodes: Iterable[str], warn: bool) -> None:
        self.asg = AgentStepGraph(name)
        self.containers: set[str] = set()
        self.tool_nodes = set(tool_nodes)
        self.warn = warn
        self.messages: list[str] = []
        self._pending_defer: list[tuple[_Scope, str]] = []
        self._or_edges: list[tuple[str, str, bool]] = []
        self._joins: list[tuple[list[str], str]] = []
        self._edges_cache: dict[int, list[tuple[str, str, bool]]] = {}

    def note(self, msg: str) -> None:
        self.messages.append(msg)
        if self.warn:
            warnings.warn(msg, KVFlowGraphWarning, stacklevel=4)

    # ------------------------------------------------------------ pass 1: agents
    def declare(self, scope: _Scope) -> None:
        b = scope.builder
        for n, spec in b.nodes.items():
            path = scope.prefix + n
            sub = subgraph_of(spec.runnable)
            if sub is not None:
                self.containers.add(path)
                inner = _Scope(sub.builder, path + "/", scope)
                inner.end_is_parent_end = self._no_way_out(scope, n)
                scope.inner[n] = inner
                self.declare(inner)
                scope.entries[n] = inner.start_targets
                scope.exits[n] = inner.end_sources or inner.sinks or [
                    a for a in self.asg.agents if a.startswith(path + "/")]
            else:
                self.asg.add_agent(path, llm=node_is_llm(spec, n, self.tool_nodes)
                                   and path not in self.tool_nodes)
                scope.entries[n] = [path]
                scope.exits[n] = [path]
                dests = handoff_destinations(spec.runnable)
                if dests:
                    scope.handoffs[n] = dests
        # This graph's own entries/exits (needed by the parent before pass 2 runs).
        for s, d, cond in self._local_edges(scope):
            if s == LG_START and d != LG_END:
                scope.start_targets.extend(self.targets(scope, d))
            if d == LG_END and s != LG_START:
                for src in self.sources(scope, s):
                    scope.end_sources.append(src)
                    scope.end_cond[src] = scope.end_cond.get(src, False) or cond or self._exit_cond(scope, s, src)
        for starts, d in b.waiting_edges:
            if d == LG_END:
                for s in starts:
                    scope.end_sources.extend(self.sources(scope, s))
        # Nodes with no way out end the graph implicitly (LangGraph stops when nothing is
        # triggered): the exits of a subgraph that never names END.
        has_out = {s for s, _d, _c in self._local_edges(scope)}
        has_out.update(s for starts, _d in b.waiting_edges for s in starts)
        for n in b.nodes:
            if n not in has_out:
                scope.sinks.extend(self.sources(scope, n))
        scope.start_targets[:] = list(dict.fromkeys(scope.start_targets))
        scope.end_sources[:] = list(dict.fromkeys(scope.end_sources))
        for n, spec in b.nodes.items():
            if spec.defer and subgraph_of(spec.runnable) is None:
                self._pending_defer.append((scope, n))
        # Edges are added after every scope is declared (names of enclosing scopes resolve).
        self._scopes.append(scope)

    def _exit_cond(self, scope: _Scope, name: str, src: str) -> bool:
        """Leaving container ``name`` from its exit agent ``src`` is a run-time choice (the inner
        edge to END was conditional: a ReAct agent ends only when it calls no tool)."""
        s = self._resolve_scope(scope, name)
        inner = s.inner.get(name) if s is not None else None
        return bool(inner is not None and inner.end_cond.get(src, False))

    def _no_way_out(self, scope: _Scope, n: str) -> bool:
        """Node ``n`` of ``scope`` has no plain edge, branch or join out (``Command`` destinations
        at most): when what it runs ends, the run of ``scope`` ends."""
        b = scope.builder
        return (not any(s == n for s, _d in b.edges) and n not in b.branches
                and not any(n in starts for starts, _d in b.waiting_edges))

    def _handed_off(self, scope: _Scope, container: str) -> set[str]:
        """Destinations of container ``container`` (in ``scope``) reached by its handoff tools."""
        inner = next((s for s in self._scopes_all if s.parent is scope
                      and s.prefix == scope.prefix + container + "/"), None)
        if inner is None:
            return set()
        return {d for dests in inner.handoffs.values() for d in dests}

    def _local_edges(self, scope: _Scope) -> list[tuple[str, str, bool]]:
        """(src, dst, conditional) in this builder's own names; END/START kept as LangGraph's."""
        cached = self._edges_cache.get(id(scope))
        if cached is not None:
            return cached
        b = scope.builder
        out: list[tuple[str, str, bool]] = [(s, d, False) for s, d in b.edges]
        local = list(b.nodes)
        for s, brs in b.branches.items():
            for bname, spec in brs.items():
                if spec.ends:
                    targets = [str(v) for v in spec.ends.values()]
                else:
                    targets = [*local, LG_END]
                    self.note(f"kvflow: conditional edge {bname!r} from {scope.prefix + s!r} has no "
                              "path_map and no Literal return hint: assuming it may go to any node "
                              "(pass path_map= to add_conditional_edges for exact hints)")
                out.extend((s, d, True) for d in targets)
        for n, spec in b.nodes.items():
            handed = self._handed_off(scope, n) if n in self.containers_local(scope) else set()
            for d in _ends_of(spec.ends):
                if d not in handed:  # a handoff tool's Command: edges from the tool node (_handoff_edges)
                    out.append((n, d, True))
            handler = getattr(spec, "error_handler_node", None)
            if handler:
                out.append((n, handler, True))
        self._edges_cache[id(scope)] = out
        return out

    def containers_local(self, scope: _Scope) -> set[str]:
        return {n for n in scope.builder.nodes if scope.prefix + n in self.containers}

    def _handoff_edges(self, scope: _Scope) -> None:
        """``tools -> destination`` for each handoff tool node of ``scope`` (destinations are
        nodes of an enclosing graph: ``Command.PARENT``), conditional; and the tool node's own
        way back to its agent becomes conditional (a hand-off skips it)."""
        for n, dests in scope.handoffs.items():
            src = scope.prefix + n
            parent = scope.parent
            for d in dests:
                tgt = self.targets(parent, d) if parent is not None else []
                if not tgt and d == LG_END:
                    tgt = [END]
                self._or_edges.extend((src, t, True) for t in tgt)
            self._or_edges[:] = [(s, d, True if s == src else c) for s, d, c in self._or_edges]

    # ------------------------------------------------------------ name resolution
    def _resolve_scope(self, scope: _Scope, name: str) -> Optional[_Scope]:
        s: Optional[_Scope] = scope
        while s is not None:
            if name in s.builder.nodes:
                return s
            s = s.parent
        return None

    def targets(self, scope: _Scope, name: str) -> list[str]:
        """ASG agents that run when ``name`` (seen from ``scope``) is triggered."""
        s = self._resolve_scope(scope, name)
        if s is None:
            return []
        return list(s.entries.get(name, []))

    def sources(self, scope: _Scope, name: str) -> list[str]:
        """ASG agents whose finishing means ``name`` (seen from ``scope``) finished."""
        s = self._resolve_scope(scope, name)
        if s is None:
            return []
        return list(s.exits.get(name, []))

    # ------------------------------------------------------------ pass 2: edges
    def connect(self) -> None:
        # successors of each container, by container path, computed from its parent's edges
        for scope in self._scopes:
            for s, d, cond in self._local_edges(scope):
                self._add_or(scope, s, d, cond)
            for starts, d in scope.builder.waiting_edges:
                self._add_and(scope, tuple(starts), d)
        for scope in self._scopes:
            self._handoff_edges(scope)
        self._finish()

    def _targets_or_end(self, scope: _Scope, d: str) -> list[str]:
        if d == LG_END:
            if scope.parent is None:
                return [END]
            if scope.end_is_parent_end:  # nothing follows the container: the run may end here
                return self._targets_or_end(scope.parent, LG_END)
            return []  # an inner END: the container's own out-edges carry on (its exits)
        return self.targets(scope, d)

    def _sources_or_start(self, scope: _Scope, s: str) -> list[str]:
        if s == LG_START:
            if scope.parent is None:
                return [START]
            return []  # an inner START: the container's in-edges lead to its entries
        return self.sources(scope, s)

    def _add_or(self, scope: _Scope, s: str, d: str, cond: bool) -> None:
        for src in self._sources_or_start(scope, s):
            c = cond or (s != LG_START and self._exit_cond(scope, s, src))
            for dst in self._targets_or_end(scope, d):
                if not (src == START and dst == END):
                    self._or_edges.append((src, dst, c))

    def _add_and(self, scope: _Scope, starts: tuple[str, ...], d: str) -> None:
        member_sets = [self.sources(scope, s) for s in starts if s != LG_START]
        member_sets = [m for m in member_sets if m]
        dsts = [x for x in self._targets_or_end(scope, d) if x != END]
        if not member_sets or not dsts:
            return
        groups = list(itertools.islice(itertools.product(*member_sets), MAX_JOIN_EXPANSION + 1))
        if len(groups) > MAX_JOIN_EXPANSION:
            self.note(f"kvflow: join {starts} -> {d!r} expands into too many groups; "
                      "keeping the first exit of each subgraph member")
            groups = [tuple(m[0] for m in member_sets)]
        for dst in dsts:
            for g in groups:
                members = list(dict.fromkeys(g))
                if len(members) >= 2 and dst not in members:
                    self._joins.append((members, dst))
                else:  # a one-member "join" is a plain edge
                    self._or_edges.extend((m, dst, False) for m in members)

    def _finish(self) -> None:
        """Add the collected edges; ``defer=True`` nodes turn their unconditional OR
        predecessors (two or more) into one AND group: they run once, after all finished."""
        deferred: dict[str, list[str]] = {}
        for scope, n in self._pending_defer:
            path = scope.prefix + n
            plain = list(dict.fromkeys(s for s, d, c in self._or_edges
                                       if d == path and not c and s != START))
            if len(plain) >= 2:
                deferred[path] = plain
        for s, d, c in self._or_edges:
            if d in deferred and not c and s in deferred[d]:
                continue
            self.asg.add_edge(s, d, conditional=c)
        for members, dst in self._joins:
            self.asg.add_join(members, dst)
        for dst, members in deferred.items():
            self.asg.add_join(members, dst)

    def build(self, builder: StateGraph) -> ASGInfo:
        self._scopes: list[_Scope] = []
        self._scopes_all = self._scopes
        root = _Scope(builder, "")
        self.declare(root)
        self.connect()
        # Container exits lead to the container's successors: handled by sources()/targets()
        # because a container's exits/entries are its inner agents. A subgraph node whose inner
        # graph never reaches END keeps all its agents as exits (declare()).
        return ASGInfo(self.asg, self.containers, self.messages)


def build_asg(graph: Any, name: str = "workflow", *, tool_nodes: Iterable[str] = (),
              warn: bool = True) -> ASGInfo:
    """The Agent Step Graph of a ``StateGraph`` or compiled graph (from its builder)."""
    builder = graph if isinstance(graph, StateGraph) else getattr(graph, "builder", None)
    if not isinstance(builder, StateGraph):
        raise TypeError(
            "kvflow: this LangGraph object has no StateGraph builder (the functional API "
            "@entrypoint is not supported yet); pass a StateGraph or a compiled StateGraph")
    return _Builder(name, tool_nodes, warn).build(builder)
