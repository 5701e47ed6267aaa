"""``--radix-eviction-policy kvflow``: SGLang's eviction strategy in the policy core's order.

:class:`KVFlowStrategy` is what SGLang's eviction-policy table builds (with the JSON of
``--radix-eviction-policy-config`` as keyword arguments, which also carry the cache's
tunables); :class:`~.cache.KVFlowRadixCache` binds its priority index to it.
:func:`ensure_eviction_policy_registered` puts ``kvflow`` in that table and in SGLang's CLI
choices. SGLang is imported here, and only inside ``serving/sglang``.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from kvflow_agents.serving.policy import CachePolicy, KVFlowPolicy, PriorityIndex, get_policy
from kvflow_agents.serving.policy.admission import check_admission, check_skip_scope

logger = logging.getLogger(__name__)

INF = math.inf
POLICY_NAME = "kvflow"


class EvictionStrategyAdapter:
    """Duck-types SGLang's ``EvictionStrategy`` so another engine's tree evicts in our order:
    ``get_priority(node)`` = ``policy.eviction_key(index.priority(node), node's LRU time)``."""

    def __init__(self, policy: "str | CachePolicy", index: PriorityIndex, *,
                 last_access: Callable = lambda node: node.last_access_time) -> None:
        self.policy = get_policy(policy)
        self.index = index
        self.last_access = last_access

    def get_priority(self, node) -> tuple:
        return self.policy.eviction_key(self.index.priority(node), self.last_access(node))


class KVFlowStrategy(EvictionStrategy):
    """SGLang eviction strategy = :class:`EvictionStrategyAdapter` (KVFlow key
    ``(-priority, last_access_time)``); SGLang's heap pops the smallest key first.

    SGLang builds it from ``--radix-eviction-policy kvflow`` with the JSON of
    ``--radix-eviction-policy-config`` as keyword arguments; the cache reads the optional
    ``lookahead``, ``busy_lookahead``, ``lease_s``, ``max_prefetch``, ``recompute_s_per_token``, ``admission``
    (``"workflow"`` or ``"fcfs"``) and ``skip_scope`` (``"all"`` or ``"workflow"``) from there.
    Until a :class:`KVFlowRadixCache` binds its index, every node has priority +inf (LRU).
    """

    def __init__(self, lookahead: Optional[float] = None, lease_s: Optional[float] = None,
                 max_prefetch: Optional[int] = None,
                 recompute_s_per_token: Optional[float] = None,
                 admission: Optional[str] = None, skip_scope: Optional[str] = None,
                 busy_lookahead: Optional[float] = None) -> None:
        self.options = {"lookahead": lookahead, "busy_lookahead": busy_lookahead, "lease_s": lease_s,
                        "max_inflight_prefetch": max_prefetch,
                        "recompute_s_per_token": recompute_s_per_token,
                        "admission": None if admission is None else check_admission(admission),
                        "skip_scope": None if skip_scope is None else check_skip_scope(skip_scope)}
        self.policy = KVFlowPolicy()
        self.adapter: Optional[EvictionStrategyAdapter] = None

    @property
    def index(self) -> Optional[PriorityIndex]:
        return self.adapter.index if self.adapter is not None else None

    def bind(self, index: PriorityIndex) -> None:
        self.adapter = EvictionStrategyAdapter(self.policy, index)

    def get_priority(self, node) -> tuple:
        if self.adapter is None:
            return self.policy.eviction_key(INF, node.last_access_time)
        return self.adapter.get_priority(node)


def ensure_eviction_policy_registered() -> None:
    """Put ``kvflow`` in SGLang's eviction-policy table and CLI choices (idempotent)."""
    from sglang.srt.mem_cache import utils as mc_utils

    mc_utils._EVICTION_POLICY_FACTORIES.setdefault(POLICY_NAME, KVFlowStrategy)
    try:
        from sglang.srt.arg_groups.choices import (RADIX_EVICTION_POLICY_CHOICES,
                                                   add_radix_eviction_policy_choices)

        if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
            add_radix_eviction_policy_choices([POLICY_NAME])
    except ImportError:  # pragma: no cover - older layouts
        logger.debug("kvflow: no CLI choice list to extend")
