"""Fixtures for the real-server tests (run from the main venv, server in .venv-sglang).

The client side (the ``openai`` client, LangGraph + ``kvflow.instrument``, httpx) runs in this
project's venv, as a user's app would; each SGLang server runs as a subprocess of
``$KVFLOW_SGLANG_PYTHON`` (``make test-sglang`` sets it to ``.venv-sglang/bin/python``).
Without that variable this folder is not collected: ``make test-main`` leaves it to
``make test-sglang``.
"""

from __future__ import annotations

import os

import pytest

if not os.environ.get("KVFLOW_SGLANG_PYTHON"):
    collect_ignore_glob = ["*.py"]
else:
    from sglang_harness import Client, ServerPool, build_model, launch  # noqa: E402

    @pytest.fixture(scope="session")
    def model_dir(tmp_path_factory):
        return str(build_model(tmp_path_factory.mktemp("sglang-model") / "tiny-llama"))

    @pytest.fixture(scope="session")
    def pool(model_dir):
        p = ServerPool(launch(model_dir, os.environ["KVFLOW_SGLANG_PYTHON"]))
        try:
            yield p
        finally:
            p.close()

    @pytest.fixture(scope="session")
    def main_servers(pool):
        """``stock`` and ``kvflow``, started together (once per session)."""
        pool.start("stock", "kvflow")
        return pool

    def _client(pool, name, model_dir, request):
        """A client of ``pool``'s server ``name``; a failing test gets the pool's log tails."""
        c = Client(pool.get(name), model_dir)
        request.node.kvflow_pool = pool
        return c

    @pytest.fixture
    def stock(main_servers, model_dir, request):
        c = _client(main_servers, "stock", model_dir, request)
        yield c
        c.close()

    @pytest.fixture
    def kvflow(main_servers, model_dir, request):
        c = _client(main_servers, "kvflow", model_dir, request)
        yield c
        c.close()

    @pytest.fixture
    def retract(pool, model_dir, request):
        c = _client(pool, "retract", model_dir, request)
        yield c
        c.close()

    @pytest.fixture
    def serial_pair(pool, model_dir, request):
        """``serial`` and ``serial-fcfs`` (started together): one running request at a time."""
        pool.start("serial", "serial-fcfs")
        cs = {n: _client(pool, n, model_dir, request) for n in ("serial", "serial-fcfs")}
        yield cs
        for c in cs.values():
            c.close()

    @pytest.fixture(scope="session")
    def tokenizer(model_dir):
        from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

        return ChatTokenizer.from_dir(model_dir)

    def pytest_collection_modifyitems(items):
        # A test that starts a server pays its 35-120 s start-up (this box is shared).
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(900))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        """A failing test gets the servers' log tails in its report."""
        outcome = yield
        rep = outcome.get_result()
        pool = getattr(item, "kvflow_pool", None)
        if rep.when == "call" and rep.failed and pool is not None:
            rep.sections.append(("sglang server logs", pool.log_tails()))
