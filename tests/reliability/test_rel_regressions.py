"""Every reproducer of issue #17, as a regression test against a real server on 127.0.0.1.

1 one bad request fails its neighbours; 2 a malformed hint drops the connection; 3 a poisoned id
breaks shared endpoints, lone surrogates and deep JSON are 500s; 4 no size limits, tokenizing
blocks the server; 5 unbounded hint state (``test_rel_hints.py``); 6 one client empties another's
cache (``test_rel_tenancy.py``); 7 no tenant isolation (``test_rel_tenancy.py``); 8 lenient
parsing; 9 batch variance (``test_rel_deterministic.py``). Slow clients: header / body timeouts.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kvflow_agents.serving.embedded.limits import ServerLimits

MODEL = "tiny-random"


def chat(content="hi", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **extra}


def hints(**kv):
    return {"kvflow_v": 1, "kvflow_workflow": "w", "kvflow_agent": "a", "kvflow_ste": {"a": 0}, **kv}


def raw_post(url: str, path: str, body: bytes, headers=None, timeout=30):
    with httpx.Client(base_url=url, timeout=timeout) as h:
        return h.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})


# ------------------------------------------------------------------------------------------ 1
def test_seed_overflow_fails_alone_not_its_batch(rserve):
    with rserve() as srv:
        results = {}

        def go(i, body):
            with httpx.Client(base_url=srv.url, timeout=60) as h:
                results[i] = h.post("/v1/chat/completions", json=body)
        bodies = [chat(f"req {i}", max_tokens=16, ignore_eos=True) for i in range(4)]
        bodies.append(chat("poison", seed=18446744073709551616))
        ts = [threading.Thread(target=go, args=(i, b)) for i, b in enumerate(bodies)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert [results[i].status_code for i in range(4)] == [200] * 4
        bad = results[4]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
        assert srv.engine.counters["errors"] == 0  # refused before admission, not failed in a step


def test_prefill_fault_fails_only_its_request(rserve):
    """A fault injected into the model's prefill for one request fails that request (500 with
    the cause); the requests batched with it finish normally."""
    with rserve(max_batch=8) as srv:
        model = srv.engine.model
        real = model.prefill
        POISON = ord("~")  # byte-level tokenizer: '~' is token 126

        def prefill(kv, tokens, *a, **kw):
            if POISON in list(tokens):
                raise RuntimeError("injected prefill fault")
            return real(kv, tokens, *a, **kw)
        model.prefill = prefill
        try:
            results = {}

            def go(i, body):
                with httpx.Client(base_url=srv.url, timeout=60) as h:
                    results[i] = h.post("/v1/chat/completions", json=body)
            jobs = [(i, chat(f"good {i}", max_tokens=24, ignore_eos=True)) for i in range(5)]
            jobs.append((5, chat("bad ~ prompt", max_tokens=8)))
            ts = [threading.Thread(target=go, args=j) for j in jobs]
            [t.start() for t in ts]
            [t.join() for t in ts]
            assert all(results[i].status_code == 200 for i in range(5)), [results[i].text for i in range(5)]
            assert all(results[i].json()["usage"]["completion_tokens"] == 24 for i in range(5))
            assert results[5].status_code == 500
            assert "prefill failed for this request" in results[5].json()["error"]["message"]
            assert srv.engine.alive and srv.engine.counters["step_failures"] == 0
        finally:
            model.prefill = real


def test_decode_fault_is_attributed_to_its_sequence(rserve, tiny):
    """A batched decode that raises is retried one sequence at a time: only the culprit fails."""
    from kvflow_agents.serving.embedded.engine import Engine

    with Engine(loaded=tiny, model=MODEL, policy="lru", device_tokens=4096, max_batch=8) as eng:
        real = eng.model.decode_batch
        victim_pos = {}

        def decode(kv, seqs, **kw):
            for _, pages, pos in seqs:
                if victim_pos.get("pages") is pages and pos >= victim_pos["at"]:
                    raise RuntimeError("injected decode fault")
            return real(kv, seqs, **kw)
        eng.model.decode_batch = decode
        done, reqs = {}, []
        ev = threading.Event()

        def sink_for(i):
            def sink(e):
                if e.done is not None:
                    done[i] = e.done
                    if len(done) == 4:
                        ev.set()
            return sink
        for i in range(4):
            r = eng.make_request(prompt=f"sequence number {i} " * 3, max_tokens=20,
                                 params=None, sink=sink_for(i))
            r.params.ignore_eos = True
            reqs.append(r)
        victim_pos["pages"], victim_pos["at"] = None, len(reqs[2].prompt_ids) + 3

        def arm():  # the victim's page list exists once it is admitted
            while reqs[2].pages == [] and not ev.is_set():
                time.sleep(0.001)
            victim_pos["pages"] = reqs[2].pages
        t = threading.Thread(target=arm)
        t.start()
        for r in reqs:
            eng.submit(r)
        assert ev.wait(60)
        t.join()
        eng.model.decode_batch = real
        assert done[2].finish_reason == "error" and "decode failed" in done[2].error
        assert [done[i].finish_reason for i in (0, 1, 3)] == ["length"] * 3
        assert all(done[i].completion_tokens == 20 for i in (0, 1, 3))
        assert eng.alive


# ------------------------------------------------------------------------------------------ 2
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_hint_never_drops_the_connection(rserve, stream):
    with rserve() as srv, srv.http() as h:
        for bad in [{"kvflow_v": " " * 300}, {"kvflow_v": 1, "kvflow_workflow": "x" * 5000},
                    {"kvflow_v": "é\u2028" * 100}, {"kvflow_v": 1, "kvflow_workflow": "w\ud800",
                                                    "kvflow_agent": "a"}]:
            body = json.dumps(chat(stream=stream, custom_params=bad)).encode()
            r = h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            v = r.headers["x-kvflow-hints"]
            assert v.startswith("rejected: ") and v == v.strip() and v.isascii() and len(v) <= 512
        r = h.post("/kvflow/v1/hints", json={"kvflow_v": " " * 300})
        assert r.status_code == 400 and r.headers["x-kvflow-hints"].startswith("rejected: ")
        assert r.json()["error"]["param"] == "kvflow_v"


# ------------------------------------------------------------------------------------------ 3
def test_poisoned_ids_never_break_shared_endpoints(rserve):
    with rserve() as srv, srv.http() as h:
        poison = json.dumps(chat(custom_params=hints(kvflow_workflow="w\ud800"))).encode()  # ascii escapes
        r = h.post("/v1/chat/completions", content=poison, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.headers["x-kvflow-hints"].startswith("rejected: ")
        r = h.post("/kvflow/v1/hints", content=json.dumps(hints(kvflow_agent="\udc00x")).encode(),
                   headers={"content-type": "application/json"})
        assert r.status_code == 400
        for body in (hints(kvflow_ste={"a\ud800": 1}), hints(kvflow_next=["\ud800"])):
            r = h.post("/kvflow/v1/hints", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, body
        # a good hint still lands, and the shared endpoints answer for everyone
        assert h.post("/kvflow/v1/hints", json=hints(kvflow_workflow="fine")).status_code == 200
        assert h.get("/kvflow/v1/cache").status_code == 200
        t = h.get("/kvflow/v1/cache", params={"format": "text"})
        assert t.status_code == 200 and "policy kvflow" in t.text
        assert h.get("/metrics").status_code == 200


def test_lone_surrogate_and_deep_json_are_400(rserve):
    with rserve() as srv:
        r = raw_post(srv.url, "/v1/completions", b'{"model": "tiny-random", "prompt": "a\\ud800b"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = raw_post(srv.url, "/v1/chat/completions",
                     json.dumps(chat("x\udfff")).encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
        for depth in (100, 1000, 100_000):
            deep = b'{"model": "tiny-random", "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
            r = raw_post(srv.url, "/v1/completions", deep)
            assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"], depth
        r = raw_post(srv.url, "/v1/completions", b'{"model": "tiny-random", "prompt": "\xff"}')
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
        with srv.http() as h:  # and the server is fine
            assert h.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------ 4
def test_body_and_prompt_size_limits(rserve):
    with rserve(limits=ServerLimits(max_body_bytes=64 * 1024), device_tokens=2048) as srv:
        with srv.http() as h:
            big = json.dumps(chat("x" * 100_000)).encode()
            r = h.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

            def chunks():  # no Content-Length: counted as it arrives
                for _ in range(100):
                    yield b" " * 1024
            r = h.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            # under the body limit, over what a prompt may hold: refused from its length alone
            r = h.post("/v1/chat/completions", json=chat("y" * 40_000))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "characters" in r.json()["error"]["message"]
            assert h.get("/health").status_code == 200
            assert h.post("/v1/chat/completions", json=chat("small")).status_code == 200


def test_prompt_probe_refuses_before_tokenizing_everything(tiny):
    """A prompt far over the token limit is refused after tokenizing a bounded prefix."""
    from kvflow_agents.serving.embedded.engine import Engine, EngineInputError

    with Engine(loaded=tiny, model=MODEL, policy="lru", device_tokens=2048, start=False) as eng:
        calls = []
        tok = eng.tokenizer  # shared by the session: patch this instance only, and undo
        tok.encode = lambda text, real=type(tok).encode: calls.append(len(text)) or real(tok, text)
        try:
            text = "word " * 3000  # 15k chars: under max_prompt_chars (13 x 2047), over the limit
            assert 4 * eng.max_prompt_tokens + 16 < len(text) <= eng.max_prompt_chars
            with pytest.raises(EngineInputError) as ei:
                eng.make_request(prompt=text)
        finally:
            del tok.encode
        assert ei.value.code == "context_length_exceeded"
        assert calls and max(calls) <= 4 * eng.max_prompt_tokens + 16


# ------------------------------------------------------------------------------------------ 8
@pytest.mark.parametrize("body,param", [
    (chat(temperature="0"), "temperature"), (chat(stream="yes"), "stream"),
    (chat(max_tokens=1.5), "max_tokens"), (chat(max_tokens=True), "max_tokens"),
    (chat(seed="1"), "seed"), (chat(stop=5), "stop"), (chat(n="1"), "n"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "r"}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
])
def test_strict_openai_parsing(rserve_shared, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = rserve_shared.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_bom_and_lenient_extras(rserve_shared):
    h = rserve_shared
    r = h.post("/v1/chat/completions", json={**chat(), "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = h.post("/v1/chat/completions", content=b"\xef\xbb\xbf" + json.dumps(chat()).encode(),
               headers={"content-type": "application/json"})
    assert r.status_code == 400 and "byte order mark" in r.json()["error"]["message"]
    # lenient where OpenAI is: unknown keys, tool messages with ids, assistant tool calls
    ok = {**chat(), "some_future_field": {"x": [1]}, "user": "u1", "metadata": {"k": "v"},
          "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                       {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "42"},
                       {"role": "user", "content": [{"type": "text", "text": "and?"}]}]}
    r = h.post("/v1/chat/completions", json=ok)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def rserve_shared(tiny):
    """One server for the table-driven parsing tests (module scope: started once)."""
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.server import create_app
    from serving_helpers import RunningServer

    eng = Engine(loaded=tiny, model=MODEL, policy="lru", device_tokens=2048)
    srv = RunningServer(eng, create_app(eng)).start()
    try:
        with srv.http() as h:
            yield h
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------ slow
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_slow_clients_are_cut_off_and_others_are_served(rserve, http):
    """Under either HTTP protocol ``kvflow serve --http`` offers: a head that never completes,
    a body that never completes and an idle socket are closed (the body with a 408), and a
    normal request beside them is served."""
    with rserve(limits=ServerLimits(timeout_headers_s=0.5, timeout_read_s=0.5), http=http) as srv:
        slow_head = socket.create_connection(("127.0.0.1", srv.port))
        slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes
        slow_body = socket.create_connection(("127.0.0.1", srv.port))
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        idle = socket.create_connection(("127.0.0.1", srv.port))  # opens, sends nothing
        with srv.http() as h:
            assert h.post("/v1/chat/completions", json=chat()).status_code == 200
        for s in (slow_head, slow_body, idle):
            s.settimeout(5)
        assert b"408" in slow_body.recv(4096).split(b"\r\n")[0]
        for s in (slow_head, idle):  # closed by the server: recv returns b"" (EOF)
            assert s.recv(4096) == b""
        for s in (slow_head, slow_body, idle):
            s.close()


def test_long_texts_are_tokenized_in_a_helper_process():
    """Long prompts are encoded in a spawned process (the server's GIL is never held by it),
    with the same ids as in-process encoding."""
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.byte_level()
    text = "héllo <|im_start|> wörld " * 50
    local = tok.encode(text)
    tok.offload_long_texts(min_chars=100)
    try:
        assert tok.encode(text) == local
        assert tok._offload.pool is not None  # the helper ran it
        assert tok.encode("short") == [ord(c) for c in "short"]
    finally:
        tok.close()
