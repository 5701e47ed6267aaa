"""The embedded server's OpenAI-compatible API, through real HTTP with the ``openai`` client."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvflow_agents.testing import wait_until
from serving_helpers import chat_hints, run_concurrently

SYSTEM = {"role": "system", "content": "You are a careful planner. Follow the plan. " * 4}


def test_models_health_and_chat_usage(serve):
    with serve(policy="kvflow") as srv:
        c = srv.client()
        assert [m.id for m in c.models.list().data] == ["tiny-random"]
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        cached = []
        for i in range(3):
            r = c.chat.completions.create(
                model="tiny-random", messages=[SYSTEM, {"role": "user", "content": f"question {i}"}],
                max_tokens=3, temperature=0,
                extra_body={"custom_params": chat_hints("wf-u", "planner", {"planner": 0})})
            assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
            u = r.usage
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens
            kv = u.model_extra["kvflow"]
            assert u.prompt_tokens_details.cached_tokens == kv["device_hit_tokens"] + kv["host_hit_tokens"]
            assert kv["computed_tokens"] == u.prompt_tokens - u.prompt_tokens_details.cached_tokens
            cached.append(u.prompt_tokens_details.cached_tokens)
        # repeated fixed prompt: the system prompt (whole pages of it) is not recomputed
        fixed = srv.engine.tokenizer.fixed_prefix_tokens([SYSTEM, {"role": "user", "content": "x"}], 1)
        assert cached[0] == 0
        assert cached[1] >= fixed // 16 * 16 > 0 and cached[2] >= cached[1]


def test_stream_matches_non_stream_and_completions(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        msgs = [SYSTEM, {"role": "user", "content": "go"}]
        full = c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        chunks = list(c.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == full.choices[0].message.content
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

        r = c.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.object == "text_completion" and r.usage.completion_tokens == 5
        assert r.choices[0].finish_reason == "length"
        parts = list(c.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=5,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text

        # sampling: same seed, same answer
        a, b = (c.completions.create(model="tiny-random", prompt="abc", max_tokens=6, temperature=1.0, top_p=0.9,
                                     seed=7, extra_body={"ignore_eos": True}).choices[0].text for _ in range(2))
        assert a == b


def test_stop_strings(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        base = c.completions.create(model="tiny-random", prompt="Hello there", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
        stop = next((base[i:i + 1] for i in range(2, len(base)) if base[i:i + 1].isprintable()
                     and base[i:i + 1].strip()), None)
        if stop is None:
            pytest.skip("tiny-random produced no printable character to stop on")
        r = c.completions.create(model="tiny-random", prompt="Hello there", max_tokens=12, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == base[:base.index(stop)]


def test_bad_input_is_400_with_openai_error_schema(serve):
    with serve(policy="kvflow", device_tokens=512) as srv:
        h = srv.http()
        r = h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert h.get("/v1/nope").json()["error"]["type"] == "not_found_error"
        assert h.get("/v1/chat/completions").status_code == 405
        for body, param in [
            ({"model": "tiny-random"}, "messages"),
            ({"model": "tiny-random", "messages": []}, "messages"),
            ({"model": "tiny-random", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "n": 2, "temperature": 0}, "n"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
             "tool_choice"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
             "tools[0]"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "yaml"}}, "response_format"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
            ({"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
            ({"model": "tiny-random", "prompt": "x", "logprobs": 9}, "logprobs"),
            ({"model": "tiny-random", "prompt": []}, "prompt"),
        ]:
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = h.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
        c = srv.client()
        with pytest.raises(openai.BadRequestError) as ei:  # prompt over the 512-token device pool
            c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x" * 600}], max_tokens=4)
        assert ei.value.status_code == 400 and "device" in ei.value.message
        assert ei.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
            c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x" * 400}], max_tokens=400)
        # the server still works afterwards
        assert c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2).usage.completion_tokens >= 1


def test_api_key_guards_every_endpoint(serve):
    with serve(api_key="s3cret") as srv:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        with srv.http() as h:
            for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("GET", "/kvflow/v1/cache"), ("POST", "/kvflow/v1/hints"),
                                 ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]:
                r = h.request(method, path, json={})
                assert r.status_code == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
        ok = srv.client(api_key="s3cret")
        assert ok.models.list().data[0].id == "tiny-random"
        with srv.http(headers={"Authorization": "Bearer s3cret"}) as h:
            r = h.post("/kvflow/v1/hints", json=chat_hints("w", "a", {"a": 1}))
            assert r.status_code == 200
            assert h.get("/kvflow/v1/cache").status_code == 200


def test_sixteen_concurrent_streams_complete(serve):
    with serve(policy="kvflow", max_batch=16) as srv:
        results = {}

        def worker(i: int) -> None:
            c = srv.client()
            results[i] = list(c.chat.completions.create(
                model="tiny-random", messages=[SYSTEM, {"role": "user", "content": f"stream {i}"}],
                max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True,
                            "custom_params": chat_hints(f"wf{i % 4}", "planner", {"planner": 0})}))
        errors = run_concurrently(worker, 16, timeout=60)
        assert not errors and len(results) == 16
        for chunks in results.values():
            assert chunks[-1].usage.completion_tokens == 12
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert srv.engine.call(lambda e: e.scheduler.counts()) == {"waiting": 0, "loading": 0, "running": 0}


def test_client_disconnect_frees_its_slots(serve):
    with serve(policy="kvflow", device_tokens=8192) as srv:
        body = {"model": "tiny-random", "messages": [SYSTEM, {"role": "user", "content": "long"}],
                "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
                assert srv.engine.call(lambda e: e.scheduler.counts())["running"] == 1
        # the server noticed, aborted the request and gave its pages back
        wait_until(lambda: srv.engine.stats()["counters"]["aborted"] == 1, timeout=15)
        rep = srv.cache()
        assert rep["queue"]["running"] == 0
        dev = rep["pools"]["device"]
        assert dev["used_tokens"] == dev["tree_tokens"]  # nothing held outside the radix tree
        assert dev["used_tokens"] < 4000


def test_metrics_endpoint(serve):
    with serve(policy="kvflow") as srv:
        c = srv.client()
        for i in range(2):
            c.chat.completions.create(model="tiny-random", messages=[SYSTEM, {"role": "user", "content": f"q{i}"}],
                                      max_tokens=2, extra_body={"custom_params": {"kvflow_v": 99}})
        wait_until(lambda: srv.engine.stats()["counters"]["finished"] == 2)
        text = httpx.get(srv.url + "/metrics").text
        for needle in ['kvflow_prompt_tokens_by_tier_total{tier="device"}', 'kvflow_prefetch_total{outcome="wasted"}',
                       'kvflow_load_seconds_total{kind="hidden"}', 'kvflow_queue_depth{state="loading"}',
                       'kvflow_hints_total{result="rejected"} 2.0', "kvflow_evictions_total",
                       'kvflow_pool_pages{kind="reserved",tier="device"} 0.0', "kvflow_retractions_total 0.0"]:
            assert needle in text, needle
        dev = [line for line in text.splitlines() if line.startswith('kvflow_prompt_tokens_by_tier_total{tier="device"}')]
        assert float(dev[0].split()[-1]) > 0


def test_model_forward_time_is_reported_beside_the_steps(serve):
    """The engine's own counters (what the benches pair trials by: model seconds per decode
    step) over HTTP, in ``/kvflow/v1/cache`` and ``/metrics``, agreeing with each other."""
    with serve(policy="kvflow") as srv:
        before = srv.cache()["engine"]
        srv.client().chat.completions.create(
            model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "q"}], max_tokens=6,
            extra_body={"ignore_eos": True})
        wait_until(lambda: srv.engine.stats()["counters"]["finished"] == 1)
        eng = srv.cache()["engine"]
        assert eng["decode_steps"] - before["decode_steps"] == 5   # the first token is prefill's
        assert eng["steps"] >= eng["decode_steps"]
        assert eng["prefill_forward_s"] > before["prefill_forward_s"]
        assert eng["decode_forward_s"] > before["decode_forward_s"]
        wait_until(lambda: srv.engine.stats()["counters"]["decode_steps"] == eng["decode_steps"])
        srv.engine.call(lambda e: e._publish(force=True))
        prom = {line.rsplit(" ", 1)[0]: float(line.split()[-1])
                for line in httpx.get(srv.url + "/metrics").text.splitlines()
                if line.startswith(("kvflow_engine_steps_total", "kvflow_model_forward_seconds_total"))}
        assert prom['kvflow_engine_steps_total{kind="decode"}'] == eng["decode_steps"]
        assert prom['kvflow_model_forward_seconds_total{phase="decode"}'] == pytest.approx(eng["decode_forward_s"])
        assert prom['kvflow_model_forward_seconds_total{phase="prefill"}'] == pytest.approx(eng["prefill_forward_s"])


def test_engine_busy_time_and_cpu_are_reported(serve):
    """Where an engine's time goes beside its forwards (what `kvflow bench` prints per call):
    ``busy_s`` holds every step that did something, forwards included, and stops while the
    engine idles; the engine thread's CPU and its process's grow with the work; the HTTP
    process's CPU rides along; ``/metrics`` shows the same counters."""
    with serve(policy="kvflow") as srv:
        before = srv.cache()
        srv.client().chat.completions.create(
            model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "q"}], max_tokens=8,
            extra_body={"ignore_eos": True})
        wait_until(lambda: srv.engine.stats()["counters"]["finished"] == 1)
        after = srv.cache()
        d = {k: after["engine"][k] - before["engine"][k] for k in after["engine"]}
        forwards = d["prefill_forward_s"] + d["decode_forward_s"]
        assert forwards > 0 and d["busy_s"] >= forwards + d["copy_s"]
        assert d["thread_cpu_s"] > 0 and after["engine"]["process_cpu_s"] >= after["engine"]["thread_cpu_s"]
        # one process here (the engine on a thread): the HTTP side reads the same process's CPU
        assert after["http"]["process_cpu_s"] >= after["engine"]["process_cpu_s"]
        time.sleep(0.3)  # idle: no step does anything, so none counts as busy
        assert srv.cache()["engine"]["busy_s"] == after["engine"]["busy_s"]
        srv.engine.call(lambda e: e._publish(force=True))
        prom = {line.rsplit(" ", 1)[0]: float(line.split()[-1])
                for line in httpx.get(srv.url + "/metrics").text.splitlines()
                if line.startswith(("kvflow_engine_busy_seconds_total", "kvflow_engine_cpu_seconds_total",
                                    "process_cpu_seconds_total"))}
        assert prom["kvflow_engine_busy_seconds_total"] == pytest.approx(after["engine"]["busy_s"])
        assert prom['kvflow_engine_cpu_seconds_total{scope="thread"}'] >= after["engine"]["thread_cpu_s"]
        assert prom['kvflow_engine_cpu_seconds_total{scope="process"}'] >= after["engine"]["process_cpu_s"]
        assert prom["process_cpu_seconds_total"] > 0


