"""Real AutoGen teams, one shared ``OpenAIChatCompletionClient`` created the ordinary way, a real
OpenAI-shaped HTTP server on 127.0.0.1: the hints *sent over the wire* are asserted."""

from __future__ import annotations

import asyncio
import re

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.conditions import MaxMessageTermination  # noqa: E402
from autogen_agentchat.teams import (  # noqa: E402
    DiGraphBuilder,
    GraphFlow,
    RoundRobinGroupChat,
    SelectorGroupChat,
    Swarm,
)
from autogen_ext.models.openai import OpenAIChatCompletionClient  # noqa: E402

import kvflow_agents as kvflow  # noqa: E402
from kvflow_agents import oob  # noqa: E402
from kvflow_agents.adapters.autogen import instrumentation  # noqa: E402
from kvflow_agents.graph import END, START  # noqa: E402
from kvflow_agents.graph.learned import TraceRecorder, TransitionModel  # noqa: E402
from kvflow_agents.testing import RecordingOpenAIServer  # noqa: E402

N = None  # null on the wire: infinity
MI = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
      "structured_output": False}
TOOL = "\x00tool:"  # reply prefix the Swarm server turns into a tool call


def who(body) -> str:
    first = body["messages"][0]
    content = first["content"] if isinstance(first["content"], str) else first["content"][0]["text"]
    m = re.match(r"You are (\w+)\.", content)
    if m:
        return m.group(1)
    return "selector" if "select the next role" in content else "?"


def client_for(srv, **kw) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model="stub", base_url=srv.base_url, api_key="x", model_info=MI,
                                      max_retries=0, **kw)


def agent(name, client, **kw) -> AssistantAgent:
    return AssistantAgent(name, model_client=client, system_message=f"You are {name}.", **kw)


def run(team, task, client, between=None):
    """``team.run(task)`` (once per task when ``task`` is a list, calling ``between()`` in
    between), then close the shared client inside the same event loop."""
    async def go():
        try:
            tasks = task if isinstance(task, list) else [task]
            for i, t in enumerate(tasks):
                if i and between is not None:
                    between()
                result = await team.run(task=t)
            return result
        finally:
            await client.close()

    return asyncio.run(go())


def sent(srv) -> list[tuple[str, int, dict, list]]:
    """(agent, step, ste, next) of every LLM request, in arrival order."""
    out = []
    for r in srv.llm_requests():
        h = r.hints
        assert h is not None, f"request without hints: {r.body}"
        out.append((h["kvflow_agent"], h["kvflow_step"], h["kvflow_ste"], sorted(h["kvflow_next"])))
    return out


def end_posts(srv):
    oob.flush(5)
    return [r.body for r in srv.hint_posts() if r.body.get("kvflow_event") == "end"]


# ------------------------------------------------------------------------------------ GraphFlow
def graphflow_builder(client):
    ag = {n: agent(n, client) for n in ["planner", "x1", "x2", "joiner", "fast", "reviewer", "writer"]}
    b = DiGraphBuilder()
    for a in ag.values():
        b.add_node(a)
    b.add_edge(ag["planner"], ag["x1"]).add_edge(ag["planner"], ag["x2"])
    b.add_edge(ag["x1"], ag["joiner"]).add_edge(ag["x2"], ag["joiner"])           # all-join
    b.add_edge(ag["x1"], ag["fast"], activation_condition="any")                   # any-join
    b.add_edge(ag["x2"], ag["fast"], activation_condition="any")
    b.add_edge(ag["joiner"], ag["reviewer"])
    b.add_edge(ag["reviewer"], ag["planner"], condition="REVISE")                  # the loop
    b.add_edge(ag["reviewer"], ag["writer"], condition="APPROVE")
    b.set_entry_point(ag["planner"])
    return b


