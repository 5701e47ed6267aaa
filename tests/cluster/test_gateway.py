"""Two tiny-random ``kvflow serve`` workers behind SGLang's real gateway (``smg``), as users run
them (``kvflow_agents.cluster``, the code behind ``kvflow cluster up``): the gateway sees a
first-class worker, hints reach the workers on chat completions through it (server counters),
every workflow stays on one worker, and out-of-band events reach the worker holding the
workflow — with the raw ``openai`` client, a real LangGraph app and a real AutoGen team.

One cluster for the module (about 10 s to start on two cores)."""

from __future__ import annotations

import asyncio
import operator
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, TypedDict

import httpx
import openai
import pytest

pytest.importorskip("smg")

import kvflow_agents as kvflow  # noqa: E402
from kvflow_agents import oob  # noqa: E402
from kvflow_agents.cluster import Cluster, GatewayConfig  # noqa: E402
from kvflow_agents.context import set_hint_channel  # noqa: E402
from kvflow_agents.protocol import Hints  # noqa: E402

MODEL = "tiny-random"
_ACCEPTED = re.compile(r'^kvflow_hints_total\{result="accepted"\}\s+([0-9.]+)', re.M)
_REJECTED = re.compile(r'^kvflow_hints_total\{result="rejected"\}\s+([0-9.]+)', re.M)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, ["--model", MODEL, "--device-tokens", "4096", "--host-tokens", "16384",
                     "--log-level", "warning"], GatewayConfig(policy="manual")) as c:
        yield c


def counters(c: Cluster) -> list[tuple[int, int]]:
    """(accepted, rejected) hint counters of each worker."""
    out = []
    for u in c.worker_urls:
        text = httpx.get(u + "/metrics").text
        out.append((int(float(_ACCEPTED.search(text).group(1))), int(float(_REJECTED.search(text).group(1)))))
    return out


def delta(before, after) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]


def cached_workflows(c: Cluster) -> list[set[str]]:
    return [{w["workflow"] for w in httpx.get(u + "/kvflow/v1/cache").json()["workflows"]}
            for u in c.worker_urls]


def test_the_gateway_sees_first_class_workers(cluster):
    models = httpx.get(cluster.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]  # not "unknown": /model_info answered
    info = httpx.get(cluster.worker_urls[0] + "/server_info").json()
    assert info["served_model_name"] == MODEL and info["instance_id"] == "w0"
    # the gateway polls its workers' loads every few seconds: on a busy box its first poll may
    # not have answered yet (an empty list); wait for it (one worker may not be in yet)
    deadline, loads = time.monotonic() + 60, []
    while not loads and time.monotonic() < deadline:
        loads = httpx.get(cluster.url + "/get_loads").json()["loads"]
        if not loads:
            time.sleep(0.5)
    # real capacity, not -1
    assert loads and all(ld["max_total_num_tokens"] == 4096 and ld["max_running_requests"] == 16 for ld in loads)
    em = httpx.get(cluster.url + "/engine_metrics")  # aggregates every worker's /metrics
    assert em.status_code == 200 and "kvflow_hints_total" in em.text and "kvflow_evictions_total" in em.text
    assert httpx.get(cluster.worker_urls[1] + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("channel", ["both", "metadata"])
def test_chat_hints_reach_the_workers_and_workflows_stick(cluster, channel):
    set_hint_channel(channel)
    try:
        client = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0,
                               http_client=kvflow.http_client())
        before = counters(cluster)

        def workflow(w: int) -> list[tuple[str, str]]:
            seen = []
            for step, agent in enumerate(["planner", "coder", "planner"]):
                with kvflow.hints(workflow=f"{channel}-wf{w}", agent=agent, step=step,
                                  ste={"planner": 0 if agent == "planner" else 1, "coder": 1},
                                  next=["coder"]):
                    kw = dict(model=MODEL, max_tokens=2, temperature=0, messages=[
                        {"role": "system", "content": f"You are the {agent}. " * 20},
                        {"role": "user", "content": f"step {step}"}])
                    if step == 1:  # streamed too
                        with client.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
                            list(r.iter_lines())
                    else:
                        r = client.chat.completions.with_raw_response.create(**kw)
                    seen.append((r.headers["x-kvflow-instance"], r.headers["x-kvflow-hints"]))
            return seen

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(workflow, range(6)))
        for seen in results:
            assert {h for _, h in seen} == {"accepted"}
            assert len({i for i, _ in seen}) == 1  # the whole workflow on one worker
        d = delta(before, counters(cluster))
        assert sum(a for a, _ in d) == 18 and all(r == 0 for _, r in d)
    finally:
        set_hint_channel(None)


