"""KVFlow cache policy core: engine-agnostic, pure Python (stdlib only).

One implementation of workflow-aware KV-cache management, shared by the embedded engine, the
simulator and the SGLang plugin:

- :class:`KVCacheManager` (``manager.py``): the facade that wires the parts below; engines
  drive it through per-request sessions (``session.py``: :meth:`KVCacheManager.arrive` ->
  :class:`RequestSession` ``poll`` -> ``admit`` -> ``commit`` -> ``finish``).
- :class:`TieredStore` (``store.py`` + ``eviction.py``): radix tree, device and host page
  pools, locks, insert, node states, eviction heaps, write-through.
- :class:`LoadTracker` (``loads.py``): loads in flight, the link clock, load-vs-recompute,
  hidden / exposed accounting.
- :class:`TagBook` (``tags.py``): fixed-prefix tags, hints with leases, effective STE, the
  priority index, client caps, app-prefix memory, boundary inference.
- :class:`Prefetcher` (``prefetch.py``): candidates -> budget -> planner -> start through a
  :class:`PrefetchTarget` (our store, or SGLang's ``load_back``).
- ``inspection.py``: ``snapshot`` views and ``check_invariants``.
- :class:`RadixTree` / :class:`TreeNode` / :class:`NodeState` (``tree.py``): structure and the
  legal tier transitions.
- :class:`PriorityIndex` (``priority.py``): STE tags -> subtree-min node priority, incremental.
  Keyed by node identity plus ``parent_of``, so an adapter can run it on another engine's tree
  (SGLang's ``UnifiedTreeNode``): the SGLang plugin calls ``on_split``/``drop_node`` from
  that engine's hooks and orders its eviction heap by
  ``policy.eviction_key(index.priority(node), node.last_access_time)``. The
  :class:`TagBook`, :class:`LoadTracker` and :class:`Prefetcher` likewise see another tree
  only through callables, so the plugin runs them over SGLang's tree.
- :data:`POLICIES` / :func:`get_policy` (``policies.py``): ``lru``, ``hicache``, ``kvflow``, ``oracle``.
- :class:`PrefetchPlanner` (``prefetch.py``), :class:`HintRegistry` (``hints.py``),
  :class:`CacheMetrics` (``metrics.py``), :class:`PagePool` (``pages.py``),
  :class:`KVTransferBackend` (``backend.py``, the seam to the engine's bytes).
"""

from .backend import KVTransferBackend, NullTransferBackend
from .hints import HintRegistry, as_ste, workflow_key
from .boundary import common_prefix_len
from .loads import Load, LoadTracker
from .manager import KVCacheManager, TickReport
from .session import CacheFullError, Poll, Readiness, RequestSession
from .store import PrefixMatch, PrefixStatus, TieredStore
from .tags import AgentPrefix, TagBook
from .metrics import CacheMetrics
from .pages import PagePool, PoolError
from .policies import (POLICIES, CachePolicy, HiCachePolicy,
                       KVFlowPolicy, LRUPolicy, OraclePolicy, get_policy, register_policy)
from .prefetch import PlannedLoad, PrefetchCandidate, Prefetcher, PrefetchPlanner, PrefetchTarget
from .priority import PriorityIndex
from .tree import IllegalTransition, NodeState, RadixTree, TreeNode

__all__ = [
    "KVCacheManager", "PrefixMatch", "PrefixStatus", "TickReport", "Load", "AgentPrefix",
    "RequestSession", "Poll", "Readiness", "CacheFullError",
    "TieredStore", "LoadTracker", "TagBook", "Prefetcher", "PrefetchTarget", "common_prefix_len",
    "KVTransferBackend", "NullTransferBackend",
    "POLICIES", "CachePolicy", "LRUPolicy", "HiCachePolicy", "KVFlowPolicy", "OraclePolicy",
    "get_policy", "register_policy",
    "RadixTree", "TreeNode", "NodeState", "IllegalTransition",
    "PriorityIndex", "PrefetchPlanner", "PrefetchCandidate", "PlannedLoad",
    "HintRegistry", "workflow_key", "as_ste", "CacheMetrics", "PagePool", "PoolError",
]
