"""``ServeProcess`` (the launcher of ``kvflow bench`` and the PEER example) on real ``kvflow
serve`` processes: a port it picked that something else took before the server bound it."""

from __future__ import annotations

import socket

import httpx
import pytest

from kvflow_agents import serve_process
from kvflow_agents.serve_process import ServeProcess, ServerStartError

ARGS = ["--model", "tiny-random", "--policy", "lru", "--device-tokens", "1024", "--torch-threads", "1"]


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(taken_port, monkeypatch):
    real = serve_process.free_port
    picks = iter([taken_port])
    monkeypatch.setattr(serve_process, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    with ServeProcess(ARGS, timeout_s=120) as srv:
        assert srv.port != taken_port
        assert httpx.get(srv.url + "/health", trust_env=False).status_code == 200
        log = srv.log_path
    assert log is not None and not log.exists()


def test_a_port_the_caller_chose_is_not_changed(taken_port):
    srv = ServeProcess(ARGS, port=taken_port, timeout_s=120)
    with pytest.raises(ServerStartError, match="address already in use"):
        srv.start()
    assert srv.port == taken_port
    srv.log_path.unlink()