def test_graphflow_all_join_any_join_and_loop_send_exact_and_learned_ste():
    reviews = iter(["REVISE", "APPROVE"])

    def reply(body):
        name = who(body)
        return next(reviews) if name == "reviewer" else f"{name} done"

    with RecordingOpenAIServer(reply=reply) as srv:
        model = TransitionModel()
        c = client_for(srv)
        flow = kvflow.instrument(graphflow_builder(c), max_turns=30, model=model, app_id="gf")
        assert isinstance(flow, GraphFlow)
        inst = instrumentation(flow)
        g = inst.graph
        assert g.joins("joiner") == [["x1", "x2"]]                       # "all" -> AND
        assert sorted(g.or_predecessors("fast")) == ["x1", "x2"]         # "any" -> OR
        assert g.joins("fast") == []
        cond = {(s, d) for s, d, k, a in g.nx_graph.edges(keys=True, data=True) if a.get("conditional")}
        assert cond == {("reviewer", "planner"), ("reviewer", "writer")}
        assert g.entry_agents == ["planner"]
        assert sorted(g.nx_graph.predecessors(END)) == ["fast", "writer"]

        result = run(flow, "go", c)
        assert [m.source for m in result.messages][-1] == "writer"
        got = sent(srv)
        assert len(got) == 13
        # every request: the team's id as workflow, the app, the ids mirrored in headers
        for r in srv.llm_requests():
            h = r.hints
            assert h["kvflow_workflow"] == flow._team_id and h["kvflow_app"] == "gf"
            assert h["kvflow_fixed_messages"] == 1  # the agent's system message
            assert r.headers["x-kvflow-workflow"] == flow._team_id
            assert r.headers["x-kvflow-agent"] == h["kvflow_agent"]
        # the reviewer's choice is 50/50 before anything is learned: writer at 1/0.5 = 2 steps
        # past the reviewer; the loop back to the planner likewise.
        first = {"planner": 0, "x1": 1, "x2": 1, "joiner": 2, "fast": 2, "reviewer": 3, "writer": 5}
        par = {"planner": 4, "x1": 0, "x2": 0, "joiner": 1, "fast": 1, "reviewer": 2, "writer": 4}
        join = {"planner": 3, "x1": 4, "x2": 4, "joiner": 0, "fast": 0, "reviewer": 1, "writer": 3}
        review = {"planner": 2, "x1": 3, "x2": 3, "joiner": 4, "fast": 4, "reviewer": 0, "writer": 2}
        assert got[0] == ("planner", 1, first, ["x1", "x2"])
        assert sorted(got[1:3]) == [("x1", 2, par, ["fast", "joiner"]), ("x2", 2, par, ["fast", "joiner"])]
        assert sorted(got[3:5]) == [("fast", 3, join, ["reviewer"]), ("joiner", 3, join, ["reviewer"])]
        assert got[5] == ("reviewer", 4, review, ["planner", "writer"])
        # second round: REVISE was learned (P(planner|reviewer) = 2/3, P(writer) = 1/3)
        assert got[6] == ("planner", 5, {**first, "writer": 6}, ["x1", "x2"])
        assert got[11] == ("reviewer", 8, {**review, "writer": 3}, ["planner"])
        dead = {a: N for a in first}
        assert got[12] == ("writer", 9, {**dead, "writer": 0}, [])
        assert model.counts("gf") == {("reviewer", "planner"): 1, ("reviewer", "writer"): 1}
        # exact (best-case) STE stays the graph's: writer one step after the reviewer
        assert g.steps_to_execution({"reviewer"})["writer"] == 1
        ends = end_posts(srv)
        assert len(ends) == 1 and ends[0]["kvflow_workflow"] == flow._team_id
        assert set(ends[0]["kvflow_ste"].values()) == {None}


def test_node_level_activation_is_not_read_edges_decide():
    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        a, b1, b2, d = (agent(n, c) for n in ("a", "b1", "b2", "d"))
        builder = DiGraphBuilder()
        builder.add_node(a).add_node(b1).add_node(b2).add_node(d, activation="any")
        builder.add_edge(a, b1).add_edge(a, b2).add_edge(b1, d).add_edge(b2, d)
        flow = kvflow.instrument(builder, model=TransitionModel())
        assert instrumentation(flow).graph.joins("d") == [["b1", "b2"]]  # still AND, as AutoGen runs it
        run(flow, "go", c)
        assert [x[0] for x in sent(srv)].count("d") == 1


# ------------------------------------------------------------------------------------ RoundRobin
def test_round_robin_is_a_ring_and_a_shared_explicit_http_client_is_hinted_once():
    with RecordingOpenAIServer() as srv:
        c = client_for(srv, http_client=kvflow.async_http_client())  # transport + autopatch: no double
        team = kvflow.instrument(RoundRobinGroupChat([agent(n, c) for n in "abc"], max_turns=4),
                                 model=TransitionModel())
        run(team, "go", c)
        got = sent(srv)
        assert [(a, s) for a, s, _, _ in got] == [("a", 1), ("b", 2), ("c", 3), ("a", 4)]
        assert got[0][2:] == ({"a": 0, "b": 1, "c": 2}, ["b"])
        assert got[1][2:] == ({"a": 2, "b": 0, "c": 1}, ["c"])
        assert got[2][2:] == ({"a": 1, "b": 2, "c": 0}, ["a"])
        for r in srv.llm_requests():
            assert set(r.body["custom_params"]) == {
                "kvflow_v", "kvflow_workflow", "kvflow_app", "kvflow_agent", "kvflow_step",
                "kvflow_ste", "kvflow_next", "kvflow_fixed_messages"}
            assert r.headers["x-kvflow-agent"] == r.hints["kvflow_agent"]
        assert len(end_posts(srv)) == 1


