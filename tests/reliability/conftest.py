"""Fixtures for the reliability and security tests: a real uvicorn server on 127.0.0.1 around an
:class:`Engine` (tiny-random), with the server's limits, tenancy and header-timeout protocol."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serving"))

from serving_helpers import RunningServer  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    from kvflow_agents.serving.embedded.model import load_model
    return load_model("tiny-random")


@pytest.fixture
def rserve(tiny):
    """``with rserve(api_key=..., tenant_header=..., limits=ServerLimits(...), http="auto",
    **engine_kw) as srv`` (``http``: the guarded protocol ``kvflow serve --http`` would pick)"""
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.limits import ServerLimits, guarded_protocol
    from kvflow_agents.serving.embedded.server import create_app

    @contextlib.contextmanager
    def make(api_key=None, tenant_header=None, limits=None, loaded=None, http="auto", **engine_kw):
        kw = dict(model="tiny-random", policy="kvflow", device_tokens=4096, host_tokens=16384)
        kw.update(engine_kw)
        limits = limits or ServerLimits()
        eng = Engine(loaded=loaded or tiny, **kw)
        app = create_app(eng, api_key=api_key, tenant_header=tenant_header, limits=limits)
        srv = RunningServer(eng, app, http=guarded_protocol(limits, http))
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()

    return make
