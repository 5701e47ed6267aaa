"""Eviction for the tiered store: lazy heaps per tier, write-through, subtree removal.

:class:`Evictor` is mixed into :class:`~.store.TieredStore` and works on its fields (``tree``,
``device``, ``host``, ``policy``, ``index``, ``book``, ``loads``, ``metrics``, ``backend``,
``evictable``, ``on_evict``, ``partial_eviction``). The order is the policy's
``eviction_key(priority, last_access)`` (smallest first, as SGLang's ``EvictionStrategy``);
both heaps hold stale entries that die lazily (each carries the version it was pushed with),
so a priority change costs one push instead of a heap rebuild.

- device victims: unlocked DEVICE nodes with no device child (M2); evicting one writes it
  through to host when the policy wants a copy (``should_backup``), else drops it; with
  ``above`` (a prefetch for an agent of that STE) nothing of priority <= ``above`` goes (M4);
- host victims: unlocked HOST leaves, or host copies of DEVICE nodes; the policy may refuse
  to drop a copy more urgent than the one being written (``host_victim_allowed``).
"""

from __future__ import annotations

import heapq

from .tree import NodeState, TreeNode

DEVICE, HOST, OFFLOADING = NodeState.DEVICE, NodeState.HOST, NodeState.OFFLOADING


