"""Zero-config hints: any ``openai`` client created the ordinary way carries them
(:mod:`kvflow_agents.autopatch`), checked on the wire against a real HTTP server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import kvflow_agents as kvflow
from kvflow_agents import autopatch, fixed_prefix
from kvflow_agents.protocol import Hints

H = Hints(workflow="w1", agent="planner", step=2, ste={"planner": 0, "coder": 1, "old": float("inf")},
          next=["coder"], app="demo")
WIRE = {"kvflow_v": 1, "kvflow_workflow": "w1", "kvflow_agent": "planner", "kvflow_step": 2,
        "kvflow_ste": {"planner": 0, "coder": 1, "old": None}, "kvflow_next": ["coder"],
        "kvflow_app": "demo"}
SYS_USER = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "go"}]


@pytest.fixture(autouse=True)
def patched():
    was = autopatch.is_enabled()
    assert autopatch.enable() is True
    yield
    if not was:
        autopatch.disable()


def test_enable_is_idempotent_and_disable_restores_the_sdk():
    from openai import _base_client as bc

    autopatch.enable()
    autopatch.enable()
    assert getattr(bc.BaseClient._build_request, "_kvflow_original", None) is not None
    autopatch.disable()
    assert getattr(bc.BaseClient._build_request, "_kvflow_original", None) is None
    autopatch.disable()
    autopatch.enable()
    assert getattr(bc.BaseClient._build_request, "_kvflow_original", None) is not None


def test_plain_sync_client_carries_hints_and_headers(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER)
        client.completions.create(model="m", prompt="hi")
    chat, comp = recording_server.llm_requests()
    assert chat.hints == {**WIRE, "kvflow_fixed_messages": 1}
    assert chat.headers["x-kvflow-workflow"] == "w1" and chat.headers["x-kvflow-agent"] == "planner"
    assert comp.hints == WIRE  # no messages: no boundary
    assert chat.body["messages"] == SYS_USER


def test_plain_async_client_carries_hints(recording_server):
    async def main():
        client = openai.AsyncOpenAI(base_url=recording_server.base_url, api_key="x")
        with kvflow.hints(H):
            await client.chat.completions.create(model="m", messages=SYS_USER)
        with kvflow.hints(H, agent="coder"):
            stream = await client.chat.completions.create(model="m", messages=SYS_USER, stream=True)
            async for _ in stream:
                pass
        await client.close()

    asyncio.run(main())
    a, b = recording_server.llm_requests()
    assert a.hints["kvflow_agent"] == "planner" and b.hints["kvflow_agent"] == "coder"
    assert b.body["stream"] is True


@pytest.mark.parametrize("lib", ["httpx2", "httpx"])
def test_user_supplied_http_client_of_either_library(recording_server, lib):
    mod = pytest.importorskip(lib)
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x", http_client=mod.Client())
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER)
    assert recording_server.llm_requests()[0].hints["kvflow_agent"] == "planner"


def test_requests_outside_hints_and_other_endpoints_are_untouched(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    client.chat.completions.create(model="m", messages=SYS_USER)
    with kvflow.hints(H):
        client.models.list()
    chat = recording_server.llm_requests()[0]
    assert "custom_params" not in chat.body and "x-kvflow-agent" not in chat.headers
    models = [r for r in recording_server.requests if r.path.endswith("/models")][0]
    assert "x-kvflow-agent" not in models.headers


def test_callers_custom_params_win(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER,
                                       extra_body={"custom_params": {"kvflow_agent": "me", "mine": 1}},
                                       extra_headers={"X-KVFlow-Agent": "hdr"})
    r = recording_server.llm_requests()[0]
    assert r.body["custom_params"]["kvflow_agent"] == "me" and r.body["custom_params"]["mine"] == 1
    assert r.body["custom_params"]["kvflow_workflow"] == "w1"
    assert r.headers["x-kvflow-agent"] == "hdr"


def test_no_double_injection_with_kvflow_http_client(recording_server):
    # The transport has its own hint source; the patch leaves such clients to it.
    other = Hints(workflow="w2", agent="transport")
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x",
                           http_client=kvflow.http_client(hints=lambda: other))
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER)
    r = recording_server.llm_requests()[0]
    assert r.hints["kvflow_agent"] == "transport" and r.hints["kvflow_fixed_messages"] == 1
    assert r.headers["x-kvflow-agent"] == "transport"


def test_requests_hinted_by_the_patch_are_not_rewritten_by_a_transport_below(recording_server):
    # A kvflow transport mounted somewhere the patch cannot see (here: under a plain transport
    # wrapper) sees the request tagged and passes it on unchanged.
    t_cls, _ = kvflow.transport.transports_for("httpx2")
    import httpx2

    seen = []

    class Spy(httpx2.BaseTransport):
        def __init__(self):
            self.inner = t_cls(hints=lambda: Hints(workflow="never", agent="never"))

        def handle_request(self, request):
            seen.append(request.extensions.get("kvflow_hinted"))
            return self.inner.handle_request(request)

    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x",
                           http_client=httpx2.Client(transport=Spy()))
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER)
    assert seen == [True]
    assert recording_server.llm_requests()[0].hints["kvflow_agent"] == "planner"


def test_disabled_patch_sends_nothing(recording_server):
    autopatch.disable()
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=SYS_USER)
    assert "custom_params" not in recording_server.llm_requests()[0].body


# ---------------------------------------------------------------- fixed-prefix boundary
def test_boundary_defaults_to_leading_system_and_developer_messages(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    msgs = [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "system", "content": "late"}]
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=msgs)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    a, b = recording_server.llm_requests()
    assert a.hints["kvflow_fixed_messages"] == 2 and b.hints["kvflow_fixed_messages"] == 0


def test_kvflow_marker_sets_the_boundary_and_is_stripped(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    msgs = [{"role": "system", "content": "sys"},
            {"role": "user", "content": [fixed_prefix.marker_part("tool catalog")]},
            {"role": "user", "content": "question"}]
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=msgs)
    r = recording_server.llm_requests()[0]
    assert r.hints["kvflow_fixed_messages"] == 2
    assert r.body["messages"][1]["content"] == [{"type": "text", "text": "tool catalog"}]
    assert msgs[1]["content"][0]["kvflow_fixed_end"] is True  # the caller's list is not mutated


def test_markers_are_stripped_even_outside_hints(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": [fixed_prefix.marker_part("t")]}])
    r = recording_server.llm_requests()[0]
    assert r.body["messages"][0]["content"] == [{"type": "text", "text": "t"}]
    assert "custom_params" not in r.body


def test_openai_prompt_cache_breakpoint_sets_the_boundary_and_is_kept(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    part = {"type": "text", "text": "shared docs", "prompt_cache_breakpoint": {"mode": "explicit"}}
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": [part]},
            {"role": "user", "content": [dict(part, text="later turn")]}]
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=msgs)
    r = recording_server.llm_requests()[0]
    assert r.hints["kvflow_fixed_messages"] == 2  # the first breakpoint
    assert r.body["messages"][1]["content"][0]["prompt_cache_breakpoint"] == {"mode": "explicit"}


def test_explicit_fixed_messages_in_hints_win(recording_server):
    client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
    with kvflow.hints(H, fixed_messages=0):
        client.chat.completions.create(model="m", messages=SYS_USER)
    assert recording_server.llm_requests()[0].hints["kvflow_fixed_messages"] == 0


def test_marker_through_the_transport_path_too(recording_server):
    with kvflow.http_client(library="httpx") as http:
        body = {"model": "m", "messages": [{"role": "user", "content": [fixed_prefix.marker_part("t")]},
                                           {"role": "user", "content": "q"}]}
        with kvflow.hints(H):
            http.post(recording_server.base_url + "/chat/completions", json=body)
    r = recording_server.llm_requests()[0]
    assert r.hints["kvflow_fixed_messages"] == 1
    assert r.body["messages"][0]["content"] == [{"type": "text", "text": "t"}]


def test_fixed_prefix_analyze_edge_cases():
    assert fixed_prefix.analyze(None) == (None, None)
    assert fixed_prefix.analyze([]) == (0, None)
    msgs = [{"role": "system", "content": "s", "kvflow_fixed_end": True}, "odd", {"role": "user"}]
    fixed, cleaned = fixed_prefix.analyze(msgs)
    assert fixed == 1 and cleaned == [{"role": "system", "content": "s"}, "odd", {"role": "user"}]
    # the kvflow marker wins over an OpenAI breakpoint, and the last kvflow marker counts
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {}}]},
            {"role": "user", "content": [fixed_prefix.marker_part("b")]},
            {"role": "user", "content": [fixed_prefix.marker_part("c")]}]
    assert fixed_prefix.analyze(msgs)[0] == 3


def test_a_failing_provider_never_fails_the_request(recording_server):
    def broken():
        raise RuntimeError("boom")

    kvflow.register_hint_provider(broken)
    try:
        client = openai.OpenAI(base_url=recording_server.base_url, api_key="x")
        out = client.chat.completions.create(model="m", messages=SYS_USER)
        assert out.choices[0].message.content == "ok"
    finally:
        kvflow.unregister_hint_provider(broken)


def test_chatopenai_zero_config(recording_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=recording_server.base_url, api_key="x")
    with kvflow.hints(H):
        llm.invoke([("system", "You plan."), ("human", "go")])
    r = recording_server.llm_requests()[0]
    assert r.hints == {**WIRE, "kvflow_fixed_messages": 1}


def test_chatopenai_passes_both_markers_through(recording_server):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=recording_server.base_url, api_key="x")
    breakpoint_part = {"type": "text", "text": "docs", "prompt_cache_breakpoint": {"mode": "explicit"}}
    with kvflow.hints(H):
        llm.invoke([SystemMessage("s"), HumanMessage(content=[fixed_prefix.marker_part("catalog")]),
                    HumanMessage("q")])
        llm.invoke([SystemMessage("s"), HumanMessage(content=[breakpoint_part]), HumanMessage("q")])
    a, b = recording_server.llm_requests()
    assert a.hints["kvflow_fixed_messages"] == 2 and b.hints["kvflow_fixed_messages"] == 2
    assert a.body["messages"][1]["content"] == [{"type": "text", "text": "catalog"}]
    assert b.body["messages"][1]["content"] == [breakpoint_part]


def test_legacy_httpx_is_still_importable_for_openai_clients():
    assert httpx.Client  # the project depends on httpx; openai 3 accepts an httpx.Client too
