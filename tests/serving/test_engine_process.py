"""``kvflow serve --engine-process``: the engine in a spawned process (``engine_core.py``) behind
the same HTTP server, driven by the real ``openai`` client over 127.0.0.1.

What must hold: the same tokens as the engine in this process; hints, the cache view, metrics,
flush and client disconnects reach the engine process; an engine process that dies fails the
requests in flight (no client waits for ever), turns /health to 503, and the server answers
every later request with an error instead of hanging or dying."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from serving_helpers import AGENTS, RunningServer, agent_call, residency, system_prompt

from kvflow_agents.serving.embedded.engine_core import EngineCoreClient, EngineProcessGone
from kvflow_agents.serving.embedded.server import create_app

ENGINE_KW = dict(model="tiny-random", policy="kvflow", device_tokens=4096, host_tokens=16384,
                 torch_threads=1)


@pytest.fixture(scope="module")
def core_srv():
    eng = EngineCoreClient(**ENGINE_KW)
    srv = RunningServer(eng, create_app(eng)).start()
    yield srv
    srv.stop()


def _messages(k: int) -> list:
    return [{"role": "system", "content": system_prompt("A")}, {"role": "user", "content": f"question {k}"}]


def test_greedy_tokens_are_those_of_the_engine_in_this_process(core_srv, tiny_model):
    from kvflow_agents.serving.embedded.engine import Engine

    with Engine(loaded=tiny_model, **ENGINE_KW) as local:
        want = [local.chat(_messages(k), max_tokens=12, temperature=0, ignore_eos=True) for k in range(3)]
    client = core_srv.client()
    for k, w in enumerate(want):
        got = client.chat.completions.create(model="tiny-random", messages=_messages(k), max_tokens=12,
                                             temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == w.text
        assert got.usage.completion_tokens == w.completion_tokens == 12
        streamed = client.chat.completions.create(model="tiny-random", messages=_messages(k), max_tokens=12,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == w.text
    # the blocking API goes through the same pipe
    assert core_srv.engine.chat(_messages(0), max_tokens=12, temperature=0, ignore_eos=True).text == want[0].text


def test_hints_cache_view_metrics_and_flush_reach_the_engine_process(core_srv):
    client = core_srv.client()
    for step, agent in enumerate(AGENTS):
        raw = agent_call(client, agent, step, workflow="wf-core", raw=True)
        assert raw.headers["x-kvflow-hints"] == "accepted"
    report = core_srv.cache()
    # the last agent ran: its fixed prompt is cached on device; the next one (A) is protected
    assert residency(report, "wf-core", "D") == "device"
    assert {a["agent"] for w in report["workflows"] if w["workflow"] == "wf-core" for a in w["agents"]} >= set(AGENTS)
    with core_srv.http() as h:
        bad = h.post("/v1/chat/completions", json={
            "model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
            "custom_params": {"kvflow_v": 1, "kvflow_workflow": 7}})
        assert bad.status_code == 200 and bad.headers["x-kvflow-hints"].startswith("rejected")
        deadline = time.monotonic() + 10  # the engine publishes its snapshot every 50 ms at most
        while True:
            text = h.get("/metrics").text
            if 'kvflow_hints_total{result="rejected"} 1.0' in text and "kvflow_requests_total" in text:
                break
            assert time.monotonic() < deadline, text[:2000]
            time.sleep(0.1)
        assert 'kvflow_hints_total{result="accepted"} 4.0' in text
        ok = h.post("/flush_cache")
        assert ok.status_code == 200, ok.text
    assert residency(core_srv.cache(), "wf-core", "D") == "none"
    with pytest.raises(Exception, match="pickle"):  # a lambda cannot travel: a clear error
        core_srv.engine.call(lambda e: 1)


def test_the_engine_process_and_the_http_process_report_their_own_cpu(core_srv):
    """``/kvflow/v1/cache``'s ``engine.process_cpu_s`` is the engine's process's, ``http``'s this
    one's: CPU burnt here (the server runs in this test's process) moves only the latter, and
    a request moves the engine's."""
    first = core_srv.cache()
    t_end = time.thread_time() + 0.3
    while time.thread_time() < t_end:  # 0.3 s of CPU in this (the HTTP) process
        pass
    second = core_srv.cache()
    assert second["http"]["process_cpu_s"] - first["http"]["process_cpu_s"] >= 0.3
    assert second["engine"]["process_cpu_s"] - first["engine"]["process_cpu_s"] < 0.15
    core_srv.client().chat.completions.create(model="tiny-random", messages=_messages(0), max_tokens=8)
    third = core_srv.cache()
    assert third["engine"]["thread_cpu_s"] > second["engine"]["thread_cpu_s"]
    assert third["engine"]["busy_s"] > second["engine"]["busy_s"]
    assert third["engine"]["process_cpu_s"] >= third["engine"]["thread_cpu_s"]


