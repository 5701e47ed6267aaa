"""The tiered store: radix tree + device and host page pools, locks, insert, loads, node states.

It owns *which* pages hold *what*; eviction order and write-through are in
:class:`~.eviction.Evictor`, the node side of loads in :class:`~.transfers.Transfers` (both mixed
in), load timing and costs in the
:class:`~.loads.LoadTracker`, tags in the :class:`~.tags.TagBook` (told about tier changes
through :meth:`TagBook.node_tier` / :meth:`TagBook.node_removed`). The engine owns the bytes and
moves them when asked through :class:`~.backend.KVTransferBackend`.

Page ids are ints; only whole pages are cached, so lengths are multiples of ``page_size``.

- ``match(tokens, *, record=True) -> PrefixMatch``: longest cached prefix (device part, host-only
  / loading part, the lock handle ``node``); splits the last node at the match end, touches LRU.
  ``record``: hit counters, and a prefetch on the path is credited as used.
- ``status(tokens, *, record=False)`` / ``peek(tokens)``: read-only (no split, no LRU).
  ``status(record=True)``: a request that would run now but for its prefix; prefetches in flight
  on its path note their first wait (hidden / exposed accounting, :mod:`.loads`).
- ``load_on_demand(match, *, recompute_s=None)``: start loading the host-only part; when it is
  readable, or None (no device room, or recomputing is cheaper: :meth:`LoadTracker.should_load`).
- ``lock`` / ``unlock``: pin a root path in both tiers. ``allocate`` / ``free``: device pages for
  new KV (evicting per policy; None when even eviction cannot make room, nothing evicted).
- ``insert(tokens, device_pages)``: the tree takes the first ``len(tokens) // page_size`` pages;
  pages duplicating a cached part are freed (read the tree's pages back with ``match``).

Invariants (besides the tree's T1-T4, see :mod:`.tree`; checked by ``inspection``):
- M1: tree device pages + pages held by the engine = device pool used <= capacity (unless oracle);
- M2: only unlocked DEVICE nodes with no device child are device-eviction candidates; only
  unlocked HOST leaves (or host backups of DEVICE nodes) are host-eviction candidates;
- M3: under ``kvflow`` a node is evicted only when no candidate has a larger priority, so the
  dynamic suffix (+inf) goes before any tagged prefix of finite STE;
- M4: a prefetch never evicts a node whose priority is <= the STE of the agent it fetches for.
Not thread-safe: the engine's scheduler thread only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from .backend import KVTransferBackend
from .eviction import Evictor
from .transfers import Transfers
from .loads import Load, LoadTracker
from .metrics import CacheMetrics
from .pages import PagePool
from .policies import CachePolicy
from .priority import PriorityIndex
from .tags import TagBook
from .tree import NodeState, RadixTree, TreeNode

DEVICE, HOST, LOADING, OFFLOADING = (NodeState.DEVICE, NodeState.HOST, NodeState.LOADING,
                                     NodeState.OFFLOADING)


class PrefixStatus(enum.Enum):
    READY = "ready"            # everything cached is readable on device (maybe nothing cached)
    LOADING = "loading"        # part of it is in flight host -> device: skip for now
    NEEDS_LOAD = "needs_load"  # part of it is host-only: call load_on_demand


@dataclass
class PrefixMatch:
    tokens_len: int            # len(tokens) asked about
    cached_len: int            # tokens cached in some tier (page-aligned)
    device_len: int            # leading tokens readable on device now
    device_pages: list[int]    # page ids of those device_len tokens
    node: TreeNode             # deepest matched node (root if none): the lock handle
    device_node: TreeNode      # deepest node of the readable part
    loading: bool              # some of the rest is in flight
    needs_load: bool           # some of the rest is host-only

    @property
    def host_len(self) -> int:
        """Cached tokens not readable yet (host-only or loading)."""
        return self.cached_len - self.device_len

    @property
    def status(self) -> PrefixStatus:
        if self.needs_load:
            return PrefixStatus.NEEDS_LOAD
        return PrefixStatus.LOADING if self.loading else PrefixStatus.READY


class TieredStore(Evictor, Transfers):
    """Radix tree + two page pools + a policy (module doc)."""

    partial_prefetch = True  # a prefetch may load the head of a host-only path (PrefetchTarget)

    def __init__(self, policy: CachePolicy, *, page_size: int, device_pages: int, host_pages: int,
                 backend: KVTransferBackend, book: TagBook, loads: LoadTracker,
                 metrics: CacheMetrics, partial_eviction: bool = True) -> None:
        self.policy = policy
        self.page_size = page_size
        self.backend = backend
        self.book = book
        self.index: PriorityIndex = book.index
        self.loads = loads
        self.metrics = metrics
        self.tree = RadixTree(page_size, on_split=self._on_split)
        self.device = PagePool(device_pages, name="device", growable=not policy.evicts)
        self.host = PagePool(host_pages if policy.host_tier else 0, name="host")
        # Evict only as many tail pages of the last victim as needed (splitting it) rather
        # than the whole node: the head keeps serving as a prefix. Same for every policy.
        # (SGLang evicts whole nodes, and so does the embedded engine by default, whose CPU
        # attention reads a prefix faster in fewer page runs: EngineConfig.partial_eviction.)
        self.partial_eviction = partial_eviction
        self.clock = 0                       # logical LRU clock
        self.evictable = 0                   # pages in unlocked DEVICE nodes
        # Optional observer, called as on_evict(node, tier, priority, reason) before a node
        # leaves a tier; tests use it to check eviction order.
        self.on_evict: Callable[[TreeNode, str, float, str], None] | None = None
        self._init_eviction()
        self.index.on_change = self._on_priority_change
        # bind the book to this tree (its index was built with parent_of = node.parent)
        book.alive = lambda n: not n.detached
        book.is_host = lambda n: n.state is HOST
        book.locate = self.locate

    # ================================================================ reads
    def match(self, tokens: Sequence[int], *, record: bool = True) -> PrefixMatch:
        now = self.backend.now()
        self.poll_loads(now)
        path, cached = self.tree.match(tokens, split=True)
        self.clock += 1
        clock = self.clock
        for n in path:
            n.last_access = clock
            self._reindex(n)
        m = self._classify(path, cached, len(tokens))
        if record:
            self._record_match(m, path, now)
        return m

    def status(self, tokens: Sequence[int], *, record: bool = False) -> PrefixStatus:
        now = self.backend.now()
        self.poll_loads(now)
        path, cached = self.tree.match(tokens, split=False)
        m = self._classify(path, cached, len(tokens))
        if record and m.loading:
            for ld in self._path_loads(path):
                self.loads.note_wait(ld, now)
        return m.status

    def peek(self, tokens: Sequence[int]) -> PrefixMatch:
        self.poll_loads(self.backend.now())
        path, cached = self.tree.match(tokens, split=False)
        return self._classify(path, cached, len(tokens))

    def path_loads(self, tokens: Sequence[int]) -> list[Load]:
        """The loads (in flight or landed) that brought ``tokens``' cached path to device."""
        path, _ = self.tree.match(tokens, split=False)
        return self._path_loads(path)

    @staticmethod
    def _path_loads(path: list[TreeNode]) -> list[Load]:
        out: list[Load] = []
        for n in path:
            ld = n.load
            if ld is not None and (not out or out[-1] is not ld) and ld not in out:
                out.append(ld)
        return out

    def locate(self, prefix: tuple) -> TreeNode | None:
        """The node where the page-aligned ``prefix`` ends (split there), None if not cached."""
        path, m = self.tree.match(prefix, split=True)
        return path[-1] if path and m >= len(prefix) else None

    def residency(self, node: TreeNode | None) -> str:
        """``device`` / ``loading`` / ``host`` / ``none`` for the path ending at ``node``."""
        if node is None or node.detached:
            return "none"
        worst = "device"
        n = node
        while n.parent is not None:
            if n.state is HOST:
                return "host"
            if n.state is LOADING:
                worst = "loading"
            n = n.parent
        return worst

    def host_chain(self, node: TreeNode) -> list[TreeNode]:
        """The host-only nodes ending at ``node`` (root side first): what a load must bring."""
        out = []
        n = node
        while n.state is HOST:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def _classify(self, path: list[TreeNode], cached: int, asked: int) -> PrefixMatch:
        device_len, pages, device_node = 0, [], self.tree.root
        loading = needs = False
        readable = True
        for n in path:
            st = n.state
            if readable and (st is DEVICE or st is OFFLOADING):
                device_len += len(n.key)
                pages.extend(n.device_pages)
                device_node = n
                continue
            readable = False
            if st is LOADING:
                loading = True
            elif st is HOST:
                needs = True
            else:
                loading = True  # device node below a loading one: readable once that lands
        if device_len > cached:  # a partially matched last node (status(): no split)
            device_len = cached
            pages = pages[:cached // self.page_size]
        return PrefixMatch(asked, cached, device_len, pages,
                           path[-1] if path else self.tree.root, device_node, loading, needs)

    def _record_match(self, m: PrefixMatch, path: list[TreeNode], now: float) -> None:
        mt = self.metrics
        mt.requests += 1
        mt.hit_tokens_device += m.device_len
        rest = m.cached_len - m.device_len
        if m.needs_load:
            mt.hit_tokens_host += rest
        else:
            mt.hit_tokens_loading += rest
        mt.miss_tokens += m.tokens_len - m.cached_len
        credit = self.loads.credit_use
        for n in path:
            if n.load is not None:
                credit(n.load, now)

    # ================================================================ locking
    def lock(self, target: "PrefixMatch | TreeNode") -> TreeNode:
        node = target.node if isinstance(target, PrefixMatch) else target
        if node.detached:
            raise ValueError("lock: node is no longer in the tree (match again)")
        n = node
        while n.parent is not None:
            n.lock_ref += 1
            if n.lock_ref == 1 and n.state is DEVICE:
                self.evictable -= len(n.device_pages)
                self._ev_sync(n)
            n = n.parent
        return node

    def unlock(self, node: TreeNode) -> None:
        n = node
        while n.parent is not None:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock: node {n.id} is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                if n.state is DEVICE:
                    self.evictable += len(n.device_pages)
                self._reindex(n)
            n = n.parent

    # ================================================================ allocation
    def allocate(self, n_pages: int, *, partial: bool | None = None,
                 reason: str = "alloc") -> list[int] | None:
        """``n_pages`` device pages, evicting by the policy's order when short (None: cannot).
        ``partial``: take only the tail pages needed from the last victim (None: the store's
        ``partial_eviction``), e.g. one decode page must not cost a whole prefix. ``reason``
        labels what it evicts in ``metrics``: ``"alloc"`` (admission), ``"grow"`` (decode)."""
        return self._alloc_device(n_pages, reason, partial=partial)

    def free(self, pages: Sequence[int]) -> None:
        self.device.free(pages)

    def _alloc_device(self, k: int, reason: str, above: float | None = None,
                      partial: bool | None = None) -> list[int] | None:
        if k <= 0:
            return []
        dev = self.device
        if dev.num_free < k and self.policy.evicts:
            if above is None and dev.num_free + self.evictable < k:
                return None  # hopeless: do not evict for nothing
            self._evict_device(k - dev.num_free, reason, above, partial=partial)
        return dev.alloc(k)

    def _alloc_host(self, k: int, for_priority: float) -> list[int] | None:
        if self.host.num_free < k:
            self._flush_backups()  # a host victim may be one whose copy is still pending
            self._evict_host(k - self.host.num_free, for_priority)
        return self.host.alloc(k)

    # ================================================================ insert
    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> TreeNode:
        tree, ps = self.tree, self.page_size
        tokens = tree.aligned(tokens)
        n_pages = len(tokens) // ps
        if len(device_pages) < n_pages:
            raise ValueError(f"insert: {n_pages} pages of tokens but {len(device_pages)} page ids")
        self.clock += 1
        clock = self.clock
        node, i, pi = tree.root, 0, 0
        dup: list[int] = []
        while i < len(tokens):
            child = node.children.get(tree.child_key(tokens, i))
            if child is None:
                new = tree.add_child(node, tokens[i:], DEVICE)
                new.device_pages = list(device_pages[pi:n_pages])
                new.last_access = clock
                node.n_device_children += 1
                self.evictable += len(new.device_pages)
                self._reindex(new)
                node = new
                break
            m = tree.common_len(child.key, tokens, i)
            if m < len(child.key):
                child = tree.split(child, m)
            mp = m // ps
            given = device_pages[pi:pi + mp]
            if child.state is HOST:
                # Fresh KV for an evicted run: adopt it, keep the host copy. It is no load's
                # any more (a read credits no prefetch; an eviction wastes none).
                child.device_pages = list(given)
                child.load = None
                child.set_state(DEVICE)
                self.book.node_tier(child, False)
                node.n_device_children += 1
                if child.lock_ref == 0:
                    self.evictable += mp
            else:
                own = child.device_pages
                dup.extend(p for p, q in zip(given, own) if p != q)
            child.last_access = clock
            self._reindex(child)
            node, i, pi = child, i + m, pi + mp
        if dup:
            self.device.free(dup)
        return node

    # ================================================================ tree hooks
    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        self.index.on_split(upper, lower)
        self._ev_sync(lower)  # its pages are now split with upper (counted by _reindex below)
        if upper.state is LOADING and upper.load is not None:
            upper.load.nodes.append(upper)
        self._reindex(upper)
