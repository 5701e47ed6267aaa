"""Cache policies, one small class each behind one interface, selected by name.

A policy only answers questions (which order to evict in, whether to keep a host copy, whether
to prefetch); :class:`~.manager.KVCacheManager` does the bookkeeping. Like SGLang's
``EvictionStrategy``: the node with the *smallest* ``eviction_key`` goes first.

===========  ===========  ==============  =========================  ====================  =========
name         device tier  host tier       eviction order             loads                 admission
===========  ===========  ==============  =========================  ====================  =========
lru          bounded      none            LRU                        recompute on miss     fcfs
hicache      bounded      write-through   LRU (both tiers)           on demand             fcfs
kvflow       bounded      write-through   largest STE first, LRU     on demand + prefetch  workflow
oracle       unbounded    none            never evicts               -                     fcfs
oracle-pool  unbounded *  none            never evicts               -                     fcfs
===========  ===========  ==============  =========================  ====================  =========

``admission``: the order engines try waiting requests in (:mod:`.admission`).
``*`` cached prefixes are free, but running requests get the bounded policies' pool
(``admission_pool_bound``): the best any cache policy could do *with this pool*.
"""

from __future__ import annotations

import math
from typing import Callable

from .admission import check_admission, check_skip_scope

INF = math.inf


class CachePolicy:
    """Interface and defaults (= plain LRU on the device tier)."""

    name = "base"
    host_tier = False       # keep host copies of evicted nodes and load them back on demand
    evicts = True           # False: the device pool grows instead (oracle)
    uses_priority = False   # eviction order depends on STE priority (re-index on hint updates)
    prefetch = False        # run the prefetch planner on hint updates / ticks
    status_aware = False    # the scheduler should skip requests whose prefix is loading
    skip_scope = "all"      # ... letting which requests run ahead of it (admission.SKIP_SCOPES)
    admission = "fcfs"      # waiting requests' order (admission.ADMISSION_ORDERS)
    # requests are admitted only while what running requests hold fits the configured pool
    # (a bounded pool: always; a growable one: see PoolOraclePolicy)
    admission_pool_bound = True

    def eviction_key(self, priority: float, last_access: int) -> tuple:
        """Smallest key is evicted first (both tiers)."""
        return (last_access,)

    def should_backup(self, priority: float, tags_below: int) -> bool:
        """Write this device victim through to host before freeing its device pages?"""
        return False

    def host_victim_allowed(self, victim_priority: float, for_priority: float) -> bool:
        """May a host node of ``victim_priority`` be evicted to back up one of ``for_priority``?"""
        return True

    def __repr__(self) -> str:
        return f"<policy {self.name}>"


class LRUPolicy(CachePolicy):
    """Stock SGLang: device only, LRU, recompute on miss."""

    name = "lru"


class HiCachePolicy(CachePolicy):
    """SGLang HiCache: LRU, every evicted node written through to host, load on demand."""

    name = "hicache"
    host_tier = True

    def should_backup(self, priority: float, tags_below: int) -> bool:
        return True


class KVFlowPolicy(CachePolicy):
    """KVFlow: evict the largest steps-to-execution first (ties: LRU), write through, prefetch.

    ``backup="all"`` (default) writes every device victim through, like the HiCache it builds
    on; ``"tagged"`` keeps host copies only of nodes on some agent's fixed prefix. Host
    eviction uses the same order and never drops a more urgent copy to keep a less urgent one.
    """

    name = "kvflow"
    host_tier = True
    uses_priority = True
    prefetch = True
    status_aware = True
    skip_scope = "workflow"

    BACKUP_MODES = ("all", "tagged")

    def __init__(self, backup: str = "all", prefetch: bool = True, admission: str = "workflow",
                 skip_scope: str | None = None) -> None:
        if backup not in self.BACKUP_MODES:
            raise ValueError("backup must be 'all' or 'tagged'")
        check_admission(admission)
        if skip_scope is not None:
            self.skip_scope = check_skip_scope(skip_scope)
        self.backup = backup
        self.prefetch = prefetch  # False: eviction order and status only (ablation / Belady check)
        self.admission = admission  # "fcfs": request order, as the baselines (ablation)

    def eviction_key(self, priority: float, last_access: int) -> tuple:
        return (-priority, last_access)

    def should_backup(self, priority: float, tags_below: int) -> bool:
        return self.backup == "all" or tags_below > 0

    def host_victim_allowed(self, victim_priority: float, for_priority: float) -> bool:
        return victim_priority >= for_priority


class OraclePolicy(CachePolicy):
    """Unbounded device memory: never evicts. The physical upper bound for a workload."""

    name = "oracle"
    evicts = False
    admission_pool_bound = False


class PoolOraclePolicy(OraclePolicy):
    """The oracle with the bounded policies' memory for running requests: every prefix ever
    computed stays cached for free (its pool grows for them), but a request is admitted only
    while the pages running requests hold, plus its own, fit the configured pool, as under
    lru / hicache / kvflow. The plain oracle also runs more requests at once than that pool
    allows (in a tight pool, parallel branches that every bounded policy serializes), which no
    cache policy can buy; this one is the latency no cache policy can beat with this pool."""

    name = "oracle-pool"
    admission_pool_bound = True


POLICIES: dict[str, Callable[..., CachePolicy]] = {
    "lru": LRUPolicy,
    "hicache": HiCachePolicy,
    "kvflow": KVFlowPolicy,
    "oracle": OraclePolicy,
    "oracle-pool": PoolOraclePolicy,
}


def is_reference(name: str) -> bool:
    """An oracle (a growable device pool: a reference to compare with, not a contender);
    False for names that are not registered (a bench's variant label)."""
    cls = POLICIES.get(name)
    return cls is not None and not cls.evicts


def get_policy(name: "str | CachePolicy", **kwargs) -> CachePolicy:
    """A policy instance by registry name (or pass an instance through)."""
    if isinstance(name, CachePolicy):
        return name
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose from {sorted(POLICIES)}") from None
    return factory(**kwargs)


def register_policy(name: str, factory: Callable[..., CachePolicy]) -> None:
    POLICIES[name] = factory
