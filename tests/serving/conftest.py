"""Fixtures for the embedded server tests: a real uvicorn server on 127.0.0.1 (pre-bound socket,
background thread) around an :class:`Engine`, driven by the real ``openai`` client over HTTP."""

from __future__ import annotations

import contextlib

import pytest

from serving_helpers import RunningServer


@pytest.fixture(scope="session")
def tiny_model():
    """tiny-random weights + tokenizer, loaded once and shared by every engine in the session."""
    from kvflow_agents.serving.embedded.model import load_model
    return load_model("tiny-random")


@pytest.fixture
def serve(tiny_model):
    """``with serve(policy="kvflow", device_tokens=..., api_key=None, ...) as srv:``"""
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.server import create_app

    started = []

    @contextlib.contextmanager
    def make(api_key=None, **engine_kw):
        kw = dict(model="tiny-random", policy="kvflow", device_tokens=4096, host_tokens=16384)
        kw.update(engine_kw)
        eng = Engine(loaded=tiny_model, **kw)
        srv = RunningServer(eng, create_app(eng, api_key=api_key))
        if api_key:
            srv._auth = {"Authorization": f"Bearer {api_key}"}
        started.append(srv)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()
            started.remove(srv)

    yield make
    for srv in started:
        srv.stop()