class Evictor:
    """Eviction heaps and victims of a :class:`~.store.TieredStore` (module doc)."""

    def _init_eviction(self) -> None:
        self._dev_heap: list = []
        self._host_heap: list = []
        self.state_ver = 0                 # bumped on any node state / priority change
        # evictable_above's counts: unlocked DEVICE node -> (priority, pages) it is counted
        # under, and pages per priority (few distinct values: steps, +inf)
        self._ev_of: dict[TreeNode, tuple[float, int]] = {}
        self._ev_by_prio: dict[float, int] = {}
        self.evict_floor: float | None = None  # set while a prefetch evicts (tests check M4)
        # write-throughs of the eviction pass under way: one backend call per pass (a pass
        # evicts several nodes, most a few pages; each call is a copy-thread submit)
        self._backups: list[tuple[TreeNode, list[int], list[int]]] = []  # (victim, device, host)

    # ------------------------------------------------------------------ candidates
    def dev_candidate(self, n: TreeNode) -> bool:
        return (n.state is DEVICE and n.lock_ref == 0 and n.n_device_children == 0
                and not n.detached)

    def host_candidate(self, n: TreeNode) -> bool:
        if n.detached or n.host_pages is None:
            return False
        if n.state is HOST:
            return n.lock_ref == 0 and not n.children
        return n.state is DEVICE

    def evictable_above(self, ste: float) -> int:
        """Pages in unlocked device-resident nodes whose priority is strictly larger than
        ``ste`` (what a prefetch for an agent of that STE may evict). O(distinct priorities):
        a deferred prefetch re-checks its budget on every tick, i.e. every decode step, and
        walking the tree there cost ~1 % of the engine thread with 8 workflows. Kept by
        :meth:`_ev_sync` wherever a node's state, lock, pages or priority change;
        ``inspection.check_invariants`` compares it with a fresh count."""
        return sum(k for p, k in self._ev_by_prio.items() if p > ste)

    def _ev_sync(self, n: TreeNode) -> None:
        """Re-count ``n`` in :meth:`evictable_above` (a no-op when nothing it counts changed)."""
        want = None
        if n.state is DEVICE and n.lock_ref == 0 and not n.detached and n.device_pages:
            want = (self.index.priority(n), len(n.device_pages))
        have = self._ev_of.get(n)
        if have == want:
            return
        by = self._ev_by_prio
        if have is not None:
            p, k = have
            if by[p] == k:
                del by[p]
            else:
                by[p] -= k
            del self._ev_of[n]
        if want is not None:
            p, k = want
            by[p] = by.get(p, 0) + k
            self._ev_of[n] = want

    # ------------------------------------------------------------------ heaps
    def _reindex(self, n: TreeNode) -> None:
        """(Re)enter ``n`` in the eviction heaps it is a candidate for, with its current key."""
        self.state_ver += 1
        if n.parent is None:
            return
        self._ev_sync(n)
        dev = self.dev_candidate(n)
        host = self.host_candidate(n)
        if not (dev or host):
            return
        key = self.policy.eviction_key(self.index.priority(n), n.last_access)
        if dev:
            n.dev_ver += 1
            heapq.heappush(self._dev_heap, (key, n.id, n.dev_ver, n))
        if host:
            n.host_ver += 1
            heapq.heappush(self._host_heap, (key, n.id, n.host_ver, n))
        limit = 2 * self.tree.num_nodes + 4096
        if len(self._dev_heap) > limit:
            self._dev_heap = [e for e in self._dev_heap
                              if e[2] == e[3].dev_ver and self.dev_candidate(e[3])]
            heapq.heapify(self._dev_heap)
        if len(self._host_heap) > limit:
            self._host_heap = [e for e in self._host_heap
                               if e[2] == e[3].host_ver and self.host_candidate(e[3])]
            heapq.heapify(self._host_heap)

    def _on_priority_change(self, node: TreeNode, old: float, new: float) -> None:
        self.state_ver += 1
        self._ev_sync(node)
        # Only candidates need a new heap entry; most tagged nodes have device children.
        if self.policy.uses_priority and (node.n_device_children == 0 or node.host_pages is not None):
            self._reindex(node)

    def _pop(self, heap: list, dev: bool) -> TreeNode | None:
        check = self.dev_candidate if dev else self.host_candidate
        while heap:
            _, _, ver, n = heapq.heappop(heap)
            if ver == (n.dev_ver if dev else n.host_ver) and check(n):
                return n
        return None

    # ------------------------------------------------------------------ device
    def _evict_device(self, need: int, reason: str, above: float | None = None,
                      partial: bool | None = None, write_through: bool = True) -> int:
        """Free >= ``need`` device pages (best effort). With ``above``, only nodes whose
        priority is strictly larger than ``above`` may go (prefetch: no thrash). ``partial``
        overrides ``partial_eviction`` (split the last victim, its head stays); without
        ``write_through`` no victim is copied to host (its KV is not to be kept)."""
        split = self.partial_eviction if partial is None else partial
        freed = 0
        index = self.index
        self.evict_floor = above
        try:
            while freed < need:
                n = self._pop(self._dev_heap, True)
                if n is None:
                    break
                prio = index.priority(n)
                if above is not None and prio <= above:
                    self._reindex(n)
                    break
                rest = need - freed
                if split and len(n.device_pages) > rest:
                    # Evict only the tail that is needed; the head stays a usable prefix.
                    self.tree.split(n, (len(n.device_pages) - rest) * self.page_size)
                freed += self._evict_device_node(n, prio, reason, write_through)
        finally:
            self.evict_floor = None
            self._flush_backups()
        return freed

    def _flush_backups(self) -> None:
        """Write the pass's victims through to host in one backend call. Before the pages are
        handed out again: the caller allocates the freed device pages after the pass, and
        ``_alloc_host`` flushes before it evicts host copies (one of this pass's, whose
        host pages could otherwise be written twice in one call)."""
        if not self._backups:
            return
        batch, self._backups = self._backups, []
        try:
            self.backend.backup_to_host([p for _, dev, _ in batch for p in dev],
                                        [p for _, _, host in batch for p in host])
        except Exception:  # the host pages hold no copy: no request may find one there
            for n, _, host in batch:
                self.metrics.backup_pages -= len(host)  # (counted when queued)
                if not n.detached and n.host_pages is host and n.device_pages is None:
                    self.metrics.dropped_pages += len(host)
                    parent = n.parent
                    self._remove_subtree(n)
                    self._reindex(parent)
            raise

    def _evict_device_node(self, n: TreeNode, prio: float, reason: str,
                           write_through: bool = True) -> int:
        if self.on_evict is not None:
            self.on_evict(n, "device", prio, reason)
        pages = n.device_pages
        k = len(pages)
        pol = self.policy
        if (write_through and n.host_pages is None and pol.host_tier
                and pol.should_backup(prio, self.index.tags_below(n))):
            hp = self._alloc_host(k, prio)
            if hp is not None and not n.detached:
                n.set_state(OFFLOADING)
                n.host_pages = hp
                self._backups.append((n, pages, hp))  # copied at the end of the pass
                self.metrics.backup_pages += k
            elif hp is not None:
                self.host.free(hp)
        parent = n.parent
        self.evictable -= k
        n.device_pages = None
        self._ev_sync(n)
        parent.n_device_children -= 1
        self.device.free(pages)
        self.metrics.evicted("device:" + reason, k)
        ld = n.load
        if ld is not None and ld.kind == "prefetch" and not ld.used:
            self.metrics.prefetch_evicted_pages += k
            if not self._head_on_device(n, ld):
                self.loads.mark_wasted(ld, reason)  # nothing of it is left for a request to read
        if n.host_pages is not None:
            n.set_state(HOST)
            self.book.node_tier(n, True)
            self._reindex(n)
        else:
            self.metrics.dropped_pages += k
            self._remove_subtree(n)
        self._reindex(parent)
        return k

    @staticmethod
    def _head_on_device(n: TreeNode, ld) -> bool:
        """Part of load ``ld`` above ``n`` is still on device (``n`` is a tail split off by a
        partial eviction, or the deeper end of a loaded chain): a request may still read it.
        Victims are leaves of the device tree, so what is left of a chain is above ``n``."""
        p = n.parent
        while p is not None and p.load is ld:
            if p.device_pages is not None:
                return True
            p = p.parent
        return False

    def flush(self, *, write_through: bool = True) -> tuple[int, int]:
        """Drop every unlocked cached prefix, device then host, as SGLang's ``/flush_cache``.
        Returns ``(device_pages, host_pages)`` freed; locked nodes and loads in flight stay.
        ``write_through=False``: no device victim is first copied to host (the engine's reset
        after a failed copy: no KV it holds may be read again)."""
        dev = self._evict_device(self.device.num_used, "flush", write_through=write_through)
        host = self._evict_host(self.host.num_used, float("-inf")) if self.host.capacity else 0
        return dev, host

    # ------------------------------------------------------------------ host
    def _evict_host(self, need: int, for_priority: float) -> int:
        freed = 0
        pol, index = self.policy, self.index
        while freed < need:
            n = self._pop(self._host_heap, False)
            if n is None:
                break
            prio = index.priority(n)
            if not pol.host_victim_allowed(prio, for_priority):
                self._reindex(n)
                break
            if self.on_evict is not None:
                self.on_evict(n, "host", prio, "backup")
            hp = n.host_pages
            n.host_pages = None
            self.host.free(hp)
            freed += len(hp)
            self.metrics.evicted("host:backup", len(hp))
            if n.state is HOST:
                parent = n.parent
                self._remove_subtree(n)
                self._reindex(parent)
        return freed

    def _remove_subtree(self, root: TreeNode) -> None:
        """Drop ``root`` and everything below it (all host-only or copy-less) from the tree."""
        order, stack = [], [root]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children first: parent links stay valid for the index
            self.book.node_removed(n)
            self.index.drop_node(n)
            if n.host_pages is not None:
                self.host.free(n.host_pages)
                n.host_pages = None
            if n.device_pages is not None:  # cannot happen for a candidate; defensive
                raise AssertionError(f"removing node {n.id} that still holds device pages")
            self.tree.remove_leaf(n)
