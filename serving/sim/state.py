"""The simulator's state: the virtual-clock transfer backend and the records of requests,
workflows and results that :class:`~.engine.Simulator` keeps.

- :class:`SimBackend`: the policy core's ``KVTransferBackend`` on the simulator's clock; a load
  takes ``link_alpha_s + bytes / link`` on one FIFO link (no link: it lands at once); a backup
  only counts pages (write-through is off the critical path on a GPU).
- :class:`Tokens`: synthetic token ids, a deterministic run per fixed prompt so every call of an
  agent shares its prefix.
- :class:`Req`, :class:`WfState`: one call and one workflow instance in flight;
  :class:`SimResult`: one policy's figures.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from .costs import Profile
from .workloads import Call, WorkflowPlan


class SimBackend:
    """:class:`~kvflow_agents.serving.policy.KVTransferBackend` on a virtual clock."""

    def __init__(self, profile: Profile, page_size: int, clock: Callable[[], float]) -> None:
        self.bytes_per_page = profile.kv_bytes_per_token * page_size
        self.link_bytes_per_s = profile.link_gbps * 1e9 if profile.link_gbps else None
        self.alpha = profile.link_alpha_s
        self._clock = clock
        self.link_free_at = 0.0
        self.load_busy_s = 0.0
        self.loads = self.load_pages = self.backup_pages = 0

    def now(self) -> float:
        return self._clock()

    def backup_to_host(self, device_pages, host_pages) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("backup_to_host: page lists differ in length")
        self.backup_pages += len(device_pages)

    def start_load(self, host_pages, device_pages) -> float:
        if len(device_pages) != len(host_pages):
            raise ValueError("start_load: page lists differ in length")
        now = self._clock()
        self.loads += 1
        self.load_pages += len(device_pages)
        if not self.link_bytes_per_s:
            return now
        dur = self.alpha + len(device_pages) * self.bytes_per_page / self.link_bytes_per_s
        start = max(now, self.link_free_at)
        self.link_free_at = start + dur
        self.load_busy_s += dur
        return self.link_free_at


class Tokens:
    """Synthetic token ids: a deterministic run per fixed-prompt key, unique ids otherwise."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._next = itertools.count(1 << 40)

    def fixed(self, key: str, n: int) -> tuple:
        base = (self._keys.setdefault(key, len(self._keys)) + 1) << 24
        return tuple(range(base, base + n))

    def unique(self, n: int) -> tuple:
        return tuple(next(self._next) for _ in range(n))


@dataclass(eq=False)
class Req:
    wf: "WfState"
    call: Call
    prompt: tuple
    out: tuple
    arrival: float
    measured: bool
    session: object = None       # the policy core's RequestSession
    cached: int = 0              # prompt tokens served from cache (device or loaded)
    n_new: int = 0               # prompt tokens computed
    ready: float = 0.0           # inline load lands at
    inline_at: Optional[float] = None  # skipped: when its prefill could start hiding its load
    wait_since: Optional[float] = None
    wait_until: float = 0.0
    load_wait_s: float = 0.0     # time this request waited on loads (skipped or stalled)
    load_need_s: float = 0.0     # transfer time of the loads it was the first to read
    skip_wait_s: float = 0.0     # part of load_wait_s spent skipped (status-aware)
    generated: int = 0
    first_token: Optional[float] = None
    done: Optional[float] = None


@dataclass(eq=False)
class WfState:
    plan: WorkflowPlan
    step: int = -1
    outstanding: int = 0
    round_start: dict = field(default_factory=dict)
    round_end: dict = field(default_factory=dict)
    client_done: float = 0.0     # when the client saw the last call of the current step end


@dataclass
class SimResult:
    policy: str
    workload: str
    latency_s: float               # mean measured round latency per workflow ("workflow latency")
    makespan_s: float
    ttft_mean_s: float
    requests: int
    recomputed_tokens: int
    cached_tokens: int
    load_s: float                  # link busy time (all loads)
    exposed_load_s: float
    hidden_fraction: Optional[float]
    cache: dict
    latency_p90_s: float = 0.0     # p90 of the same round latencies
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)
