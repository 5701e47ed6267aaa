"""``ServeProcess`` (the launcher of ``kvflow bench`` and the PEER example) on real ``kvflow
serve`` processes: a port it picked that something else took before the server bound it; a SIGTERM to
the process that started a server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

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


PARENT = """
import sys, time
from kvflow_agents.serve_process import ServeProcess, process_tree
srv = ServeProcess(sys.argv[1:], timeout_s=120).start()
print(*process_tree(srv.proc.pid), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_sigterm_to_the_process_that_started_a_server_stops_the_server_and_its_engine_process():
    """A benchmark stopped with ``kill`` (or a CI timeout) must not leave its servers running:
    they run in sessions of their own, so nothing else would stop them."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *ARGS], stdout=subprocess.PIPE, text=True)
    try:
        tree = [int(p) for p in parent.stdout.readline().split()]
        assert len(tree) >= 2, tree  # the HTTP server and its engine process (the default layout)
        assert all(_alive(p) for p in tree)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in tree if _alive(p)] == []
    finally:
        parent.kill()
        parent.wait(10)
