"""Several kvflow workers behind SGLang's own gateway (``smg``), started and stopped as one.

KVFlow's cache decisions are per instance: a workflow's agents only hit their cached prefixes
if every request of that workflow reaches the same instance. SGLang's model gateway does that
when it routes on the ``x-smg-routing-key`` header (kvflow clients send the workflow id there)
with a *key-aware* policy. The default ``cache_aware`` policy ignores the key. So
:class:`Cluster` starts the gateway with:

- ``--policy manual --assignment-mode min_group`` (default): a new workflow goes to the worker
  holding the fewest workflows, then stays there (sticky map). If its worker is marked unhealthy
  the workflow moves to a healthy one; smg keeps both (its first candidate first), so when the
  old worker is healthy again the workflow goes back to it, onto a cold cache if it restarted
  (``kvflow bench cluster``'s fault run: 8 of 9 workflows moved back).
  ``consistent_hashing`` is the stateless alternative (a restarted worker also takes its
  workflows back at once); both are measured by ``kvflow bench cluster``.
- ``--health-check-interval-secs 1 --health-failure-threshold 2 --health-success-threshold 1``:
  a dead worker leaves the rotation in about 2 s instead of the default 60 s x 3, and a restarted
  one re-enters after one good probe. A probe is one ``GET /health`` (cheap on kvflow workers,
  which answer 503 while starting or draining).
- ``--disable-tokenizer-autoload``: HTTP routing needs no tokenizer (the gateway would otherwise
  try to load one from the model name).
- its own free ports (the Prometheus exporter defaults to 29000 and two gateways would clash).

The gateway is ``smg`` 1.13 (``pip install 'kvflow-agents[cluster]'``), chosen over
``sglang-router`` 0.3.2 (also supported: ``gateway="sglang-router"``): 0.3.2 rebuilds chat
bodies and drops ``custom_params``, has no ``consistent_hashing`` on its command line, and lists
our workers' model as ``unknown``; smg 1.13 forwards both hint channels and reads the model from
``/model_info``. kvflow hints reach workers through either (``metadata["kvflow"]``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvflow_agents.bench.server import BenchServer, ServerStartError, free_port

GATEWAYS = {"smg": "smg", "sglang-router": "sglang_router"}
# Policies that read x-smg-routing-key ("manual" needs an assignment mode for new keys).
KEY_POLICIES = ("manual", "consistent_hashing")
POLICIES = ("manual", "consistent_hashing", "cache_aware", "round_robin", "random",
            "power_of_two", "prefix_hash", "least_load")


class GatewayError(RuntimeError):
    pass


def gateway_available(gateway: str = "smg") -> bool:
    return importlib.util.find_spec(GATEWAYS[gateway]) is not None


@dataclass
class GatewayConfig:
    gateway: str = "smg"
    policy: str = "manual"
    assignment_mode: Optional[str] = "min_group"   # manual policy only
    health_interval_s: int = 1
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    extra: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.gateway not in GATEWAYS:
            raise ValueError(f"gateway: choose one of {', '.join(GATEWAYS)}, not {self.gateway!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: choose one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.gateway == "sglang-router" and self.policy not in (
                "manual", "cache_aware", "round_robin", "random", "power_of_two"):
            raise ValueError(f"sglang-router 0.3.2 has no {self.policy!r} policy on its command line")


class Gateway:
    """One gateway process (its own session, output in a temp log file)."""

    def __init__(self, worker_urls: Sequence[str], config: GatewayConfig, *,
                 host: str = "127.0.0.1", port: Optional[int] = None, timeout_s: float = 60.0) -> None:
        config.validate()
        if not gateway_available(config.gateway):
            raise GatewayError(f"the {config.gateway} gateway is not installed: "
                               "pip install 'kvflow-agents[cluster]'")
        self.config, self.worker_urls = config, list(worker_urls)
        self.host, self.port = host, port or free_port(host)
        self.metrics_port = free_port(host)
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.log_path: Optional[Path] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def argv(self) -> list[str]:
        c = self.config
        if c.gateway == "smg":
            head = [sys.executable, "-m", "smg", "launch", "--disable-tokenizer-autoload"]
        else:
            head = [sys.executable, "-m", "sglang_router.launch_router"]
        argv = head + ["--host", self.host, "--port", str(self.port),
                       "--worker-urls", *self.worker_urls, "--policy", c.policy,
                       "--prometheus-port", str(self.metrics_port),
                       "--health-check-interval-secs", str(c.health_interval_s),
                       "--health-failure-threshold", str(c.health_failure_threshold),
                       "--health-success-threshold", str(c.health_success_threshold),
                       "--log-level", "warn"]
        if c.policy == "manual" and c.assignment_mode:
            argv += ["--assignment-mode", c.assignment_mode]
        return argv + list(c.extra)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])  # type: ignore[union-attr]
        except (OSError, AttributeError):
            return "(no log)"

    def healthy_workers(self, client) -> int:
        r = client.get(self.url + "/workers")
        if r.status_code != 200:
            return 0
        doc = r.json()
        workers = doc.get("workers", doc) if isinstance(doc, dict) else doc
        return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))

    def start(self, expect_workers: Optional[int] = None) -> "Gateway":
        import httpx

        fd, name = tempfile.mkstemp(prefix="kvflow-gateway-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        want = len(self.worker_urls) if expect_workers is None else expect_workers
        deadline = time.monotonic() + self.timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while True:
                if self.proc.poll() is not None:
                    tail = self.log_tail()
                    self.stop()
                    raise GatewayError(f"`{' '.join(self.argv)}` exited:\n{tail}")
                try:
                    if self.healthy_workers(c) >= want:
                        return self
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise GatewayError(f"gateway not ready with {want} workers after "
                                       f"{self.timeout_s:.0f}s:\n{tail}")
                time.sleep(0.2)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.log_path is not None:
            try:
                self.log_path.unlink()
            except OSError:
                pass


class Cluster:
    """``workers`` ``kvflow serve`` processes (instance ids ``w0``, ``w1``, …) + one gateway.

    ``serve_args``: the ``kvflow serve`` flags every worker gets (model, policy, pools, and
    ``--engine sglang --model-path M`` for SGLang workers)."""

    def __init__(self, workers: int, serve_args: Sequence[str], gateway: GatewayConfig | None = None,
                 *, host: str = "127.0.0.1", port: Optional[int] = None,
                 worker_timeout_s: float = 300.0) -> None:
        if workers < 1:
            raise ValueError("workers: must be >= 1")
        self.servers = [BenchServer(serve_args, host=host, timeout_s=worker_timeout_s,
                                    env={"KVFLOW_INSTANCE_ID": f"w{i}"}) for i in range(workers)]
        self.gateway_config = gateway or GatewayConfig()
        self.gateway_config.validate()
        self.host, self.port = host, port
        self.gateway: Optional[Gateway] = None

    @property
    def url(self) -> str:
        assert self.gateway is not None, "not started"
        return self.gateway.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def instance_id(self, i: int) -> str:
        return f"w{i}"

    def start(self) -> "Cluster":
        errors: list[BaseException] = []

        def boot(s: BenchServer) -> None:
            try:
                s.start()
            except BaseException as e:  # noqa: BLE001 — reported below
                errors.append(e)
        threads = [threading.Thread(target=boot, args=(s,)) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop()
            raise errors[0]
        try:
            self.gateway = Gateway(self.worker_urls, self.gateway_config, host=self.host,
                                   port=self.port).start()
        except BaseException:
            self.stop()
            raise
        return self

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` (a crash: no draining)."""
        s = self.servers[i]
        if s.proc is not None and s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(10)
        s.stop()

    def restart_worker(self, i: int) -> float:
        """Start worker ``i`` again on its port; seconds until it answered ``/health``."""
        t0 = time.perf_counter()
        self.servers[i].start()
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["Cluster", "Gateway", "GatewayConfig", "GatewayError", "ServerStartError",
           "gateway_available", "KEY_POLICIES", "POLICIES"]
