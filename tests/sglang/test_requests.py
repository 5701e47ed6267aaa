"""Hints on the real request path: OpenAI request model -> sampling params -> SGLang's IPC
encoding -> Req -> the cache; the chat-template fixed-prefix length; the routing key."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import msgspec  # noqa: E402
import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from sglang.srt.managers.io_struct import GenerateReqInput  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures  # noqa: E402

from kvflow_agents.protocol import Hints  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402
from kvflow_agents.serving.sglang.http_api import (after_convert_to_internal_request,  # noqa: E402
                                                   fixed_prefix_tokens)

HINTS = Hints(workflow="thread-7", app="peer", agent="planner", step=3,
              ste={"planner": 0, "executor": 1, "reviewer": float("inf")},
              next=["executor"], fixed_messages=1)


def chat_body(**extra):
    return {"model": "m", "messages": [{"role": "system", "content": "You plan."},
                                       {"role": "user", "content": "Task 1"}],
            "custom_params": HINTS.to_custom_params(), **extra}


def test_hints_survive_openai_model_sampling_params_ipc_and_reach_req():
    request = ChatCompletionRequest.model_validate(json.loads(json.dumps(chat_body())))
    sp_dict = request.to_sampling_params(stop=[], model_generation_config={})
    sp = SamplingParams(**sp_dict)
    # SGLang's msgpack IPC carries SamplingParams as a typed msgspec struct
    sp = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert Hints.from_custom_params(sp.custom_params) == HINTS

    kit = UnifiedRadixCacheFixtures()
    kit.cfg = CacheConfig(page_size=4, eviction_policy="kvflow")
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, alloc, r2t = fx.build_fixture(kit.cfg)
    req, _ = kit._make_inflight_req(cache, alloc, r2t, list(range(100, 124)))
    req.sampling_params = sp
    got = cache.kvflow_on_request(req)
    assert got == HINTS
    assert cache.kv_hints.ste("peer/thread-7", "executor") == 1
    assert cache.kv_hints.ste("peer/thread-7", "reviewer") == float("inf")
    assert cache._req_hints[req.rid].tag == ("peer/thread-7", "planner")


class FakeTokenizer:
    """A chat template: each message renders as [BOS-of-role, content tokens..., END]; the
    generation prompt adds [ASSISTANT]. Tokens are ints."""

    ROLE = {"system": 1, "user": 2, "assistant": 3}

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        out = [0]
        for m in messages:
            out += [self.ROLE[m["role"]]] + [100 + ord(c) for c in m["content"]] + [9]
        if add_generation_prompt:
            out += [3]
        return out


def test_fixed_messages_become_tokens_via_chat_template_and_routing_key():
    tok = FakeTokenizer()
    request = ChatCompletionRequest.model_validate(chat_body())
    msgs = [m.model_dump(exclude_none=True) for m in request.messages]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    n = fixed_prefix_tokens(tok, msgs, 1, prompt)
    assert n == len(tok.apply_chat_template(msgs[:1]))  # BOS + system message, whole
    adapted = GenerateReqInput(input_ids=prompt,
                               sampling_params=request.to_sampling_params([], {}))
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tok))
    after_convert_to_internal_request((adapted, request), serving, request, None)
    assert adapted.sampling_params["custom_params"]["kvflow_fixed_prefix_tokens"] == n
    assert adapted.routing_key == "peer/thread-7"
    # an explicit routing key from the client wins
    adapted2 = GenerateReqInput(input_ids=prompt, routing_key="mine",
                                sampling_params=request.to_sampling_params([], {}))
    after_convert_to_internal_request((adapted2, request), serving, request, None)
    assert adapted2.routing_key == "mine"


class TextTokenizer:
    """A text-only model's tokenizer: the chat template renders text, SGLang's tokenizer
    manager encodes it later (one id per character here)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_fixed_messages_become_tokens_for_text_only_models():
    """SGLang passes a text-only model's request on as rendered ``text``: the fixed prefix is
    the rendered first message, encoded as SGLang will encode the prompt."""
    tok = TextTokenizer()
    request = ChatCompletionRequest.model_validate(chat_body())
    msgs = [m.model_dump(exclude_none=True) for m in request.messages]
    adapted = GenerateReqInput(text=tok.apply_chat_template(msgs, add_generation_prompt=True),
                               sampling_params=request.to_sampling_params([], {}))
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tok))
    after_convert_to_internal_request((adapted, request), serving, request, None)
    assert adapted.sampling_params["custom_params"]["kvflow_fixed_prefix_tokens"] == \
        len(tok.apply_chat_template(msgs[:1]))