# ------------------------------------------------------------------------------------ Selector
def test_selector_with_deterministic_selector_func_learns_the_choices():
    script = iter(["a", "b", "c", "a"])  # a -> b -> c -> a

    def selector_func(thread):
        return next(script)

    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        model = TransitionModel()
        rec = TraceRecorder()
        team = SelectorGroupChat([agent(n, c) for n in "abc"], model_client=c, selector_func=selector_func,
                                 termination_condition=MaxMessageTermination(5))
        team = kvflow.instrument(team, model=model, app_id="sel", recorder=rec)
        inst = instrumentation(team)
        assert not inst.graph.is_llm("selector")  # a selector_func: no selector request
        assert set(inst.graph.successors("a")) == {"b", "c"}  # no repeated speaker by default
        first_run: list = []
        counts: dict = {}

        def between():
            nonlocal script
            first_run.extend(sent(srv))
            counts.update(model.counts("sel"))
            srv.clear()
            script = iter(["b", "c", "a", "b"])

        run(team, ["go", "again"], c, between)
        got = first_run
        assert [x[0] for x in got] == ["a", "b", "c", "a"]
        # before learning: from a, b and c are each 1/3 likely (b, c, END) -> 3 steps;
        # the selector runs right after every turn.
        assert got[0] == ("a", 1, {"a": 0, "b": 3, "c": 3, "selector": 1}, ["selector"])
        # a -> b learned once: P(b|a) = 2/4 -> 2, P(c|a) = 1/4 -> 4
        assert got[3] == ("a", 4, {"a": 0, "b": 2, "c": 4, "selector": 1}, ["selector"])
        assert counts == {(START, "a"): 1, ("a", "b"): 1, ("b", "c"): 1, ("c", "a"): 1,
                                       ("a", END): 1}
        assert rec.runs[0].steps == [["a"], ["b"], ["c"], ["a"]]

        assert len(rec.runs) == 2 and rec.runs[1].steps == [["b"], ["c"], ["a"], ["b"]]
        # the second run of the same app: b -> c was seen, b -> a never: c is closer
        got = sent(srv)
        assert got[0][0] == "b" and got[0][2]["c"] < got[0][2]["a"]


def test_selector_llm_call_is_agent_selector_with_ste_zero_and_no_fixed_prefix():
    picks = iter(["b", "a", "b"])

    def reply(body):
        name = who(body)
        return next(picks) if name == "selector" else f"{name} done"

    with RecordingOpenAIServer(reply=reply) as srv:
        c = client_for(srv)
        team = kvflow.instrument(SelectorGroupChat([agent(n, c) for n in "abc"], model_client=c,
                                                   termination_condition=MaxMessageTermination(4)),
                                 model=TransitionModel())
        run(team, "go", c)
        reqs = srv.llm_requests()
        assert [r.hints["kvflow_agent"] for r in reqs] == ["selector", "b", "selector", "a", "selector", "b"]
        first = reqs[0].hints
        assert first["kvflow_ste"] == {"a": 3, "b": 3, "c": 3, "selector": 0}  # START: 1/3 each
        assert first["kvflow_fixed_messages"] == 0  # the selector prompt embeds the conversation
        assert reqs[1].hints["kvflow_ste"]["selector"] == 1
        # between turns (b just spoke, no repeats): a, c or the end, 1/3 each; b two choices away
        assert reqs[2].hints["kvflow_ste"] == {"a": 3, "b": 6, "c": 3, "selector": 0}
        assert sorted(reqs[2].hints["kvflow_next"]) == ["a", "c"]
        assert all(r.hints["kvflow_workflow"] == team._team_id for r in reqs)


# ------------------------------------------------------------------------------------ Swarm
class ToolCallingServer(RecordingOpenAIServer):
    """The recording server, answering ``\\x00tool:NAME`` replies with a tool call."""

    def __init__(self, reply):
        super().__init__(reply=reply)
        base = self._httpd.RequestHandlerClass

        class Handler(base):  # type: ignore[misc, valid-type]
            def _send(self, code, doc):
                try:
                    msg = doc["choices"][0]["message"]
                    if msg["content"].startswith(TOOL):
                        name = msg["content"][len(TOOL):]
                        doc["choices"][0]["finish_reason"] = "tool_calls"
                        doc["choices"][0]["message"] = {
                            "role": "assistant", "content": None,
                            "tool_calls": [{"id": "call_1", "type": "function",
                                            "function": {"name": name, "arguments": "{}"}}]}
                except (KeyError, IndexError, TypeError, AttributeError):
                    pass
                super()._send(code, doc)

        self._httpd.RequestHandlerClass = Handler


