"""LangGraph builder -> Agent Step Graph: each mapping of the issue, checked on real builders."""

from __future__ import annotations

import math
import operator
import warnings
from typing import Annotated, Literal, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send

from kvflow_agents.adapters.langgraph import KVFlowGraphWarning, build_asg, instrument

INF = math.inf


class S(TypedDict, total=False):
    log: Annotated[list, operator.add]


def noop(state):
    return {}


def graph(*nodes, **kw):
    g = StateGraph(S)
    for n in nodes:
        g.add_node(n, noop, **kw.get(n, {}))
    return g


def or_edges(asg):
    return sorted((s, d, a["conditional"]) for s, d, k, a in asg.nx_graph.edges(keys=True, data=True)
                  if k == "or")


def test_plain_edges_are_or_and_list_edges_are_and():
    g = graph("a", "b", "c", "d")
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("a", "c")
    g.add_edge(["b", "c"], "d")
    g.add_edge("d", END)
    asg = build_asg(g).graph
    assert or_edges(asg) == [("__start__", "a", False), ("a", "b", False), ("a", "c", False),
                             ("d", "__end__", False)]
    assert asg.joins("d") == [["b", "c"]]
    assert asg.steps_to_execution({"b"}, {"d": {"c"}}) == {"a": INF, "b": 0, "c": INF, "d": 1}


def test_conditional_edges_with_path_map_dict_list_and_literal():
    g = graph("r", "x", "y", "z")
    g.add_edge(START, "r")
    g.add_conditional_edges("r", lambda s: "x", {"go_x": "x", "go_y": "y"})
    g.add_conditional_edges("x", lambda s: ["z"], ["z"])

    def route(s) -> Literal["z", "__end__"]:
        return "z"

    g.add_conditional_edges("y", route)
    asg = build_asg(g).graph
    assert or_edges(asg) == [("__start__", "r", False), ("r", "x", True), ("r", "y", True),
                             ("x", "z", True), ("y", "__end__", True), ("y", "z", True)]


def test_conditional_edge_without_hint_goes_anywhere_with_a_warning():
    g = graph("r", "x", "y")
    g.add_edge(START, "r")
    g.add_conditional_edges("r", lambda s: "x")
    with pytest.warns(KVFlowGraphWarning, match="no path_map"):
        info = build_asg(g)
    assert {d for s, d, c in or_edges(info.graph) if s == "r"} == {"r", "x", "y", "__end__"}
    assert len(info.warnings) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_asg(g, warn=False)


def test_command_destinations_and_command_literal_annotation():
    def typed(s) -> Command[Literal["b", "c"]]:
        return Command(goto="b")

    g = StateGraph(S)
    g.add_node("a", noop, destinations=("b", "c"))
    g.add_node("t", typed)
    g.add_node("b", noop)
    g.add_node("c", noop)
    g.add_node("d", noop, destinations={"b": "to b"})
    g.add_edge(START, "a")
    edges = or_edges(build_asg(g).graph)
    assert ("a", "b", True) in edges and ("a", "c", True) in edges
    assert ("t", "b", True) in edges and ("t", "c", True) in edges
    assert ("d", "b", True) in edges


def test_defer_is_an_and_over_unconditional_predecessors():
    g = StateGraph(S)
    for n in ("a", "b", "c", "e"):
        g.add_node(n, noop)
    g.add_node("d", noop, defer=True)
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("a", "c")
    g.add_edge("c", "e")
    g.add_edge("b", "d")
    g.add_edge("e", "d")
    asg = build_asg(g).graph
    assert asg.joins("d") == [["b", "e"]]
    assert asg.or_predecessors("d") == []
    assert asg.steps_to_execution({"b", "c"})["d"] == 2  # after e (c -> e -> d), not after b


def test_send_target_comes_from_the_path_map():
    g = graph("p", "w")
    g.add_edge(START, "p")
    g.add_conditional_edges("p", lambda s: [Send("w", {})], ["w"])
    assert ("p", "w", True) in or_edges(build_asg(g).graph)