def test_out_of_band_end_reaches_the_worker_holding_the_workflow(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="x", max_retries=0,
                           http_client=kvflow.http_client())
    h = Hints(workflow="oob-wf", agent="writer", ste={"writer": 0, "tools": 1}, next=["tools"])
    with kvflow.hints(h):
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "system", "content": "You write. " * 30},
                                                 {"role": "user", "content": "go"}])
    holder = int(r.headers["x-kvflow-instance"][1:])
    assert "oob-wf" in cached_workflows(cluster)[holder]
    before = counters(cluster)
    # the gateway has no /kvflow/v1/hints (404): the reporter switches to a hint-only completion
    failed = oob._poster.failed
    assert oob.HintReporter(cluster.base_url).report(h.model_copy(update={"agent": "tools"}), "end")
    assert oob.flush(30)
    d = delta(before, counters(cluster))
    # on failure, say where the event went: lost by the poster, or re-routed by the gateway
    # (smg's manual policy moves a key only while its worker is marked unhealthy)
    assert d[holder] == (1, 0) and sum(a for a, _ in d) == 1, (
        f"holder w{holder}, per-worker delta {d}, poster failures +{oob._poster.failed - failed} "
        f"(last: {oob._poster.last_error}), "
        f"gateway log:\n{cluster.gateway.log_tail()}")
    assert not any("oob-wf" in wfs for wfs in cached_workflows(cluster))  # released where it lived


def _one_worker_took_all(d: list[tuple[int, int]], n: int) -> None:
    assert sorted(a for a, _ in d) == [0, n] and all(r == 0 for _, r in d), d


class S(TypedDict, total=False):  # LangGraph state (module level: annotations are resolved)
    log: Annotated[list, operator.add]


def test_langgraph_app_through_the_gateway(cluster):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    llm = ChatOpenAI(model=MODEL, base_url=cluster.base_url, api_key="x", max_retries=0,
                     max_tokens=2, temperature=0)

    def node(name):
        def f(state):
            llm.invoke([("system", f"You are the {name}. " * 20), ("human", "go")])
            return {"log": [name]}
        return f
    g = StateGraph(S)
    for a in ("planner", "executor", "reviewer"):
        g.add_node(a, node(a))
    g.add_edge(START, "planner")
    g.add_edge("planner", "executor")
    g.add_edge("executor", "reviewer")
    g.add_edge("reviewer", END)
    app = kvflow.instrument(g.compile(name="lg-cluster"))
    for thread in ("lg-t1", "lg-t2"):
        before = counters(cluster)
        out = app.invoke({}, {"configurable": {"thread_id": thread}})
        assert out["log"] == ["planner", "executor", "reviewer"]
        oob.flush(10)
        # three LLM calls and the run's end event, all on one worker, all accepted
        _one_worker_took_all(delta(before, counters(cluster)), 4)
        assert not any(thread in " ".join(wfs) for wfs in cached_workflows(cluster))


def test_autogen_team_through_the_gateway(cluster):
    pytest.importorskip("autogen_agentchat")
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    mi = {"vision": False, "function_calling": False, "json_output": False, "family": "unknown",
          "structured_output": False}

    async def go() -> int:
        client = OpenAIChatCompletionClient(model=MODEL, base_url=cluster.base_url, api_key="x",
                                            model_info=mi, max_retries=0, max_tokens=2, temperature=0)
        try:
            agents = [AssistantAgent(n, model_client=client, system_message=f"You are {n}. " * 20)
                      for n in ("alice", "bob", "carol")]
            team = kvflow.instrument(RoundRobinGroupChat(agents, max_turns=4))
            result = await team.run(task="go")
            return sum(1 for m in result.messages if getattr(m, "source", "") != "user")
        finally:
            await client.close()

    for _ in range(2):
        before = counters(cluster)
        turns = asyncio.run(go())
        assert turns == 4
        oob.flush(10)
        _one_worker_took_all(delta(before, counters(cluster)), 4 + 1)  # 4 LLM calls + the end
