"""Plan, result rows and small helpers of ``kvflow bench reliability`` (:mod:`.reliability`)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from .reliability_corpus import TINY

HEALTH_BUDGET_S = 0.100
KEYS = {"alice": "rel-key-alice", "bob": "rel-key-bob", "fuzz": "rel-key-fuzz",
        "quiet": "rel-key-quiet", "flood": "rel-key-flood"}


# ================================================================ plan and results
@dataclass
class Plan:
    fuzz_cases: int = 5200
    isolation_rounds: int = 40
    health_requests: int = 3
    disconnects: int = 200
    slow_clients: int = 8
    hint_rounds: int = 3
    hint_posts: int = 2000
    hint_agents: int = 1024
    flood_rounds: int = 8
    flood_workflows: int = 40
    flood_posts: int = 1720
    flood_baseline: bool = True          # also run the flood with --client-cap off
    cross_tenant: int = 120
    soak_workflows: int = 64
    soak_s: float = 600.0
    restarts: int = 1
    restart_requests: int = 50
    det_model: str = "smollm2-135m"
    det_prompts: int = 12
    health_model: str = "smollm2-135m"
    lease_s: float = 3.0                 # the main server's lease (hint memory waits 2 leases)

    @classmethod
    def quick(cls) -> "Plan":
        return cls(fuzz_cases=240, isolation_rounds=3, health_requests=1, disconnects=16,
                   slow_clients=2, hint_rounds=2, hint_posts=30, hint_agents=256, flood_rounds=3,
                   flood_workflows=8, flood_posts=60, flood_baseline=False, cross_tenant=12,
                   soak_workflows=8, soak_s=4.0, restart_requests=8, det_model=TINY, det_prompts=6,
                   health_model=TINY, lease_s=1.5)


@dataclass
class Row:
    """One check. ``failed`` counts correctness failures (a dropped connection, a 5xx, a leak: 0
    whatever the machine's load); ``target`` is a measured figure against its target (latency,
    shares, memory growth): True met, False missed, None when the row has none."""

    name: str
    tried: int
    failed: int
    figure: str
    detail: dict = field(default_factory=dict)
    target: Optional[bool] = None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.target is not False


# ================================================================ small helpers
def rss_mb(pid: int) -> float:
    """Resident set size in MB of a server process and the processes below it (its engine
    process, ``kvflow serve --engine-process``; Linux /proc; NaN elsewhere)."""
    from kvflow_agents.serve_process import process_tree

    total, found = 0.0, False
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
                    found = True
        except OSError:
            pass
    return total if found else math.nan


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (exact name, any labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and len(line) > len(name) and line[len(name)] in "{ ":
            total += float(line.split()[-1])
    return total


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def client(srv: Any, tenant: str, *, timeout: float = 60.0, sync: bool = False, headers: Optional[dict] = None,
           **kw: Any) -> Any:
    """An httpx client of ``srv`` as ``tenant``; never through an environment proxy (127.0.0.1)."""
    cls = httpx.Client if sync else httpx.AsyncClient
    return cls(base_url=srv.url, timeout=timeout, headers={**auth(tenant), **(headers or {})},
               trust_env=False, **kw)


def keys_file() -> str:
    fd, path = tempfile.mkstemp(prefix="kvflow-rel-keys-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(KEYS, f)
    return path


def sse_ok(text: str) -> bool:
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    return bool(events) and events[-1] == "[DONE]" and not any('"error"' in e for e in events[:-1])