def test_chat_hook_leaves_requests_without_hints_alone():
    body = chat_body()
    del body["custom_params"]
    request = ChatCompletionRequest.model_validate(body)
    adapted = GenerateReqInput(input_ids=[1, 2, 3], sampling_params=request.to_sampling_params([], {}))
    before = json.dumps(adapted.sampling_params, sort_keys=True, default=str)
    after_convert_to_internal_request((adapted, request), None, request, None)
    assert json.dumps(adapted.sampling_params, sort_keys=True, default=str) == before
    assert adapted.routing_key is None
    # malformed hints: the request goes through untouched too
    bad = ChatCompletionRequest.model_validate(chat_body(custom_params={"kvflow_v": 2}))
    adapted = GenerateReqInput(input_ids=[1, 2, 3], sampling_params=bad.to_sampling_params([], {}))
    after_convert_to_internal_request((adapted, bad), None, bad, None)
    assert "kvflow_fixed_prefix_tokens" not in (adapted.sampling_params.get("custom_params") or {})


def test_oob_endpoint_validates_and_forwards(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvflow_agents.serving.sglang import http_api

    sent = []
    async def fake_send(tm, msg):
        sent.append(msg)

    monkeypatch.setattr(http_api, "send_control", fake_send)

    async def fake_snapshot(tm, timeout=1.0):
        return {"engine": "sglang", "agents": []}

    monkeypatch.setattr(http_api, "request_snapshot", fake_snapshot)
    app = FastAPI()
    http_api.add_routes(app, lambda: object())
    client = TestClient(app)
    ok = client.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_workflow": "w",
                                                "kvflow_agent": "tool", "kvflow_ste": {"a": 1}})
    assert ok.status_code == 200 and ok.json()["accepted"]
    assert sent[-1].kind == "hints" and sent[-1].payload["kvflow_ste"] == {"a": 1}
    bad = client.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_workflow": "w",
                                                 "kvflow_agent": "tool", "kvflow_ste": {"a": -1}})
    assert bad.status_code == 400 and bad.json()["key"] == "kvflow_ste"
    assert client.get("/kvflow/v1/cache").json()["engine"] == "sglang"


def test_launcher_adds_kvflow_defaults_and_keeps_user_flags():
    from kvflow_agents.serving.sglang.launch import build_args

    args, env = build_args(["--model-path", "m", "--port", "30001", "--kvflow-lookahead", "2",
                            "--kvflow-max-prefetch=1", "--kvflow-busy-lookahead", "1"])
    assert args[:4] == ["--model-path", "m", "--port", "30001"]
    assert "--enable-hierarchical-cache" in args
    assert args[args.index("--radix-cache-backend") + 1] == "kvflow"
    assert args[args.index("--radix-eviction-policy") + 1] == "kvflow"
    assert env == {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
                   "KVFLOW_LOOKAHEAD": "2", "KVFLOW_MAX_PREFETCH": "1",
                   "KVFLOW_BUSY_LOOKAHEAD": "1"}
    args, _ = build_args(["--model-path", "m", "--radix-eviction-policy=lru",
                          "--disable-hierarchical-cache"])
    assert args.count("--radix-eviction-policy=lru") == 1 and "--radix-eviction-policy" not in args
    assert "--enable-hierarchical-cache" not in args
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    sa = prepare_server_args(build_args(["--model-path", "dummy"])[0])
    assert sa.enable_hierarchical_cache and sa.radix_cache_backend == "kvflow"


def test_launcher_module_registers_plugin_without_the_entry_point(tmp_path):
    """``python -m kvflow_agents.serving.sglang.launch`` works where the entry point is not
    loaded (SGLANG_PLUGINS whitelist excludes it): the kvflow policy is a CLI choice."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SGLANG_PLUGINS": "none"}
    out = subprocess.run([sys.executable, "-m", "kvflow_agents.serving.sglang.launch",
                          "--model-path", "dummy", "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tlru,kvflow}" in out.stdout
    stock = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "kvflow" not in stock.stdout  # the whitelist really kept the entry point out
