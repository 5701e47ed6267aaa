"""Start, wait for and stop the embedded kvflow server (``kvflow serve``) for the example.

    with EmbeddedServer(model="smollm2-135m") as srv:
        srv.base_url        # "http://127.0.0.1:<port>/v1"

The server runs as a child process (``python -m kvflow_agents.cli.main serve --model M --host
127.0.0.1 --port P``, with the same interpreter as this script, so a venv's ``kvflow`` is used
even when it is not on ``PATH``). Its stdout/stderr go to a temporary log file, never to a pipe
(a chatty server cannot block on a full pipe). :meth:`start` polls ``GET /health`` until it
answers 200; if the process exits first, or the timeout passes, it stops the process and raises
:class:`ServerStartError` with the tail of the server's log.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx


class ServerStartError(RuntimeError):
    """The embedded server did not become healthy (message includes its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40, max_bytes: int = 64_000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no server log)"
    got = data.splitlines()[-lines:]
    return "\n".join(got) if got else "(server wrote nothing)"


class EmbeddedServer:
    def __init__(self, model: str = "smollm2-135m", *, host: str = "127.0.0.1",
                 port: Optional[int] = None, timeout_s: float = 600.0,
                 extra_args: Sequence[str] = (), command: Optional[Sequence[str]] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.model = model
        self.host = host
        self.port = port or free_port(host)
        self.timeout_s = timeout_s
        self.extra_args = list(extra_args)
        self.command = list(command) if command else [sys.executable, "-m", "kvflow_agents.cli.main", "serve"]
        self.env = env
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._log_file: Optional[Path] = None
        self._log_handle = None
        self.keep_log = False  # set when start fails, so the log can still be read

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def argv(self) -> list[str]:
        return [*self.command, "--model", self.model, "--host", self.host, "--port", str(self.port),
                *self.extra_args]

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self._log_file, lines) if self._log_file else "(server not started)"

    def start(self) -> "EmbeddedServer":
        fd, name = tempfile.mkstemp(prefix="kvflow-serve-", suffix=".log")
        os.close(fd)
        self._log_file = Path(name)
        self._log_handle = self._log_file.open("wb")
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log_handle,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            self._close_log()
            raise ServerStartError(f"could not run {' '.join(self.argv)}: {e}") from e
        atexit.register(self.stop)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        last_err = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    tail = self.log_tail()
                    self.keep_log = True
                    self.stop()
                    raise ServerStartError(
                        f"`{' '.join(self.argv)}` exited with code {code} before it was healthy.\n"
                        f"--- server log (last lines; full log: {self._log_file}) ---\n{tail}")
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code == 200:
                        return
                    last_err = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last_err = type(e).__name__
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.keep_log = True
                    self.stop()
                    raise ServerStartError(
                        f"`{' '.join(self.argv)}` was not healthy after {self.timeout_s:.0f}s "
                        f"(GET {self.url}/health: {last_err}).\n"
                        f"--- server log (last lines; full log: {self._log_file}) ---\n{tail}")
                time.sleep(0.25)

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:  # the server was started in its own session: signal its process group
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError, OSError):
                proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError, OSError):
                    proc.kill()
                proc.wait(5)
        self._close_log()
        if not self.keep_log and self._log_file is not None:
            try:
                self._log_file.unlink()
            except OSError:
                pass

    def _close_log(self) -> None:
        if self._log_handle is not None:
            try:
                self._log_handle.close()
            except OSError:
                pass
            self._log_handle = None

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
