"""Start, wait for and stop one ``kvflow serve`` in a subprocess: the one launcher the
benchmarks (``kvflow bench``) and the PEER example share.

    with ServeProcess(["--model", "tiny-random", "--policy", "kvflow"]) as srv:
        srv.base_url        # "http://127.0.0.1:<port>/v1"

The server runs as ``<this python> -m kvflow_agents.cli.main serve ARGS --host H --port P``
(the same interpreter, so a venv's ``kvflow`` is used even when it is not on ``PATH``; another
``command`` can stand in, e.g. in tests) in its own session, so :meth:`ServeProcess.stop`
signals its whole process group; a SIGTERM to the process that started it stops it too (where
that process had no handler of its own: :func:`_exit_cleanly_on_sigterm`). Its stdout/stderr
go to a temporary log file, never to a pipe (a chatty server cannot block on a full pipe).
:meth:`ServeProcess.start` polls ``GET /health`` until it answers 200; if the process exits first, or the timeout passes, it
stops the process, keeps the log and raises :class:`ServerStartError` with the log's tail. A
port it picked itself that was taken before the server bound it (servers starting side by
side: an SGLang server picks internal ports of its own) is picked again, twice at most.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["ServeProcess", "ServerStartError", "free_port", "process_tree"]


class ServerStartError(RuntimeError):
    """The server did not become healthy (the message includes its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a server's engine process, its tokenizer helper),
    from ``/proc`` (Linux; ``[pid]`` elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return [pid]
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": comm may hold spaces
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


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


def _exit_cleanly_on_sigterm() -> None:
    """Make a SIGTERM to this process raise ``SystemExit`` where it would kill it outright, so
    ``finally`` blocks and :mod:`atexit` (:meth:`ServeProcess.stop`) run: a server runs in a
    session of its own and would outlive a benchmark stopped with ``kill`` or by a CI timeout.
    A handler the program installed is left alone; so is any thread but the main one (only it
    may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


class ServeProcess:
    """One ``kvflow serve`` child process (module doc)."""

    health_path = "/health"   # polled until it answers 200 (SGLang's launcher: /health_generate)

    def __init__(self, args: Sequence[str] = (), *, host: str = "127.0.0.1",
                 port: Optional[int] = None, timeout_s: float = 300.0,
                 command: Optional[Sequence[str]] = None,
                 env: Optional[dict[str, str]] = None,
                 health_headers: Optional[dict[str, str]] = None) -> None:
        """``health_headers``: sent with the ``/health`` polls (an API key, when one is set)."""
        self.args = list(args)
        self.health_headers = dict(health_headers or {})
        self.host = host
        self._auto_port = not port  # chosen here: another may be picked if it is taken meanwhile
        self.port = port or free_port(host)
        self.timeout_s = timeout_s
        self.command = list(command) if command else [sys.executable, "-m", "kvflow_agents.cli.main", "serve"]
        self.env = env
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log_path: Optional[Path] = None
        self._log = None
        self.keep_log = False  # set when start fails, so the log can still be read
        self.started_s = 0.0   # seconds from spawn to healthy
        _exit_cleanly_on_sigterm()  # here, not in start(): a Cluster starts its servers on threads

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args, "--host", self.host, "--port", str(self.port)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines) if self.log_path else "(server not started)"

    PORT_RETRIES = 2

    def start(self) -> "ServeProcess":
        """Spawn the server and wait until it is healthy. A port picked here is free when it is
        picked, not when the server binds it: if another process (e.g. a server starting
        beside it, whose internal ports are its own choice) took it meanwhile, the server
        exits with "address already in use" and is started again on a new port."""
        retries = 0
        while True:
            try:
                return self._start_once()
            except ServerStartError:
                if not (self._auto_port and retries < self.PORT_RETRIES and self._port_was_taken()):
                    raise
            retries += 1
            self.keep_log = False
            self.stop()  # (already stopped: this drops the failed attempt's log)
            self.port = free_port(self.host)

    def _port_was_taken(self) -> bool:
        return "address already in use" in self.log_tail(200).lower()

    def _start_once(self) -> "ServeProcess":
        fd, name = tempfile.mkstemp(prefix="kvflow-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        env = {**os.environ, **(self.env or {}), "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            self._close_log()
            raise ServerStartError(f"could not run {' '.join(self.argv)}: {e}") from e
        atexit.register(self.stop)
        self._wait_healthy()
        self.started_s = time.perf_counter() - t0
        return self

    def _fail(self, what: str) -> ServerStartError:
        tail = self.log_tail()
        self.keep_log = True
        self.stop()
        return ServerStartError(f"`{' '.join(self.argv)}` {what}.\n"
                                f"--- server log (last lines; full log: {self.log_path}) ---\n{tail}")

    def _wait_healthy(self) -> None:
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        last_err = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False, headers=self.health_headers) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._fail(f"exited with code {code} before it was healthy")
                try:
                    r = client.get(self.url + self.health_path)
                    if r.status_code == 200:
                        return
                    last_err = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last_err = type(e).__name__
                if time.monotonic() > deadline:
                    raise self._fail(f"was not healthy after {self.timeout_s:.0f}s "
                                     f"(GET {self.url}{self.health_path}: {last_err})")
                time.sleep(0.2)

    def stop(self, grace_s: float = 10.0, keep_log: bool = False) -> None:
        atexit.unregister(self.stop)
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:  # the server was started in its own session: signal its process group
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait(5)
        self._close_log()
        if not (keep_log or self.keep_log) and self.log_path is not None:
            try:
                self.log_path.unlink()
            except OSError:
                pass

    def _close_log(self) -> None:
        if self._log is not None:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None

    def __enter__(self) -> "ServeProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