def test_a_client_that_goes_away_mid_stream_aborts_its_request_in_the_engine(core_srv):
    before = core_srv.engine.stats()["counters"]["aborted"]
    with httpx.Client(base_url=core_srv.url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json={
                "model": "tiny-random", "max_tokens": 3000, "stream": True, "messages": _messages(9),
                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 3  # then hang up
    deadline = time.monotonic() + 20
    while core_srv.engine.stats()["counters"]["aborted"] == before:
        assert time.monotonic() < deadline, "the abort did not reach the engine process"
        time.sleep(0.05)
    rep = core_srv.cache()
    assert rep["queue"]["running"] == 0
    dev = rep["pools"]["device"]
    assert dev["used_tokens"] == dev["tree_tokens"] < 3000  # its pages went back


def test_an_engine_process_that_dies_fails_what_is_in_flight_and_the_server_stays_up():
    eng = EngineCoreClient(**ENGINE_KW)
    srv = RunningServer(eng, create_app(eng)).start()
    try:
        client = srv.client()
        assert client.chat.completions.create(model="tiny-random", messages=_messages(1),
                                              max_tokens=2).choices[0].finish_reason
        got: dict = {}

        def long_stream() -> None:
            try:
                s = client.chat.completions.create(model="tiny-random", messages=_messages(2), max_tokens=3000,
                                                   stream=True, extra_body={"ignore_eos": True})
                got["chunks"] = sum(1 for _ in s)
            except Exception as e:  # noqa: BLE001 - what the client saw
                got["error"] = e
        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.monotonic() + 20
        while eng.stats().get("queue", {}).get("running", 0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(eng._proc.pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream did not end when its engine died"
        assert "engine process exited" in str(got.get("error")), got  # an error event ended it
        with srv.http() as h:
            assert h.get("/health").status_code == 503
            r = h.post("/v1/chat/completions", json={"model": "tiny-random", "max_tokens": 2,
                                                     "messages": _messages(3)})
            assert r.status_code == 500 and "engine process" in r.json()["error"]["message"]
            assert h.get("/kvflow/v1/cache").status_code == 500  # a call fails, it does not hang
        with pytest.raises(EngineProcessGone):
            eng.call(_engine_steps)
    finally:
        srv.stop()


def _engine_steps(engine) -> int:
    return engine.counters["steps"]


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="could not start.*(CUDA|cuda)"):
        EngineCoreClient(**{**ENGINE_KW, "device": "cuda"})


def test_kvflow_serve_runs_its_engine_in_a_process_of_its_own_by_default():
    from kvflow_agents.serve_process import ServeProcess, process_tree

    with ServeProcess(["--model", "tiny-random", "--policy", "kvflow", "--device-tokens", "2048",
                       "--torch-threads", "1"], timeout_s=120) as srv:
        assert len(process_tree(srv.proc.pid)) >= 2  # the server and its engine process
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        out = client.chat.completions.create(model="tiny-random", messages=_messages(4), max_tokens=5,
                                             extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        log = srv.log_path.read_text()
    assert "(engine process)" in log
