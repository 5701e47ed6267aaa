"""What SGLang's gateway needs from an embedded worker (serving/embedded/worker_api.py), over real
HTTP: SGLang's worker endpoints with the served model and live load, /health 503 while draining,
the instance header, hint-only completions, metric families whose series never come and go."""

from __future__ import annotations

import re

import httpx

from kvflow_agents.protocol import Hints, hint_only_completion


def test_worker_endpoints_health_states_and_instance_header(serve, monkeypatch):
    monkeypatch.setenv("KVFLOW_INSTANCE_ID", "w7")
    with serve() as srv:
        c = httpx.Client(base_url=srv.url)
        for path in ("/model_info", "/get_model_info"):
            info = c.get(path).json()
            assert info["served_model_name"] == "tiny-random" and info["is_generation"] is True
        si = c.get("/server_info").json()
        assert si["instance_id"] == "w7" and si["max_total_num_tokens"] == 4096 and si["status"] == "ready"
        assert c.get("/get_server_info").json()["instance_id"] == "w7"
        (load,) = c.get("/v1/loads").json()["loads"]
        assert load["max_total_num_tokens"] == 4096 and load["num_running_reqs"] == 0
        assert c.get("/get_load").json()[0]["num_reqs"] == 0
        r = c.post("/v1/completions", json={"model": "tiny-random", "prompt": "hello there", "max_tokens": 2})
        assert r.headers["x-kvflow-instance"] == "w7"
        # cached prefixes are not "KV usage": the gateway would call the worker overloaded
        assert c.get("/v1/loads").json()["loads"][0]["token_usage"] == 0.0
        assert c.post("/flush_cache").status_code == 200
        assert c.get("/health").json() == {"status": "ok", "model": "tiny-random", "policy": "kvflow",
                                           "instance": "w7"}
        assert c.post("/kvflow/v1/drain").json()["status"] == "draining"
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        assert c.post("/v1/completions", json={"model": "tiny-random", "prompt": "x", "max_tokens": 1}).status_code == 200
        c.delete("/kvflow/v1/drain")
        assert c.get("/health").status_code == 200


def test_hint_only_completion_applies_the_event_without_a_model_step(serve):
    with serve() as srv:
        c = httpx.Client(base_url=srv.url)
        h = Hints(workflow="wf", agent="planner", ste={"planner": 0, "coder": 1}, next=["coder"])
        c.post("/v1/chat/completions", json={"model": "tiny-random",
                                             "messages": [{"role": "system", "content": "You plan. " * 10},
                                                          {"role": "user", "content": "go"}],
                                             "max_tokens": 2, "custom_params": h.to_custom_params()})
        assert [w["workflow"] for w in c.get("/kvflow/v1/cache").json()["workflows"]] == ["wf"]
        before = srv.engine.stats()["counters"]["requests"]
        r = c.post("/v1/completions", json=hint_only_completion(h, "end", "tiny-random"))
        assert r.status_code == 200 and r.headers["x-kvflow-hints"] == "accepted"
        assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["total_tokens"] == 0
        assert srv.engine.stats()["counters"]["requests"] == before  # no model step
        assert c.get("/kvflow/v1/cache").json()["workflows"] == []  # released
        # an event on a chat request is refused as a hint, the request still answers
        bad = c.post("/v1/chat/completions", json={"model": "tiny-random",
                                                   "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                   "metadata": {"kvflow": h.model_copy(update={"event": "end"}).to_metadata_value()}})
        assert bad.status_code == 200 and bad.headers["x-kvflow-hints"].startswith("rejected: kvflow_event")


def test_labelled_metric_families_have_the_same_series_from_the_first_scrape(serve):
    with serve() as srv:
        first = httpx.get(srv.url + "/metrics").text
        httpx.post(srv.base_url + "/completions", json={"model": "tiny-random", "prompt": "hello " * 50,
                                                         "max_tokens": 2})
        later = httpx.get(srv.url + "/metrics").text

        def series(text):
            return sorted(re.findall(r"^(kvflow_\w+\{[^}]*\})", text, re.M))
        assert series(first) == series(later)
        assert 'kvflow_evictions_total{reason="alloc",tier="device"}' in first
        assert 'kvflow_evictions_total{reason="grow",tier="device"}' in first
        assert 'kvflow_prefetch_wasted_total{reason="workflow_end"} 0.0' in first
