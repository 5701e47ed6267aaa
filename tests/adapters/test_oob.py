"""Out-of-band hints: best effort, never blocking, to ``{server}/kvflow/v1/hints``."""

from __future__ import annotations

import socket
import time

import pytest

from kvflow_agents import oob
from kvflow_agents.protocol import Hints

H = Hints(workflow="w", agent="tools", step=3, ste={"tools": 0, "writer": 1, "old": float("inf")},
          next=["writer"], app="demo")


@pytest.mark.parametrize("url,root", [
    ("http://h:1/v1", "http://h:1"),
    ("http://h:1/v1/", "http://h:1"),
    ("http://h:1/v1/chat/completions", "http://h:1"),
    ("http://h:1/openai/v1/completions?x=1", "http://h:1/openai"),
    ("http://h:1", "http://h:1"),
    ("http://h:1/kvflow/v1/hints", "http://h:1"),
])
def test_server_root(url, root):
    assert oob.server_root(url) == root


def test_reporter_posts_flat_custom_params_with_event(recording_server):
    rep = oob.HintReporter(recording_server.base_url)
    assert rep.url() == recording_server.url + "/kvflow/v1/hints"
    assert rep.report(H, event="transition")
    assert rep.report(H.model_copy(update={"agent": "__end__"}), event="end")
    assert oob.flush(5)
    posts = recording_server.hint_posts()
    assert [p.body["kvflow_event"] for p in posts] == ["transition", "end"]
    assert posts[0].body == {**H.to_custom_params(), "kvflow_event": "transition"}
    assert posts[0].body["kvflow_ste"] == {"tools": 0, "writer": 1, "old": None}


def test_reporter_follows_the_server_the_app_talks_to(recording_server):
    rep = oob.HintReporter()
    oob.note_server(H, recording_server.base_url + "/chat/completions")
    assert rep.url("demo") == recording_server.url + "/kvflow/v1/hints"
    assert rep.report(H)
    assert oob.flush(5)
    assert len(recording_server.hint_posts()) == 1


def test_unknown_server_drops_quietly():
    rep = oob.HintReporter()
    saved = dict(oob._servers)
    oob._servers.clear()
    try:
        assert rep.report(H) is False
    finally:
        oob._servers.update(saved)


def test_unreachable_server_never_blocks_or_raises():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    rep = oob.HintReporter(f"http://127.0.0.1:{port}/v1")
    t0 = time.perf_counter()
    for _ in range(20):
        rep.report(H)
    assert time.perf_counter() - t0 < 0.1
    assert oob.flush(10)


def test_a_full_queue_drops_instead_of_blocking(monkeypatch, recording_server):
    poster = oob._Poster()
    monkeypatch.setattr(poster, "queue", oob.queue.Queue(2))
    monkeypatch.setattr(poster, "_thread", type("T", (), {"is_alive": lambda self: True})())
    assert poster.submit("http://x", b"{}") and poster.submit("http://x", b"{}")
    assert poster.submit("http://x", b"{}") is False and poster.dropped == 1


def test_hint_posts_reuse_the_apps_api_key(recording_server):
    """A server started with --api-key requires it on /kvflow/v1/hints too: the reporter sends
    the Authorization header the app's own LLM requests carry to that server."""
    import openai

    import kvflow_agents as kvflow

    client = openai.OpenAI(base_url=recording_server.base_url, api_key="sk-secret", max_retries=0,
                           http_client=kvflow.http_client())
    with kvflow.hints(H):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert oob.HintReporter().report(H)
    assert oob.flush(5)
    (post,) = recording_server.hint_posts()
    assert post.headers["authorization"] == "Bearer sk-secret"


def test_a_connection_closed_before_the_answer_is_posted_again():
    """A server that drops the connection without answering (what a keep-alive connection a
    gateway closed after its 404 looks like) gets the event once more, on a new connection."""
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    seen = []

    def serve():
        for i in range(2):
            conn, _ = srv.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                seen.append(data.split(b"\r\n", 1)[0])
                if i == 1:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sent, failed = oob._poster.sent, oob._poster.failed
    try:
        assert oob.HintReporter(f"http://127.0.0.1:{port}/v1").report(H, event="end")
        assert oob.flush(10)
        t.join(5)
    finally:
        srv.close()
    assert seen == [b"POST /kvflow/v1/hints HTTP/1.1"] * 2
    assert (oob._poster.sent - sent, oob._poster.failed - failed) == (1, 0)
