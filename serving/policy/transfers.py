"""The tiered store's side of host -> device transfers (mixed into :class:`~.store.TieredStore`).

- demand loads (:meth:`Transfers.demand_load`): the host-only part of a match, unless the load
  tracker says recomputing it is cheaper (``should_load``: link queue + transfer + one admission
  delay versus the engine's recompute estimate; past the landing of a load already in flight on
  the same path, which the request waits for either way, only what the load adds), or no
  device room can be made;
- starting a transfer (node states HOST -> LOADING, device pages allocated, the backend asked)
  and landing it when its ready time passes (LOADING -> DEVICE);
- the :class:`~.prefetch.PrefetchTarget` the shared :class:`~.prefetch.Prefetcher` drives:
  host-only page counts, room, and ``start_prefetch`` (eviction restricted to priorities above
  the fetched agent's STE: no thrash, M4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .loads import Load
from .tree import NodeState, TreeNode

if TYPE_CHECKING:  # pragma: no cover
    from .store import PrefixMatch

DEVICE, HOST, LOADING = NodeState.DEVICE, NodeState.HOST, NodeState.LOADING


class Transfers:
    """Loads on a :class:`~.store.TieredStore` (module doc)."""

    # ================================================================ loads
    def load_on_demand(self, match: "PrefixMatch", *, recompute_s: float | None = None) -> float | None:
        """Load the host-only part of ``match``'s path; returns when the whole matched prefix
        is readable (backend clock), or None: no device room, or recomputing is cheaper (the
        estimate is ``recompute_s`` or the tracker's :meth:`~LoadTracker.recompute_s`)."""
        ready, _ = self.demand_load(match, recompute_s=recompute_s)
        return ready

    def demand_load(self, match: "PrefixMatch", *, recompute_s: float | None = None
                    ) -> tuple[float | None, str]:
        """``load_on_demand`` with the reason: ``"loading"`` / ``"ready"``, or (None)
        ``"recompute"`` (cheaper than waiting for the link) / ``"no_room"``."""
        now = self.backend.now()
        self.poll_loads(now)
        node = match.node
        if node.detached:
            raise ValueError("load_on_demand: node left the tree (match again)")
        path = node.path()
        ready = now
        host_nodes = []
        for n in path:
            if n.state is HOST:
                host_nodes.append(n)
            elif n.state is LOADING and n.load is not None:
                ready = max(ready, n.load.ready)
        if not host_nodes or not self.policy.host_tier:
            return ready, ("loading" if ready > now else "ready")
        k = sum(len(n.host_pages) for n in host_nodes)
        loads = self.loads
        if recompute_s is None and loads.has_recompute_estimate:
            ctx = 0
            for n in path:
                if n is host_nodes[0]:
                    break
                ctx += len(n.key)
            recompute_s = loads.recompute_cost_s(k * self.page_size, ctx)
        if not loads.should_load(k, recompute_s, now, ready_anyway=ready):
            self.metrics.loads_declined += 1
            self.metrics.declined_pages += k
            return None, "recompute"  # recomputing the host part is cheaper than waiting
        self.lock(node)
        try:
            ld = self.start_load(host_nodes, "demand", "load", None, now)
        finally:
            self.unlock(node)
        if ld is None:
            return None, "no_room"
        loads.note_demand(ld, now)
        ready = max(ready, ld.ready)
        return ready, ("loading" if ready > self.backend.now() else "ready")

    def start_load(self, host_nodes: list[TreeNode], kind: str, reason: str,
                   above: float | None, now: float, tag=None) -> Load | None:
        k = sum(len(n.host_pages) for n in host_nodes)
        dp = self._alloc_device(k, reason, above)
        if dp is None:
            return None
        try:  # the backend first: a copy that cannot start leaves no node LOADING for ever
            ready = self.backend.start_load([p for n in host_nodes for p in n.host_pages], dp)
        except Exception:
            self.device.free(dp)
            raise
        i = 0
        for n in host_nodes:
            m = len(n.host_pages)
            n.device_pages = dp[i:i + m]
            i += m
            n.set_state(LOADING)
            self.book.node_tier(n, False)
            n.parent.n_device_children += 1
        ld = self.loads.start(host_nodes, k, kind, now, ready=ready, tag=tag)
        for n in host_nodes:
            n.load = ld
        if ready <= now:
            self.poll_loads(now)
        return ld

    def poll_loads(self, now: float) -> int:
        """Land the loads whose ready time passed; returns how many."""
        done = 0
        for ld in self.loads.due(now):
            for n in ld.nodes:
                if n.state is LOADING and not n.detached:
                    n.set_state(DEVICE)
                    if n.lock_ref == 0:
                        self.evictable += len(n.device_pages)
                    self._reindex(n)
            done += 1
        return done

    # ================================================================ prefetch target
    @property
    def evicts(self) -> bool:
        return self.policy.evicts

    def host_pages(self, node: TreeNode) -> int:
        if node.detached or node.state is not HOST:
            return 0
        return sum(len(n.host_pages) for n in self.host_chain(node))

    def free_pages(self) -> int:
        return self.device.num_free

    def evictable_pages(self) -> int:
        return self.evictable

    def _head_of(self, tag, host_nodes: list, max_pages: int):
        """Split ``tag``'s host-only path after ``max_pages`` pages (fewer than it has) and
        return the node ending there, or ``None``."""
        ps = self.page_size
        tokens = self.book.records[tag].tokens
        host_tokens = sum(len(n.key) for n in host_nodes)
        start = len(tokens) - host_tokens
        cut = start + min(max_pages, host_tokens // ps - 1) * ps
        if cut <= start:
            return None
        path, m = self.tree.match(tokens[:cut], split=True)
        if m < cut or not path or path[-1].state is not HOST:
            return None
        return path[-1]

    def start_prefetch(self, c, now: float, max_pages: int | None = None) -> Load | None:
        """Load the host-only part of candidate ``c``'s path; with ``max_pages`` only its head
        (the path is split after that many pages; ``None`` if not one whole page fits)."""
        node = c.node
        host_nodes = self.host_chain(node)
        if max_pages is not None:
            node = self._head_of(c.tag, host_nodes, max_pages)
            if node is None:
                return None
            host_nodes = self.host_chain(node)
        self.lock(node)
        try:
            ld = self.start_load(host_nodes, "prefetch", "prefetch", c.ste, now, c.tag)
        finally:
            self.unlock(node)
        if ld is not None:
            self.clock += 1  # just fetched: newest among equal priorities (LRU tie-break)
            for x in host_nodes:
                x.last_access = self.clock
                self._reindex(x)  # (a no-op while LOADING; an instant load landed already)
        return ld
