"""LangGraph adapter end to end: real graphs, real ``ChatOpenAI``, a real OpenAI-shaped HTTP
server on 127.0.0.1. Every test asserts the exact STE map (``None`` = never again) and next
agents *as sent on the wire* with each LLM call, in sync and async runs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import operator
import uuid
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt

import kvflow_agents as kvflow
from kvflow_agents import autopatch, oob
from kvflow_agents.testing import RecordingOpenAIServer

N = None  # STE infinity on the wire


class S(TypedDict, total=False):
    log: Annotated[list, operator.add]
    rounds: int
    done: int


@pytest.fixture(scope="module")
def server():
    def reply(body: dict) -> str:
        system = body["messages"][0]["content"] if body.get("messages") else ""
        return "coder" if "router" in str(system) else "ok"

    with RecordingOpenAIServer(reply=reply) as srv:
        yield srv


@pytest.fixture
def srv(server):
    server.clear()
    was = autopatch.is_enabled()
    yield server
    oob.flush(5)
    if not was:
        autopatch.disable()


# One event loop for every async run of this module: langchain-openai caches its default
# async HTTP client per base URL, and a pooled connection must stay on the loop that opened it.
_LOOP = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _close_loop():
    yield
    _LOOP.run_until_complete(_LOOP.shutdown_asyncgens())


def arun(coro):
    return _LOOP.run_until_complete(coro)


@pytest.fixture(params=["sync", "async"])
def mode(request):
    return request.param


def llm_for(srv) -> ChatOpenAI:
    return ChatOpenAI(model="stub", base_url=srv.base_url, api_key="x", max_retries=0)


def agent(llm: ChatOpenAI, name: str, update: Any = None) -> RunnableLambda:
    """A node that calls the LLM once (sync or async, whichever LangGraph runs)."""
    msgs = [("system", f"You are the {name}."), ("human", "go")]

    def out(state: dict) -> Any:
        return update(state) if callable(update) else {"log": [name]}

    def f(state: dict) -> Any:
        llm.invoke(msgs)
        return out(state)

    async def af(state: dict) -> Any:
        await llm.ainvoke(msgs)
        return out(state)

    return RunnableLambda(f, afunc=af, name=name)


def run(app, inp, config=None, mode="sync"):
    if mode == "sync":
        return app.invoke(inp, config)
    return arun(app.ainvoke(inp, config))


def calls(srv, workflow: str | None = None, *, sort_parallel: bool = True) -> list[tuple]:
    """(agent, step, ste, next) of each LLM request; parallel calls of one step by agent."""
    out = []
    for r in srv.llm_requests():
        h = r.hints
        assert h is not None, "an LLM request inside an instrumented run carried no hints"
        if workflow is not None and h["kvflow_workflow"] != workflow:
            continue
        assert h["kvflow_v"] == 1 and h["kvflow_fixed_messages"] == 1
        out.append((h["kvflow_agent"], h["kvflow_step"], h["kvflow_ste"], h["kvflow_next"]))
    if sort_parallel:
        out.sort(key=lambda c: (c[1], c[0]))
    return out


def posts(srv, workflow: str | None = None) -> list[tuple]:
    oob.flush(5)
    return [(p.body["kvflow_event"], p.body["kvflow_agent"], p.body["kvflow_step"], p.body["kvflow_ste"],
             p.body["kvflow_next"])
            for p in srv.hint_posts() if workflow is None or p.body["kvflow_workflow"] == workflow]


# ---------------------------------------------------------------- the paper's 4-agent loop
def peer(llm, name="peer"):
    g = StateGraph(S)
    for a in ("planner", "executor", "expresser"):
        g.add_node(a, agent(llm, a))
    g.add_node("reviewer", agent(llm, "reviewer", lambda s: {"log": ["reviewer"], "done": s.get("done", 0) + 1}))
    g.add_edge(START, "planner")
    g.add_edge("planner", "executor")
    g.add_edge("executor", "expresser")
    g.add_edge("expresser", "reviewer")
    g.add_conditional_edges("reviewer", lambda s: "planner" if s["done"] < s["rounds"] else END,
                            {"planner": "planner", END: END})
    return g.compile(name=name)


def peer_expected(rounds: int, step0: int = 0) -> list[tuple]:
    one = [
        ("planner", {"planner": 0, "executor": 1, "expresser": 2, "reviewer": 3}, ["executor"]),
        ("executor", {"planner": 3, "executor": 0, "expresser": 1, "reviewer": 2}, ["expresser"]),
        ("expresser", {"planner": 2, "executor": 3, "expresser": 0, "reviewer": 1}, ["reviewer"]),
        ("reviewer", {"planner": 1, "executor": 2, "expresser": 3, "reviewer": 0}, ["planner"]),
    ]
    seq = one * rounds
    return [(a, step0 + i + 1, ste, nxt) for i, (a, ste, nxt) in enumerate(seq)]


END_STE = {"planner": N, "executor": N, "expresser": N, "reviewer": N}


def test_paper_four_agent_loop(srv, mode):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    assert app.kvflow.app_id == "peer"
    out = run(app, {"rounds": 2}, {"configurable": {"thread_id": "t-peer"}}, mode)
    assert out["log"] == ["planner", "executor", "expresser", "reviewer"] * 2
    assert calls(srv) == peer_expected(2)
    for r in srv.llm_requests():
        assert r.hints["kvflow_workflow"] == "t-peer" and r.hints["kvflow_app"] == "peer"
        assert r.headers["x-kvflow-workflow"] == "t-peer"
        assert r.headers["x-kvflow-agent"] == r.hints["kvflow_agent"]
    # the end of the run releases the workflow, out of band
    assert posts(srv) == [("end", "__end__", 8, END_STE, [])]


# ---------------------------------------------------------------- fan-out and AND join
def test_fan_out_and_join(srv, mode):
    llm = llm_for(srv)
    g = StateGraph(S)
    for a in ("planner", "r1", "r2", "r2b", "writer"):
        g.add_node(a, agent(llm, a))
    g.add_edge(START, "planner")
    g.add_edge("planner", "r1")
    g.add_edge("planner", "r2")
    g.add_edge("r2", "r2b")
    g.add_edge(["r1", "r2b"], "writer")  # AND: waits for the short and the long branch
    g.add_edge("writer", END)
    app = kvflow.instrument(g, learn=False)
    assert app.kvflow_graph.joins("writer") == [["r1", "r2b"]]
    out = run(app, {}, {"configurable": {"thread_id": "t-join"}}, mode)
    assert out["log"].count("writer") == 1
    assert calls(srv) == [
        ("planner", 1, {"planner": 0, "r1": 1, "r2": 1, "r2b": 2, "writer": 3}, ["r1", "r2"]),
        # parallel siblings both run (STE 0), whatever order the executor starts them in
        ("r1", 2, {"planner": N, "r1": 0, "r2": 0, "r2b": 1, "writer": 2}, ["r2b"]),
        ("r2", 2, {"planner": N, "r1": 0, "r2": 0, "r2b": 1, "writer": 2}, ["r2b"]),
        # r1 already arrived at the barrier: writer waits only for r2b
        ("r2b", 3, {"planner": N, "r1": N, "r2": N, "r2b": 0, "writer": 1}, ["writer"]),
        ("writer", 4, {"planner": N, "r1": N, "r2": N, "r2b": N, "writer": 0}, []),
    ]


# ---------------------------------------------------------------- conditional branch
def test_conditional_branch_with_path_map(srv, mode):
    llm = llm_for(srv)

    def route(state):  # the router's LLM answer ("coder") picks the branch
        return state["log"][-1]

    def router_update(state):
        return {"log": [llm.invoke([("system", "router"), ("human", "?")]).content]}

    async def arouter_update(state):
        return {"log": [(await llm.ainvoke([("system", "router"), ("human", "?")])).content]}

    g = StateGraph(S)
    g.add_node("router", RunnableLambda(router_update, afunc=arouter_update, name="router"))
    g.add_node("coder", agent(llm, "coder"))
    g.add_node("writer", agent(llm, "writer"))
    g.add_node("reviewer", agent(llm, "reviewer"))
    g.add_edge(START, "router")
    g.add_conditional_edges("router", route, {"coder": "coder", "writer": "writer"})
    g.add_edge("coder", "reviewer")
    g.add_edge("reviewer", END)
    g.add_edge("writer", END)
    app = kvflow.instrument(g, learn=False)
    out = run(app, {}, {"configurable": {"thread_id": "t-branch"}}, mode)
    assert out["log"] == ["coder", "coder", "reviewer"]
    assert calls(srv) == [
        ("router", 1, {"router": 0, "coder": 1, "writer": 1, "reviewer": 2}, ["coder", "writer"]),
        ("coder", 2, {"router": N, "coder": 0, "writer": N, "reviewer": 1}, ["reviewer"]),
        ("reviewer", 3, {"router": N, "coder": N, "writer": N, "reviewer": 0}, []),
    ]


# ---------------------------------------------------------------- Send fan-out
def test_send_fan_out_runs_parallel_instances_in_one_step(srv, mode):
    llm = llm_for(srv)
    g = StateGraph(S)
    g.add_node("planner", agent(llm, "planner"))
    g.add_node("worker", agent(llm, "worker"))
    g.add_node("summarizer", agent(llm, "summarizer"))
    g.add_edge(START, "planner")
    g.add_conditional_edges("planner", lambda s: [Send("worker", {"log": []}) for _ in range(3)], ["worker"])
    g.add_edge("worker", "summarizer")
    app = kvflow.instrument(g, learn=False)
    out = run(app, {}, {"configurable": {"thread_id": "t-send"}}, mode)
    assert out["log"].count("worker") == 3
    w = ("worker", 2, {"planner": N, "worker": 0, "summarizer": 1}, ["summarizer"])
    assert calls(srv) == [
        ("planner", 1, {"planner": 0, "worker": 1, "summarizer": 2}, ["worker"]),
        w, w, w,
        ("summarizer", 3, {"planner": N, "worker": N, "summarizer": 0}, []),
    ]
    hist = app.kvflow.tracker("t-send").history
    assert [a for s, e, a in hist if e == "start" and s == 2] == ["worker"] * 3


# ---------------------------------------------------------------- subgraph
def test_subgraph_is_inlined_with_parent_child_names(srv, mode):
    llm = llm_for(srv)
    inner = StateGraph(S)
    inner.add_node("research", agent(llm, "research"))
    inner.add_node("summarize", agent(llm, "summarize"))
    inner.add_edge(START, "research")
    inner.add_edge("research", "summarize")
    g = StateGraph(S)
    g.add_node("planner", agent(llm, "planner"))
    g.add_node("team", inner.compile())
    g.add_node("writer", agent(llm, "writer"))
    g.add_edge(START, "planner")
    g.add_edge("planner", "team")
    g.add_edge("team", "writer")
    app = kvflow.instrument(g, learn=False)
    assert app.kvflow_graph.agents == ["planner", "team/research", "team/summarize", "writer"]
    out = run(app, {}, {"configurable": {"thread_id": "t-sub"}}, mode)
    assert out["log"][-1] == "writer"  # (the subgraph hands back the whole shared log)
    assert calls(srv) == [
        ("planner", 1, {"planner": 0, "team/research": 1, "team/summarize": 2, "writer": 3}, ["team/research"]),
        ("team/research", 2, {"planner": N, "team/research": 0, "team/summarize": 1, "writer": 2},
         ["team/summarize"]),
        ("team/summarize", 3, {"planner": N, "team/research": N, "team/summarize": 0, "writer": 1}, ["writer"]),
        ("writer", 4, {"planner": N, "team/research": N, "team/summarize": N, "writer": 0}, []),
    ]


# ---------------------------------------------------------------- Command(goto) + destinations
def test_command_goto_with_destinations(srv, mode):
    llm = llm_for(srv)

    def go(state):
        return Command(goto="billing", update={"log": ["triage"]})

    g = StateGraph(S)
    g.add_node("triage", agent(llm, "triage", go), destinations=("billing", "support"))
    g.add_node("billing", agent(llm, "billing"))
    g.add_node("support", agent(llm, "support"))
    g.add_node("closer", agent(llm, "closer"))
    g.add_edge(START, "triage")
    g.add_edge("billing", "closer")
    g.add_edge("support", "closer")
    app = kvflow.instrument(g, learn=False)
    out = run(app, {}, {"configurable": {"thread_id": "t-cmd"}}, mode)
    assert out["log"] == ["triage", "billing", "closer"]
    assert calls(srv) == [
        ("triage", 1, {"triage": 0, "billing": 1, "support": 1, "closer": 2}, ["billing", "support"]),
        ("billing", 2, {"triage": N, "billing": 0, "support": N, "closer": 1}, ["closer"]),
        ("closer", 3, {"triage": N, "billing": N, "support": N, "closer": 0}, []),
    ]


# ---------------------------------------------------------------- interrupt / resume
def test_interrupt_and_resume_on_one_thread(srv, mode):
    llm = llm_for(srv)

    def human(state):
        return {"log": ["human:" + interrupt("approve?")]}

    g = StateGraph(S)
    g.add_node("planner", agent(llm, "planner"))
    g.add_node("human", human, metadata={"kvflow": {"llm": False}})  # a tool node: no LLM call
    g.add_node("writer", agent(llm, "writer"))
    g.add_edge(START, "planner")
    g.add_edge("planner", "human")
    g.add_edge("human", "writer")
    app = kvflow.instrument(g, checkpointer=InMemorySaver())  # compile kwargs pass through
    assert not app.kvflow_graph.is_llm("human")
    cfg = {"configurable": {"thread_id": "t-hitl"}}
    out = run(app, {}, cfg, mode)
    assert "__interrupt__" in out
    assert app.get_state(cfg).next == ("human",)
    assert calls(srv) == [("planner", 1, {"planner": 0, "human": 1, "writer": 2}, ["human"])]
    # the tool step is reported out of band; a pause is not the end
    assert posts(srv) == [("transition", "human", 2, {"planner": N, "human": 0, "writer": 1}, ["writer"])]
    srv.clear()

    out = run(app, Command(resume="yes"), cfg, mode)
    assert out["log"] == ["planner", "human:yes", "writer"]
    assert calls(srv) == [("writer", 4, {"planner": N, "human": N, "writer": 0}, [])]
    assert posts(srv) == [
        ("transition", "human", 3, {"planner": N, "human": 0, "writer": 1}, ["writer"]),  # re-run
        ("end", "__end__", 4, {"planner": N, "human": N, "writer": N}, []),
    ]


# ---------------------------------------------------------------- concurrency
def test_eight_concurrent_async_threads_do_not_mix(srv):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    rounds = {f"t{i}": 1 + i % 3 for i in range(8)}

    async def main():
        await asyncio.gather(*(app.ainvoke({"rounds": r}, {"configurable": {"thread_id": t}})
                               for t, r in rounds.items()))

    arun(main())
    for t, r in rounds.items():
        assert calls(srv, t, sort_parallel=False) == peer_expected(r)
    ends = sorted((p[0], p[2]) for p in posts(srv))
    assert ends == sorted(("end", 4 * r) for r in rounds.values())


def test_eight_concurrent_sync_threads_do_not_mix(srv):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    rounds = {f"s{i}": 1 + i % 2 for i in range(8)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: app.invoke({"rounds": rounds[t]}, {"configurable": {"thread_id": t}}), rounds))
    for t, r in rounds.items():
        assert calls(srv, t, sort_parallel=False) == peer_expected(r)


# ---------------------------------------------------------------- odds and ends
def test_runs_without_thread_id_use_the_root_run_id(srv, mode):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    run(app, {"rounds": 1}, None, mode)
    run(app, {"rounds": 1}, None, mode)
    ids = [r.hints["kvflow_workflow"] for r in srv.llm_requests()]
    assert ids[0] == ids[3] != ids[4] == ids[7]
    assert all(i.startswith("run-") for i in ids)
    assert uuid.UUID(ids[0][4:])
    assert app.kvflow.workflows == []  # released: nothing can resume a thread-less run
    assert [c for c in calls(srv, ids[4], sort_parallel=False)] == peer_expected(1)


def test_requests_outside_an_instrumented_run_are_untouched(srv, mode):
    llm = llm_for(srv)
    kvflow.instrument(peer(llm))
    plain = peer(llm)  # the same graph, not instrumented
    run(plain, {"rounds": 1}, {"configurable": {"thread_id": "p"}}, mode)
    llm.invoke("outside any graph")
    assert len(srv.llm_requests()) == 5
    for r in srv.llm_requests():
        assert "custom_params" not in r.body and "x-kvflow-agent" not in r.headers
    assert srv.hint_posts() == []


def test_llm_inside_a_chain_inside_a_node_and_streaming(srv, mode):
    llm = llm_for(srv)
    chain = ChatPromptTemplate.from_messages([("system", "You are the writer."), ("human", "{q}")]) | llm

    def f(state):
        "".join(c.content for c in chain.stream({"q": "x"}))
        return {"log": ["writer"]}

    async def af(state):
        async for _ in chain.astream({"q": "x"}):
            pass
        return {"log": ["writer"]}

    g = StateGraph(S)
    g.add_node("planner", agent(llm, "planner"))
    g.add_node("writer", RunnableLambda(f, afunc=af))
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    app = kvflow.instrument(g, learn=False)
    run(app, {}, {"configurable": {"thread_id": "t-chain"}}, mode)
    assert calls(srv) == [
        ("planner", 1, {"planner": 0, "writer": 1}, ["writer"]),
        ("writer", 2, {"planner": N, "writer": 0}, []),
    ]
    assert srv.llm_requests()[1].body["stream"] is True


def test_instrumented_graph_is_a_real_compiled_graph(srv):
    from langgraph.graph.state import CompiledStateGraph

    app = kvflow.instrument(peer(llm_for(srv)).builder, checkpointer=InMemorySaver())
    assert isinstance(app, CompiledStateGraph)
    assert kvflow.instrument(app) is app  # idempotent
    cfg = {"configurable": {"thread_id": "t-real"}}
    chunks = list(app.stream({"rounds": 1}, cfg, stream_mode="updates"))
    assert [next(iter(c)) for c in chunks] == ["planner", "executor", "expresser", "reviewer"]
    assert app.get_state(cfg).values["done"] == 1
    assert app.kvflow.tracker("t-real").ended
    with pytest.raises(TypeError):
        kvflow.instrument(peer(llm_for(srv)), checkpointer=InMemorySaver())  # compiled already
    with pytest.raises(TypeError):
        kvflow.instrument(object())


def test_user_callbacks_still_fire(srv, mode):
    from langchain_core.callbacks import BaseCallbackHandler

    seen = []

    class Mine(BaseCallbackHandler):
        def on_chat_model_start(self, *a, **kw):
            seen.append(kw["metadata"]["langgraph_node"])

    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    run(app, {"rounds": 1}, {"configurable": {"thread_id": "t-cb"}, "callbacks": [Mine()]}, mode)
    assert seen == ["planner", "executor", "expresser", "reviewer"]
    assert calls(srv) == peer_expected(1)


def test_explicit_hints_url_for_out_of_band_posts(srv):
    other = RecordingOpenAIServer().start()
    try:
        app = kvflow.instrument(peer(llm_for(srv)), hints_url=other.base_url)
        app.invoke({"rounds": 1}, {"configurable": {"thread_id": "t-url"}})
        oob.flush(5)
        assert [p.body["kvflow_event"] for p in other.hint_posts()] == ["end"]
        assert srv.hint_posts() == []
    finally:
        other.stop()


def test_an_unreachable_hint_endpoint_never_fails_the_run(srv):
    app = kvflow.instrument(peer(llm_for(srv)), hints_url="http://127.0.0.1:9/v1")
    out = app.invoke({"rounds": 1}, {"configurable": {"thread_id": "t-dead"}})
    assert out["done"] == 1


def test_explicit_http_client_for_custom_setups(srv, mode):
    autopatch.disable()  # only the explicit client attaches hints now
    import httpx2

    llm = ChatOpenAI(model="stub", base_url=srv.base_url, api_key="x",
                     http_client=kvflow.http_client(), http_async_client=kvflow.async_http_client())
    assert isinstance(kvflow.http_client(), httpx2.Client)
    g = peer(llm)
    app = kvflow.instrument(g, learn=False)
    autopatch.disable()  # instrument() enables it; switch it off again for this test
    run(app, {"rounds": 1}, {"configurable": {"thread_id": "t-explicit"}}, mode)
    assert calls(srv) == peer_expected(1)


def test_interrupt_before_pauses_without_ending(srv, mode):
    g = peer(llm_for(srv)).builder
    app = kvflow.instrument(g, checkpointer=InMemorySaver(), interrupt_before=["expresser"])
    cfg = {"configurable": {"thread_id": "t-before"}}
    run(app, {"rounds": 1}, cfg, mode)
    assert [c[0] for c in calls(srv)] == ["planner", "executor"]
    assert posts(srv) == []  # paused, not ended
    srv.clear()
    run(app, None, cfg, mode)
    assert calls(srv) == [
        ("expresser", 3, {"planner": 2, "executor": 3, "expresser": 0, "reviewer": 1}, ["reviewer"]),
        ("reviewer", 4, {"planner": 1, "executor": 2, "expresser": 3, "reviewer": 0}, ["planner"]),
    ]
    assert [p[0] for p in posts(srv)] == ["end"]


def test_a_failing_node_releases_the_workflow(srv, mode):
    llm = llm_for(srv)

    def boom(state):
        raise ValueError("boom")

    g = StateGraph(S)
    g.add_node("planner", agent(llm, "planner"))
    g.add_node("broken", boom)
    g.add_edge(START, "planner")
    g.add_edge("planner", "broken")
    app = kvflow.instrument(g, learn=False)
    with pytest.raises(ValueError, match="boom"):
        run(app, {}, {"configurable": {"thread_id": "t-err"}}, mode)
    assert posts(srv) == [("end", "__end__", 2, {"planner": N, "broken": N}, [])]
    assert app.kvflow.tracker("t-err").ended


def test_long_thread_ids_are_hashed_on_the_wire(srv):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    tid = "x" * 1000
    app.invoke({"rounds": 1}, {"configurable": {"thread_id": tid}})
    ids = {r.hints["kvflow_workflow"] for r in srv.llm_requests()}
    assert len(ids) == 1 and next(iter(ids)).startswith("sha1:")
    assert app.kvflow.tracker(tid) is not None


def test_callback_only_fallback_without_the_loop_hook(srv):
    from kvflow_agents.adapters import langgraph as lg

    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    lg._unpatch_pregel_loop()
    try:
        app.invoke({"rounds": 2}, {"configurable": {"thread_id": "t-fallback"}})
    finally:
        lg._patch_pregel_loop()
    assert calls(srv, sort_parallel=False) == peer_expected(2)
    assert [p[0] for p in posts(srv)] == ["end"]


def test_raw_openai_clients_inside_nodes_carry_hints_too(srv, mode):
    import openai

    sync_client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    async_client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "You are raw."}, {"role": "user", "content": "go"}]

    def f(state):
        sync_client.chat.completions.create(model="stub", messages=msgs)
        return {"log": ["raw"]}

    async def af(state):
        await async_client.chat.completions.create(model="stub", messages=msgs)
        return {"log": ["raw"]}

    g = StateGraph(S)
    g.add_node("raw", RunnableLambda(f, afunc=af))
    g.add_node("after", agent(llm_for(srv), "after"))
    g.add_edge(START, "raw")
    g.add_edge("raw", "after")
    app = kvflow.instrument(g, learn=False)
    run(app, {}, {"configurable": {"thread_id": "t-raw"}}, mode)
    assert calls(srv) == [("raw", 1, {"raw": 0, "after": 1}, ["after"]),
                          ("after", 2, {"raw": N, "after": 0}, [])]


def test_an_abandoned_stream_does_not_confuse_the_next_run(srv):
    app = kvflow.instrument(peer(llm_for(srv)), learn=False)
    cfg = {"configurable": {"thread_id": "t-abandon"}}
    it = app.stream({"rounds": 1}, cfg)
    next(it)  # planner ran; the rest never does
    it.close()
    srv.clear()
    app.invoke({"rounds": 1}, cfg)
    assert [c[:3] for c in calls(srv, sort_parallel=False)] == [c[:3] for c in peer_expected(1, step0=2)]
