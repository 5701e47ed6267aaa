"""Start, wait for and stop one ``kvflow serve`` subprocess (the same logic as the PEER example's
``EmbeddedServer``, kept here so the installed package does not import ``examples``).

The server runs as ``<this python> -m kvflow_agents.cli.main serve …`` in its own session, with
its output in a temporary log file (never a pipe). :meth:`BenchServer.start` polls ``/health``;
if the process exits first or the timeout passes it raises :class:`ServerStartError` with the
log's tail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


class ServerStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_args(*, model: str, policy: str, device_tokens: int, host_tokens: int, page_size: int,
               host_link_gbps: Optional[float], lookahead: int, max_batch: int,
               extra: Sequence[str] = ()) -> list[str]:
    """The ``kvflow serve`` flags shared by every policy of one benchmark (only --policy differs)."""
    args = ["--model", model, "--policy", policy, "--device-tokens", str(device_tokens),
            "--host-tokens", str(host_tokens), "--page-size", str(page_size),
            "--lookahead", str(lookahead), "--max-batch", str(max_batch), "--log-level", "warning"]
    if host_link_gbps:
        args += ["--host-link-gbps", f"{host_link_gbps:.6g}"]
    return args + list(extra)


class BenchServer:
    def __init__(self, args: Sequence[str], *, host: str = "127.0.0.1", timeout_s: float = 300.0,
                 env: Optional[dict[str, str]] = None) -> None:
        self.args = list(args)
        self.env = dict(env or {})  # extra environment (e.g. KVFLOW_INSTANCE_ID)
        self.host = host
        self.port = free_port(host)
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.log_path: Optional[Path] = None
        self._log = None
        self.started_s = 0.0

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "kvflow_agents.cli.main", "serve", *self.args,
                "--host", self.host, "--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return "(not started)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> "BenchServer":
        import httpx

        fd, name = tempfile.mkstemp(prefix="kvflow-bench-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        deadline = time.monotonic() + self.timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while True:
                code = self.proc.poll()
                if code is not None:
                    tail = self.log_tail()
                    self.stop(keep_log=True)
                    raise ServerStartError(f"`{' '.join(self.argv)}` exited with code {code}:\n{tail}")
                try:
                    if c.get(self.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop(keep_log=True)
                    raise ServerStartError(f"`{' '.join(self.argv)}` not healthy after "
                                           f"{self.timeout_s:.0f}s:\n{tail}")
                time.sleep(0.2)
        self.started_s = time.perf_counter() - t0
        return self

    def stop(self, keep_log: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        if not keep_log and self.log_path is not None:
            try:
                self.log_path.unlink()
            except OSError:
                pass

    def __enter__(self) -> "BenchServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
