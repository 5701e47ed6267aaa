"""Gateway-proof hints on the SGLang plugin: SGLang's gateway forwards hints only as
``metadata["kvflow"]`` (plus ``x-smg-routing-key``) on chat completions, and SGLang's own OpenAI
request models drop ``metadata``. The plugin's ASGI intake (installed on SGLang's app) copies them
into ``custom_params`` before SGLang parses the body, and answers hint-only completions (an
out-of-band event routed by the gateway) by sending them to the schedulers."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang.srt")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionRequest,  # noqa: E402
                                                     CompletionRequest)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvflow_agents.protocol import Hints, hint_only_completion  # noqa: E402
from kvflow_agents.serving.sglang import http_api  # noqa: E402
from kvflow_agents.serving.sglang.messages import KVFlowControl  # noqa: E402

HINTS = Hints(workflow="thread-7", app="peer", agent="planner", step=3,
              ste={"planner": 0, "executor": 1, "reviewer": float("inf")}, next=["executor"],
              fixed_messages=1)
MSGS = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Task 1"}]


def gateway_body(flat: dict) -> dict:
    """What SGLang's gateway (sglang-router 0.3.2) forwards: custom_params gone, metadata kept."""
    return {"model": "m", "messages": MSGS, "max_completion_tokens": 4,
            "metadata": {"kvflow": json.dumps(flat, separators=(",", ":")), "other": "x"}}


def test_metadata_hints_land_in_sglangs_custom_params_and_sampling_params():
    body, control = http_api.intake(json.dumps(gateway_body(HINTS.to_custom_params())).encode(),
                                    {"x-smg-routing-key": "thread-7"}, "/v1/chat/completions")
    assert control is None
    req = ChatCompletionRequest.model_validate(json.loads(body))
    assert Hints.from_custom_params(req.custom_params) == HINTS
    sp = SamplingParams(**req.to_sampling_params(stop=[], model_generation_config={}))
    assert Hints.from_custom_params(sp.custom_params) == HINTS


def test_the_routing_key_is_the_workflow_when_the_hints_omit_it():
    flat = {k: v for k, v in HINTS.to_custom_params().items() if k != "kvflow_workflow"}
    body, _ = http_api.intake(json.dumps(gateway_body(flat)).encode(),
                              {"x-smg-routing-key": "thread-7"}, "/v1/chat/completions")
    assert Hints.from_custom_params(ChatCompletionRequest.model_validate(json.loads(body)).custom_params) == HINTS


def test_custom_params_from_a_direct_client_pass_unchanged_and_bad_metadata_is_ignored():
    direct = json.dumps({"model": "m", "messages": MSGS, "custom_params": HINTS.to_custom_params(),
                         "metadata": {"kvflow": HINTS.to_metadata_value()}}).encode()
    assert http_api.intake(direct, {}, "/v1/chat/completions") == (direct, None)
    bad = json.dumps({"model": "m", "messages": MSGS, "metadata": {"kvflow": "{not json"}}).encode()
    assert http_api.intake(bad, {}, "/v1/chat/completions") == (bad, None)
    plain = json.dumps({"model": "m", "messages": MSGS}).encode()
    assert http_api.intake(plain, {}, "/v1/chat/completions") == (plain, None)


class FakeTokenizerManager:
    """Captures what the intake dispatches to the schedulers (SGLang's own IPC wrapper is used)."""

    def __init__(self) -> None:
        self.sent = []

    async def _async_dispatch_to_scheduler(self, obj) -> None:
        from sglang.srt.managers.io_struct import unwrap_from_pickle
        self.sent.append(unwrap_from_pickle(obj))


@pytest.fixture
def app():
    """A FastAPI app with SGLang's request models on the OpenAI routes, behind the intake."""
    tm = FakeTokenizerManager()
    api = FastAPI()
    seen = []

    @api.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest) -> dict:
        seen.append(request)
        return {"custom_params": request.custom_params}

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest) -> dict:
        seen.append(request)
        return {"ran": True}

    api.add_middleware(http_api.HintIntake, get_tokenizer_manager=lambda: tm)
    return TestClient(api), tm, seen


def test_intake_middleware_on_the_chat_route(app):
    client, tm, seen = app
    r = client.post("/v1/chat/completions", json=gateway_body(HINTS.to_custom_params()),
                    headers={"x-smg-routing-key": "thread-7"})
    assert r.status_code == 200
    assert Hints.from_custom_params(r.json()["custom_params"]) == HINTS and tm.sent == []
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS})
    assert r.json()["custom_params"] is None  # an unhinted request is untouched


def test_hint_only_completion_goes_to_the_schedulers_without_running_the_model(app):
    client, tm, seen = app
    r = client.post("/v1/completions", json=hint_only_completion(HINTS, "end", "m"),
                    headers={"x-smg-routing-key": "thread-7"})
    assert r.status_code == 200 and r.headers["x-kvflow-hints"] == "accepted"
    assert r.json()["choices"][0]["text"] == "" and r.json()["kvflow"]["event"] == "end"
    assert seen == []  # SGLang's completion handler never ran
    (msg,) = tm.sent
    assert isinstance(msg, KVFlowControl) and msg.kind == "hints"
    assert Hints.from_custom_params(msg.payload) == HINTS.model_copy(update={"event": "end"})
    # the same body with metadata only (what a gateway that drops custom_params would forward)
    body = hint_only_completion(HINTS, "transition", "m")
    del body["custom_params"]
    assert client.post("/v1/completions", json=body).status_code == 200
    assert tm.sent[-1].payload["kvflow_event"] == "transition" and seen == []
