"""Tenancy and limits on the plugin's endpoints (issue #17): the same rules as the embedded
server. Tenants from ``KVFLOW_API_KEYS_FILE`` (here set on the module); hints are scoped to the
tenant, ``/kvflow/v1/cache`` lists only the caller's workflows, bodies are bounded and strict."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("sglang.srt")

from test_http import served  # noqa: E402,F401 - SGLang's app + a scheduler loop, reused

from kvflow_agents.serving.sglang import http_api  # noqa: E402
from kvflow_agents.serving.tenancy import Tenancy  # noqa: E402
from kvflow_agents.testing import wait_until  # noqa: E402

A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


@pytest.fixture
def tenants(monkeypatch):
    monkeypatch.setattr(http_api, "_tenancy", Tenancy({"alice": "key-a", "bob": "key-b"}))


def hint(**kw):
    return {"kvflow_v": 1, "kvflow_workflow": "t1", "kvflow_app": "peer", "kvflow_agent": "tool",
            "kvflow_ste": {"planner": 1}, **kw}


def test_tenants_only_see_and_touch_their_own_workflows(served, tenants):  # noqa: F811
    client, cache, _ = served
    assert client.post("/kvflow/v1/hints", json=hint()).status_code == 401
    assert client.post("/kvflow/v1/hints", json=hint(), headers=A).status_code == 200
    assert wait_until(lambda: cache.kv_hints.ste("alice::peer/t1", "planner") == 1)
    assert cache.kv_hints.ste("peer/t1", "planner") == float("inf")  # nothing unscoped
    mine = client.get("/kvflow/v1/cache", headers=A).json()
    assert list(mine["workflows"]) == ["peer/t1"]
    assert client.get("/kvflow/v1/cache", headers=B).json()["workflows"] == {}
    for body in (hint(kvflow_event="end"), hint(kvflow_ste={"planner": None}),
                 hint(kvflow_app="alice::peer", kvflow_event="end")):
        assert client.post("/kvflow/v1/hints", json=body, headers=B).status_code == 200
    assert wait_until(lambda: "bob::peer/t1" in cache.kv_hints.workflows)
    time.sleep(0.2)
    assert cache.kv_hints.ste("alice::peer/t1", "planner") == 1  # bob named his own workflows
    assert client.get("/kvflow/v1/cache").status_code == 401


def test_hint_bodies_are_bounded_and_strict(served, tenants):  # noqa: F811
    client, _, _ = served
    big = json.dumps(hint(kvflow_pad="x" * (http_api.MAX_HINT_BODY + 1)))
    assert client.post("/kvflow/v1/hints", content=big, headers=A).status_code == 413
    for raw in (b'{"kvflow_v": 1, "kvflow_workflow": "w\\ud800", "kvflow_agent": "a"}',
                b"[" * 5000 + b"]" * 5000, b"\xef\xbb\xbf{}", b'{"kvflow_v": 1, "x": "\xff"}'):
        r = client.post("/kvflow/v1/hints", content=raw, headers={**A, "content-type": "application/json"})
        assert r.status_code == 400, (raw[:40], r.text)


def test_request_hints_are_scoped_to_the_tenant(tenants):
    """The hint intake (chat and completions, custom_params or metadata) scopes hints to the
    caller's tenant; an unknown caller's hints are dropped; hint-only events are scoped too."""
    params = {"kvflow_v": 1, "kvflow_workflow": "t1", "kvflow_agent": "planner", "kvflow_ste": {}}

    def intake(headers, path="/v1/chat/completions", **extra):
        body = json.dumps({"model": "m", "messages": [], "custom_params": {**params, **extra}}).encode()
        out, control = http_api.intake(body, {k.lower(): v for k, v in headers.items()}, path)
        return json.loads(out).get("custom_params"), control
    assert intake(A)[0]["kvflow_workflow"] == "alice::t1"
    assert intake(B, "/v1/completions")[0]["kvflow_workflow"] == "bob::t1"
    assert intake(A, kvflow_app="peer")[0]["kvflow_app"] == "alice::peer"
    assert not any(k.startswith("kvflow_") for k in intake({})[0])  # unknown tenant: dropped
    _, control = intake(B, "/v1/completions", kvflow_event="end")
    assert control["kvflow_workflow"] == "bob::t1" and control["kvflow_event"] == "end"
