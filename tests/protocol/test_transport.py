"""Hints reach the wire: the real openai SDK, real HTTP on 127.0.0.1, httpx and httpx2."""

import asyncio
import json

import httpx
import openai
import pytest

import kvflow_agents as kvflow
from kvflow_agents.context import register_hint_provider, unregister_hint_provider
from kvflow_agents.protocol import Hints
from kvflow_agents.transport import rewrite_body, transports_for

LIBS = ["httpx", "httpx2"]
H = Hints(workflow="wf-1", app="demo", agent="planner", step=2,
          ste={"planner": 0, "coder": 1, "critic": float("inf")}, next=["coder"])
MSGS = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "hi"}]


def client(srv, lib):
    return openai.OpenAI(base_url=srv.base_url, api_key="x", http_client=kvflow.http_client(library=lib),
                         max_retries=0)


@pytest.mark.parametrize("lib", LIBS)
def test_sync_chat_and_completions_carry_hints_and_headers(recording_server, lib):
    c = client(recording_server, lib)
    with kvflow.hints(H):
        c.chat.completions.create(model="m", messages=MSGS)
        c.completions.create(model="m", prompt="hello")
        stream = c.chat.completions.create(model="m", messages=MSGS, stream=True)
        assert "ok" in "".join(ch.choices[0].delta.content or "" for ch in stream)
        c.models.list()  # not an LLM request: untouched
    reqs = recording_server.requests
    assert [r.path for r in reqs] == ["/v1/chat/completions", "/v1/completions",
                                      "/v1/chat/completions", "/v1/models"]
    for r in reqs[:3]:
        # Chat requests also carry the fixed-prefix boundary (the leading system message).
        fixed = {"kvflow_fixed_messages": 1} if "messages" in r.body else {}
        assert r.body["custom_params"] == {**H.to_custom_params(), **fixed}
        assert r.headers["x-kvflow-workflow"] == "wf-1" and r.headers["x-kvflow-agent"] == "planner"
    assert reqs[0].body["messages"] == MSGS  # the payload itself is unchanged
    assert "x-kvflow-agent" not in reqs[3].headers


@pytest.mark.parametrize("lib", LIBS)
def test_async_client_carries_hints(recording_server, lib):
    async def run():
        c = openai.AsyncOpenAI(base_url=recording_server.base_url, api_key="x", max_retries=0,
                               http_client=kvflow.async_http_client(library=lib))

        async def one(agent):
            with kvflow.hints(H, agent=agent):
                await c.chat.completions.create(model="m", messages=MSGS)

        await asyncio.gather(*(one(a) for a in ("a1", "a2", "a3")))  # contexts do not mix

    asyncio.run(run())
    agents = sorted(r.body["custom_params"]["kvflow_agent"] for r in recording_server.llm_requests())
    assert agents == ["a1", "a2", "a3"]
    assert all(r.headers["x-kvflow-agent"] == r.body["custom_params"]["kvflow_agent"]
               for r in recording_server.llm_requests())


@pytest.mark.parametrize("lib", LIBS)
def test_callers_custom_params_are_merged_and_win(recording_server, lib):
    c = client(recording_server, lib)
    with kvflow.hints(H):
        c.chat.completions.create(model="m", messages=MSGS,
                                  extra_body={"custom_params": {"mine": 7, "kvflow_step": 99}})
    cp = recording_server.llm_requests()[0].body["custom_params"]
    assert cp["mine"] == 7 and cp["kvflow_step"] == 99 and cp["kvflow_agent"] == "planner"


@pytest.mark.parametrize("lib", LIBS)
def test_requests_without_hints_are_untouched(recording_server, lib):
    c = client(recording_server, lib)
    c.chat.completions.create(model="m", messages=MSGS)
    r = recording_server.llm_requests()[0]
    assert "custom_params" not in r.body and "x-kvflow-agent" not in r.headers


@pytest.mark.parametrize("lib", LIBS)
def test_a_broken_provider_never_fails_the_request(recording_server, lib):
    def broken():
        raise RuntimeError("provider bug")

    register_hint_provider(broken)
    try:
        client(recording_server, lib).chat.completions.create(model="m", messages=MSGS)
    finally:
        unregister_hint_provider(broken)
    assert "custom_params" not in recording_server.llm_requests()[0].body


def test_providers_supply_hints_when_no_explicit_block(recording_server):
    def provider():
        return H

    register_hint_provider(provider)
    try:
        client(recording_server, "httpx2").chat.completions.create(model="m", messages=MSGS)
        with kvflow.hints(H, agent="explicit"):  # an explicit block wins
            client(recording_server, "httpx2").chat.completions.create(model="m", messages=MSGS)
    finally:
        unregister_hint_provider(provider)
    got = [r.body["custom_params"]["kvflow_agent"] for r in recording_server.llm_requests()]
    assert got == ["planner", "explicit"]


def test_transport_wraps_a_given_inner_transport():
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"ok": True})

    t_cls, _ = transports_for("httpx")
    with httpx.Client(transport=t_cls(httpx.MockTransport(handler), hints=lambda: H)) as c:
        c.post("http://x/v1/chat/completions", json={"model": "m"})
        c.post("http://x/v1/embeddings", json={"model": "m"})
    assert seen[0]["custom_params"]["kvflow_agent"] == "planner"
    assert "custom_params" not in seen[1]


def test_rewrite_body_leaves_odd_bodies_alone():
    assert rewrite_body(b"not json", H) is None
    assert rewrite_body(b"[1,2]", H) is None
    assert rewrite_body(b'{"custom_params": "str"}', H) is None
    out = json.loads(rewrite_body(b'{"model":"m"}', H))
    assert out["custom_params"]["kvflow_workflow"] == "wf-1"


@pytest.mark.parametrize("channel", ["both", "metadata", "custom_params"])
def test_hint_channel_picks_the_body_fields_and_keeps_callers_metadata(channel):
    from kvflow_agents.context import set_hint_channel
    from kvflow_agents.protocol import Hints as _H

    set_hint_channel(channel)
    try:
        out = json.loads(rewrite_body(json.dumps({"messages": [], "metadata": {"mine": "x"}}).encode(), H))
    finally:
        set_hint_channel(None)
    assert ("custom_params" in out) == (channel != "metadata")
    assert out["metadata"]["mine"] == "x"
    assert ("kvflow" in out["metadata"]) == (channel != "custom_params")
    got = _H.from_request(out)
    assert got.model_copy(update={"fixed_messages": None}) == H.model_copy(update={"fixed_messages": None})
    with pytest.raises(ValueError):
        set_hint_channel("smoke-signals")