def test_swarm_follows_handoffs():
    plan = {"triage": iter(["transfer_to_billing"]), "billing": iter(["transfer_to_refunds"]),
            "refunds": iter(["done", "done"])}

    def reply(body):
        name = who(body)
        step = next(plan[name], "done")
        return TOOL + step if step.startswith("transfer_to_") else f"{name} {step}"

    with ToolCallingServer(reply) as srv:
        c = client_for(srv)
        triage = agent("triage", c, handoffs=["billing", "refunds"])
        billing = agent("billing", c, handoffs=["refunds"])
        refunds = agent("refunds", c, handoffs=["triage"])
        model = TransitionModel()
        team = kvflow.instrument(Swarm([triage, billing, refunds], termination_condition=MaxMessageTermination(6)),
                                 model=model, app_id="swarm")
        g = instrumentation(team).graph
        assert set(g.successors("triage")) == {"triage", "billing", "refunds"}
        assert set(g.successors("billing")) == {"billing", "refunds"}
        assert g.entry_agents == ["triage"]
        run(team, "my bill", c)
        got = sent(srv)
        assert [x[0] for x in got] == ["triage", "billing", "refunds"] + ["refunds"] * (len(got) - 3)
        # triage -> {triage, billing, refunds, END} uniform: 4; billing -> refunds | billing | END: 3
        assert got[0] == ("triage", 1, {"triage": 0, "billing": 4, "refunds": 4}, ["billing", "refunds"])
        # triage is reachable only through refunds -> {refunds, triage, END}: 3 + 3
        assert got[1][2] == {"triage": 6, "billing": 0, "refunds": 3}
        assert got[2][2]["refunds"] == 0 and got[2][3] == ["triage"]
        assert model.count("swarm", "triage", "billing") == 1
        assert model.count("swarm", "billing", "refunds") == 1


# ------------------------------------------------------------------------------------ nested
def test_nested_team_agents_are_named_team_slash_agent_in_the_outer_workflow():
    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        inner = RoundRobinGroupChat([agent(n, c) for n in ("i1", "i2")], name="inner", max_turns=2)
        outer = RoundRobinGroupChat([agent("lead", c), inner, agent("close", c)], max_turns=3)
        team = kvflow.instrument(outer, model=TransitionModel())
        g = instrumentation(team).graph
        assert set(g.agents) == {"lead", "inner/i1", "inner/i2", "close"}
        assert g.successors("lead") == ["inner/i1"]
        assert set(g.successors("inner/i2")) >= {"inner/i1", "close"}
        run(team, "go", c)
        got = sent(srv)
        assert [x[0] for x in got] == ["lead", "inner/i1", "inner/i2", "close"]
        assert all(r.hints["kvflow_workflow"] == outer._team_id for r in srv.llm_requests())
        assert got[0][2]["inner/i1"] == 1 and got[0][3] == ["inner/i1"]
        assert got[1][2]["inner/i1"] == 0 and got[1][2]["inner/i2"] == 1
        assert got[3][2]["close"] == 0


# ------------------------------------------------------------------------------------ API
def test_instrument_is_idempotent_and_rejects_non_teams():
    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        team = RoundRobinGroupChat([agent("a", c)], max_turns=1)
        assert kvflow.instrument(team) is team
        inst = instrumentation(team)
        assert kvflow.instrument(team) is team and instrumentation(team) is inst
        with pytest.raises(TypeError):
            kvflow.instrument(team, max_turns=3)  # team kwargs only go with a DiGraphBuilder
        with pytest.raises(TypeError):
            kvflow.instrument(agent("solo", c))


def test_no_hints_outside_a_team_run():
    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        solo = agent("solo", c)
        kvflow.instrument(RoundRobinGroupChat([agent("x", c)], max_turns=1))
        run(solo, "hi", c)
        assert srv.llm_requests()[0].hints is None
        assert "custom_params" not in srv.llm_requests()[0].body


def test_agent_without_model_client_is_a_tool_step_reported_out_of_band():
    from autogen_agentchat.agents import UserProxyAgent

    with RecordingOpenAIServer() as srv:
        c = client_for(srv)
        user = UserProxyAgent("user", input_func=lambda prompt: "looks good")
        team = kvflow.instrument(RoundRobinGroupChat([agent("a", c), user], max_turns=3), model=TransitionModel())
        assert not instrumentation(team).graph.is_llm("user")
        run(team, "go", c)
        assert [x[0] for x in sent(srv)] == ["a", "a"]
        oob.flush(5)
        posts = [r.body for r in srv.hint_posts()]
        assert [(p["kvflow_event"], p["kvflow_agent"]) for p in posts] == [("transition", "user"), ("end", "a")]
        assert posts[0]["kvflow_ste"] == {"a": 1, "user": 0} and posts[0]["kvflow_step"] == 2