def test_kv_copy_time_is_reported_beside_the_forwards(serve):
    """A device pool too small for two prompts makes hicache back one up and load it again:
    the copies' pages and seconds reach ``/kvflow/v1/cache`` (``engine.copy_s``, what the
    benches set beside the forwards) and ``/metrics``, agreeing with the pool's own count."""
    prompts = [{"role": "system", "content": f"Agent {name}: " + "check every figure twice. " * 24}
               for name in ("alpha", "beta")]
    with serve(policy="hicache", device_tokens=1024, host_tokens=4096) as srv:
        assert srv.cache()["engine"]["copy_s"] == 0
        for system in (prompts[0], prompts[1], prompts[0]):
            srv.client().chat.completions.create(
                model="tiny-random", messages=[system, {"role": "user", "content": "q"}], max_tokens=2)
        stats = srv.engine.call(lambda e: dict(e.pool.stats))
        assert stats["backup_pages"] > 0 and stats["load_pages"] > 0
        assert srv.cache()["engine"]["copy_s"] == pytest.approx(stats["load_s"] + stats["backup_s"])
        assert srv.cache()["engine"]["copy_s"] > 0
        srv.engine.call(lambda e: e._publish(force=True))
        prom = {line.rsplit(" ", 1)[0]: float(line.split()[-1])
                for line in httpx.get(srv.url + "/metrics").text.splitlines()
                if line.startswith(("kvflow_kv_copy_pages_total", "kvflow_kv_copy_seconds_total"))}
        assert prom['kvflow_kv_copy_pages_total{direction="load"}'] == stats["load_pages"]
        assert prom['kvflow_kv_copy_pages_total{direction="backup"}'] == stats["backup_pages"]
        assert prom['kvflow_kv_copy_seconds_total{direction="load"}'] == pytest.approx(stats["load_s"])


def test_request_json_roundtrip_raw_http(serve):
    """A plain HTTP client (no SDK) gets an SSE stream ending in [DONE]."""
    with serve(policy="hicache") as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            r = h.post("/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 3, "stream": True,
                                                "ignore_eos": True})
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
