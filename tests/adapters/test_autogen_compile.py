"""AutoGen teams → Agent Step Graphs (structure only) and the runtime hook's edge cases."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.teams import DiGraphBuilder, RoundRobinGroupChat, SelectorGroupChat  # noqa: E402
from autogen_core import SingleThreadedAgentRuntime  # noqa: E402
from autogen_ext.models.openai import OpenAIChatCompletionClient  # noqa: E402

import kvflow_agents as kvflow  # noqa: E402
from kvflow_agents.adapters.autogen import instrumentation  # noqa: E402
from kvflow_agents.adapters.autogen_compile import compile_digraph, compile_team  # noqa: E402
from kvflow_agents.graph import END, START  # noqa: E402
from kvflow_agents.graph.learned import TransitionModel  # noqa: E402
from kvflow_agents.testing import RecordingOpenAIServer  # noqa: E402

MI = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
      "structured_output": False}


def client(url="http://127.0.0.1:9/v1"):
    return OpenAIChatCompletionClient(model="stub", base_url=url, api_key="x", model_info=MI, max_retries=0)


def agent(name, c):
    return AssistantAgent(name, model_client=c, system_message=f"You are {name}.")


def cond_edges(g):
    return {(s, d) for s, d, k, a in g.nx_graph.edges(keys=True, data=True) if a.get("conditional")}


def test_activation_groups_are_ored_and_each_group_keeps_its_condition():
    c = client()
    a, b, x, t, z = (agent(n, c) for n in ("a", "b", "x", "t", "z"))
    builder = DiGraphBuilder()
    for n in (a, b, x, t, z):
        builder.add_node(n)
    builder.add_edge(t, z, condition="DONE")
    builder.add_edge(a, b).add_edge(a, x)
    builder.add_edge(b, t, activation_group="both").add_edge(x, t, activation_group="both")  # AND
    builder.add_edge(t, a, condition="AGAIN", activation_group="loop", activation_condition="any")
    builder.set_entry_point(a)
    g = compile_digraph(builder.build())
    assert g.joins("t") == [["b", "x"]]
    assert g.or_predecessors("a") == [START, "t"] or set(g.or_predecessors("a")) == {START, "t"}
    assert cond_edges(g) == {("t", "a"), ("t", "z")}
    assert list(g.nx_graph.predecessors(END)) == ["z"]
    assert g.steps_to_execution({"a"})["t"] == 2


def test_selector_graph_selector_func_and_repeats():
    c = client()
    team = SelectorGroupChat([agent(n, c) for n in "ab"], model_client=c, allow_repeated_speaker=True,
                             selector_func=lambda thread: None)
    g, spec = compile_team(team)
    assert spec.router == "selector" and not g.is_llm("selector")
    assert set(g.successors("a")) == {"a", "b"}  # repeats allowed
    assert cond_edges(g) >= {(START, "a"), ("a", "a"), ("a", END)}
    g2, spec2 = compile_team(SelectorGroupChat([agent(n, c) for n in "ab"], model_client=c))
    assert g2.is_llm("selector") and set(g2.successors("a")) == {"b"}


def test_two_teams_sharing_one_runtime_keep_their_own_workflows():
    async def go(srv):
        c = client(srv.base_url)
        rt = SingleThreadedAgentRuntime()
        t1 = kvflow.instrument(RoundRobinGroupChat([agent("p", c)], max_turns=1, runtime=rt),
                               model=TransitionModel(), app_id="one")
        t2 = kvflow.instrument(RoundRobinGroupChat([agent("q", c)], max_turns=1, runtime=rt),
                               model=TransitionModel(), app_id="two")
        rt.start()
        try:
            await t1.run(task="x")
            await t2.run(task="y")
        finally:
            await rt.stop_when_idle()
            await c.close()
        return t1, t2

    with RecordingOpenAIServer() as srv:
        t1, t2 = asyncio.run(go(srv))
        got = {r.hints["kvflow_agent"]: r.hints for r in srv.llm_requests()}
        assert got["p"]["kvflow_workflow"] == t1._team_id and got["p"]["kvflow_app"] == "one"
        assert got["q"]["kvflow_workflow"] == t2._team_id and got["q"]["kvflow_app"] == "two"
        assert instrumentation(t1).tracker.ended and instrumentation(t2).tracker.ended
