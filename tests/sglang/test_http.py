"""The out-of-band endpoints on SGLang's own FastAPI app, end to end over real sockets:

HTTP (SGLang's ``http_server.app`` with the plugin's routes, installed by the BEFORE hook on
``launch_server``) -> the tokenizer manager's scheduler socket (zmq, SGLang's ``sock_send``)
-> a scheduler loop (SGLang's ``sock_recv`` + the plugin's ``process_input_requests`` hook)
-> KVFlowRadixCache; and the snapshot back. No model is loaded (CPU).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
import zmq  # noqa: E402
from sglang.srt.managers.io_struct import sock_recv  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

from kvflow_agents.serving.sglang import hooks, http_api  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402


@pytest.fixture
def served(monkeypatch):
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints import http_server

    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        cache, _, _ = fx.build_fixture(CacheConfig(page_size=4, eviction_policy="kvflow"))
    ctx = zmq.Context.instance()
    to_sched = ctx.socket(zmq.PUSH)   # the tokenizer manager's send_to_scheduler
    port = to_sched.bind_to_random_port("tcp://127.0.0.1")
    sched_in = ctx.socket(zmq.PULL)   # the scheduler's recv_from_tokenizer
    sched_in.connect(f"tcp://127.0.0.1:{port}")
    scheduler = SimpleNamespace(tree_cache=cache, tp_rank=0, passed=[])
    stop = threading.Event()

    def loop():  # one scheduler: receive, run the plugin's hook, pass the rest on
        while not stop.is_set():
            if sched_in.poll(50):
                reqs = [sock_recv(sched_in)]
                hooks.around_process_input_requests(
                    lambda s, r: s.passed.extend(r), scheduler, reqs)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    monkeypatch.setattr(http_server, "get_global_state",
                        lambda: SimpleNamespace(tokenizer_manager=SimpleNamespace(
                            send_to_scheduler=to_sched)))
    monkeypatch.setattr(http_api, "_routes_added", False)
    routes_before = list(http_server.app.router.routes)
    http_api.before_launch_server()   # what the BEFORE hook on launch_server does
    try:
        yield TestClient(http_server.app), cache, scheduler
    finally:
        stop.set()
        t.join(2)
        http_server.app.router.routes[:] = routes_before
        to_sched.close(linger=0)
        sched_in.close(linger=0)


def test_oob_hints_reach_the_scheduler_cache_and_snapshot_comes_back(served):
    import time

    client, cache, scheduler = served
    r = client.post("/kvflow/v1/hints", json={
        "kvflow_v": 1, "kvflow_workflow": "t1", "kvflow_app": "peer", "kvflow_agent": "tool",
        "kvflow_step": 4, "kvflow_ste": {"planner": 1, "coder": None}, "kvflow_event": "transition"})
    assert r.status_code == 200, r.text
    deadline = time.time() + 5
    while cache.kv_hints.ste("peer/t1", "planner") != 1 and time.time() < deadline:
        time.sleep(0.02)
    assert cache.kv_hints.ste("peer/t1", "planner") == 1
    assert cache.kv_hints.ste("peer/t1", "coder") == float("inf")
    assert scheduler.passed == []     # the control message never reached SGLang's dispatcher
    snap = client.get("/kvflow/v1/cache")
    assert snap.status_code == 200, snap.text
    body = snap.json()
    assert body["engine"] == "sglang" and body["policy"] == "kvflow"
    assert body["workflows"]["peer/t1"]["step"] == 4
    bad = client.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_workflow": "t1"})
    assert bad.status_code == 400 and bad.json()["key"] == "kvflow_agent"