def test_subgraphs_are_inlined_recursively_with_parent_child_names():
    inner2 = graph("x", "y")
    inner2.add_edge(START, "x")
    inner2.add_edge("x", "y")
    inner = StateGraph(S)
    inner.add_node("i1", noop)
    inner.add_node("deep", inner2.compile())
    inner.add_node("i2", noop)
    inner.add_edge(START, "i1")
    inner.add_edge("i1", "deep")
    inner.add_edge("deep", "i2")
    inner.add_edge("i2", END)
    g = StateGraph(S)
    g.add_node("a", noop)
    g.add_node("sub", inner.compile())
    g.add_node("b", noop)
    g.add_node("c", noop)
    g.add_edge(START, "a")
    g.add_edge("a", "sub")
    g.add_edge("a", "c")
    g.add_edge(["sub", "c"], "b")  # a join whose member is a subgraph: waits for its exit
    info = build_asg(g)
    asg = info.graph
    assert asg.agents == ["a", "sub/i1", "sub/deep/x", "sub/deep/y", "sub/i2", "b", "c"]
    assert info.containers == {"sub", "sub/deep"}
    assert or_edges(asg) == [("__start__", "a", False), ("a", "c", False), ("a", "sub/i1", False),
                             ("sub/deep/x", "sub/deep/y", False), ("sub/deep/y", "sub/i2", False),
                             ("sub/i1", "sub/deep/x", False)]
    assert asg.joins("b") == [["c", "sub/i2"]]
    ste = asg.steps_to_execution({"a"})
    assert ste == {"a": 0, "sub/i1": 1, "sub/deep/x": 2, "sub/deep/y": 3, "sub/i2": 4, "c": 1, "b": 5}


def test_subgraph_without_end_exits_from_its_sinks():
    inner = graph("i1", "i2")
    inner.add_edge(START, "i1")
    inner.add_edge("i1", "i2")
    g = StateGraph(S)
    g.add_node("sub", inner.compile())
    g.add_node("b", noop)
    g.add_edge(START, "sub")
    g.add_edge("sub", "b")
    assert or_edges(build_asg(g).graph) == [("__start__", "sub/i1", False), ("sub/i1", "sub/i2", False),
                                            ("sub/i2", "b", False)]


def test_tool_nodes_take_a_step_but_send_no_llm_request():
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode

    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    g = StateGraph(S)
    g.add_node("agent", noop)
    g.add_node("tools", ToolNode([add]))
    g.add_node("human", noop, metadata={"kvflow": {"llm": False}})
    g.add_node("shell", noop, metadata={"kvflow_llm": False})
    g.add_node("named", noop)
    g.add_node("forced", noop, metadata={"kvflow": {"llm": True}})
    g.add_edge(START, "agent")
    asg = build_asg(g, tool_nodes=["named"]).graph
    assert [a for a in asg.agents if not asg.is_llm(a)] == ["tools", "human", "shell", "named"]


def test_instrument_rejects_what_it_cannot_read():
    from langgraph.func import entrypoint

    @entrypoint()
    def flow(x):
        return x

    with pytest.raises(TypeError, match="functional API"):
        instrument(flow)


def test_instrument_compiles_a_builder_with_its_kwargs_and_names_the_app():
    from langgraph.checkpoint.memory import InMemorySaver

    g = graph("a")
    g.add_edge(START, "a")
    saver = InMemorySaver()
    app = instrument(g, checkpointer=saver, name="my-app")
    assert app.checkpointer is saver and app.kvflow.app_id == "my-app"
    anon = instrument(g)
    assert anon.kvflow.app_id.startswith("langgraph-")
    assert instrument(g).kvflow.app_id == anon.kvflow.app_id  # stable per structure
    assert instrument(g, app_id="x").kvflow.app_id == "x"
