"""KVFlow cache policy core: engine-agnostic, pure Python (stdlib only).

One implementation of workflow-aware KV-cache management, shared by the embedded engine, the
simulator and the SGLang plugin:

- :class:`KVCacheManager` (``manager.py``): the facade engines drive: radix tree, two page
  pools, eviction with write-through, loads, prefetch, hints. Its docstring lists the API.
- :class:`RadixTree` / :class:`TreeNode` / :class:`NodeState` (``tree.py``): structure and the
  legal tier transitions.
- :class:`PriorityIndex` (``priority.py``): STE tags -> subtree-min node priority, incremental.
  Keyed by node identity plus ``parent_of``, so an adapter can run it on another engine's tree
  (SGLang's ``UnifiedTreeNode``): call ``set_tag``/``set_ste``/``on_split``/``drop_node`` from
  that engine's hooks, and give its eviction heap an :class:`EvictionStrategyAdapter`
  (``get_priority(node)`` = ``policy.eviction_key(index.priority(node), node.last_access_time)``).
  :class:`PrefetchPlanner` likewise only sees candidates, never a tree.
- :data:`POLICIES` / :func:`get_policy` (``policies.py``): ``lru``, ``hicache``, ``kvflow``, ``oracle``.
- :class:`PrefetchPlanner` (``prefetch.py``), :class:`HintRegistry` (``hints.py``),
  :class:`CacheMetrics` (``metrics.py``), :class:`PagePool` (``pages.py``),
  :class:`KVTransferBackend` (``backend.py``, the seam to the engine's bytes).
"""

from .backend import KVTransferBackend, NullTransferBackend
from .hints import HintRegistry, as_ste, workflow_key
from .manager import (AgentPrefix, KVCacheManager, Load, PrefixMatch, PrefixStatus,
                      TickReport)
from .metrics import CacheMetrics
from .pages import PagePool, PoolError
from .policies import (POLICIES, CachePolicy, EvictionStrategyAdapter, HiCachePolicy,
                       KVFlowPolicy, LRUPolicy, OraclePolicy, get_policy, register_policy)
from .prefetch import PlannedLoad, PrefetchCandidate, PrefetchPlanner
from .priority import PriorityIndex
from .tree import IllegalTransition, NodeState, RadixTree, TreeNode

__all__ = [
    "KVCacheManager", "PrefixMatch", "PrefixStatus", "TickReport", "Load", "AgentPrefix",
    "KVTransferBackend", "NullTransferBackend",
    "POLICIES", "CachePolicy", "LRUPolicy", "HiCachePolicy", "KVFlowPolicy", "OraclePolicy",
    "get_policy", "register_policy", "EvictionStrategyAdapter",
    "RadixTree", "TreeNode", "NodeState", "IllegalTransition",
    "PriorityIndex", "PrefetchPlanner", "PrefetchCandidate", "PlannedLoad",
    "HintRegistry", "workflow_key", "as_ste", "CacheMetrics", "PagePool", "PoolError",
]
