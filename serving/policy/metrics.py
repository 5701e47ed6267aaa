"""Counters the cache manager keeps; ``as_dict()`` is what benchmarks and /metrics export.

Units: tokens for hits/misses, pages for evictions and backups, seconds for load time.
``load_hidden_s`` is load time overlapped with other work (a prefetch finished, or was partly
done, before its first use); ``load_exposed_s`` is load time a request had to wait for: for a
demand load its whole remaining transfer; for a prefetch ``ready - first attempt``, where the
first attempt is the first ``status(tokens, record=True)`` that found it in flight (else the
first ``match(record=True)``) -- so a status-aware engine must call ``status(..., record=True)``
when it skips a request for a load, or the wait is counted as hidden.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CacheMetrics:
    requests: int = 0
    hit_tokens_device: int = 0        # usable at once
    hit_tokens_host: int = 0          # cached on host only (needs a load)
    hit_tokens_loading: int = 0       # cached, load in flight
    miss_tokens: int = 0              # not cached in any tier: recompute
    evictions: Counter = field(default_factory=Counter)        # nodes, by reason
    evicted_pages: Counter = field(default_factory=Counter)    # pages, by reason
    backup_pages: int = 0             # device -> host write-through
    dropped_pages: int = 0            # device pages evicted with no host copy (recompute later)
    demand_loads: int = 0
    demand_load_pages: int = 0
    prefetch_issued: int = 0
    prefetch_pages: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0          # evicted from device, or its workflow released, before any use
    # the wasted, by what evicted them (an eviction reason: "alloc", "grow", "load", "prefetch",
    # "flush") or "workflow_end"
    prefetch_wasted_by: Counter = field(default_factory=Counter)
    # pages of unread prefetches evicted; a tail evicted while its head stays on device counts
    # here, not in prefetch_wasted (the head may still be read)
    prefetch_evicted_pages: int = 0
    prefetch_stale: int = 0           # planned but dropped because a newer hint changed plans
    prefetch_deferred: int = 0        # planned but not started (in-flight limit / no room)
    prefetch_budget_skips: int = 0    # not started: no room beyond the reserve (per attempt)
    prefetch_partial: int = 0         # of the issued: the head of a prefix that did not fit whole
    prefetch_recompute_skips: int = 0  # dropped by the planner: late, recompute cheaper (per plan)
    # idle-link fills not started: the agents due by then would not all fit on device (per plan)
    prefetch_fill_overflows: int = 0
    prefetch_fill_link_busy: int = 0  # idle-link fills not started: the link near its cap (per plan)
    loads_declined: int = 0           # load_on_demand returned None: recompute cheaper than loading
    declined_pages: int = 0           # host pages of those declined loads (recomputed instead)
    load_hidden_s: float = 0.0
    load_exposed_s: float = 0.0
    decode_page_waits: int = 0        # lazy decode: a growth waited a step for a load to land
    retractions: int = 0              # optimistic reserve: running sessions sent back to waiting

    @property
    def device_hit_rate(self) -> float:
        total = self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_loading + self.miss_tokens
        return self.hit_tokens_device / total if total else 0.0

    @property
    def hit_rate(self) -> float:
        """Any tier (device + host + loading)."""
        total = self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_loading + self.miss_tokens
        return (total - self.miss_tokens) / total if total else 0.0

    def evicted(self, reason: str, pages: int) -> None:
        self.evictions[reason] += 1
        self.evicted_pages[reason] += pages

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, Counter)}
        out["evictions"] = dict(self.evictions)
        out["evicted_pages"] = dict(self.evicted_pages)
        out["prefetch_wasted_by"] = dict(self.prefetch_wasted_by)
        out["device_hit_rate"] = self.device_hit_rate
        out["hit_rate"] = self.hit_rate
        hidden, exposed = self.load_hidden_s, self.load_exposed_s
        out["load_hidden_fraction"] = hidden / (hidden + exposed) if hidden + exposed > 0 else None
        return out

    def reset(self) -> None:
        self.__init__()
