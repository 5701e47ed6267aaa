"""STE tags -> node priority, maintained incrementally.

Priority of a node = min STE over the tags (agent fixed-prefix ends) in its subtree, +inf where
there is none (dynamic suffix, outputs). Shared prefixes therefore take the minimum across agents
and workflows, and a parent's priority is always <= each child's.

How it stays cheap (a hint update touching 100 agents must cost < 1 ms on a 100k-node tree):
every node on a path from a tag to the root keeps a small histogram ``{value: count}`` of the
finite values below it: its own tags' STEs and each child's priority. STE values are few and
small (steps), so ``min(hist)`` is a handful of comparisons. Changing one tag walks up only
while the node's minimum actually changes, so the usual update touches a node or two. Nodes with
no finite tag below them hold no entry at all: the index is sized by tags x depth, not by tree.

The index knows nodes only through ``parent_of(node)`` and object identity, so the same code
runs on our :class:`~.tree.TreeNode` or on another engine's tree (SGLang's ``UnifiedTreeNode``):
a thin adapter calls :meth:`set_tag`, :meth:`set_ste`, :meth:`on_split` and :meth:`drop_node`
from that engine's insert/split/evict paths and reads :meth:`priority` in its eviction strategy.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Iterable

INF = math.inf

Node = Any          # anything hashable with a parent relation
Tag = Hashable      # (workflow key, agent)


class PriorityIndex:
    """Tags on nodes, per-tag STE, and the induced subtree-min priority of every node."""

    def __init__(self, parent_of: Callable[[Node], Node | None], *,
                 on_change: Callable[[Node, float, float], None] | None = None) -> None:
        self._parent_of = parent_of
        self.on_change = on_change          # (node, old, new) for nodes whose priority changed
        self._prio: dict[Node, float] = {}  # finite priorities only; absent = +inf
        self._hist: dict[Node, dict[float, int]] = {}
        self._tag_node: dict[Tag, Node] = {}
        self._tag_ste: dict[Tag, float] = {}
        self._node_tags: dict[Node, set] = {}
        self._tags_below: dict[Node, int] = {}  # tags in the subtree, any STE (incl. inf)

    # -- reads -----------------------------------------------------------------------------
    def priority(self, node: Node) -> float:
        return self._prio.get(node, INF)

    def ste(self, tag: Tag) -> float:
        return self._tag_ste.get(tag, INF)

    def node_of(self, tag: Tag) -> Node | None:
        return self._tag_node.get(tag)

    def tags_at(self, node: Node) -> set:
        return self._node_tags.get(node, set())

    def tags_below(self, node: Node) -> int:
        """How many tags (any STE) end in ``node``'s subtree: is it part of some fixed prefix."""
        return self._tags_below.get(node, 0)

    def tags(self) -> Iterable[Tag]:
        return self._tag_node.keys()

    def __contains__(self, tag: Tag) -> bool:
        return tag in self._tag_node

    # -- tag changes -----------------------------------------------------------------------
    def set_tag(self, tag: Tag, node: Node, ste: float = INF) -> None:
        """Tag ``node`` (where the agent's fixed prefix ends); moves the tag if it was elsewhere."""
        old = self._tag_node.get(tag)
        if old is node:
            self.set_ste(tag, ste)
            return
        if old is not None:
            self.remove_tag(tag)
        self._tag_node[tag] = node
        self._tag_ste[tag] = ste
        self._node_tags.setdefault(node, set()).add(tag)
        n = node
        while n is not None:
            self._tags_below[n] = self._tags_below.get(n, 0) + 1
            n = self._parent_of(n)
        self._propagate(node, INF, ste)

    def remove_tag(self, tag: Tag) -> None:
        node = self._tag_node.pop(tag, None)
        if node is None:
            return
        ste = self._tag_ste.pop(tag)
        tags = self._node_tags[node]
        tags.discard(tag)
        if not tags:
            del self._node_tags[node]
        n = node
        while n is not None:
            c = self._tags_below[n] - 1
            if c:
                self._tags_below[n] = c
            else:
                del self._tags_below[n]
            n = self._parent_of(n)
        self._propagate(node, ste, INF)

    def set_ste(self, tag: Tag, ste: float) -> bool:
        """New STE for a tag; returns whether it changed. Unknown tags are ignored."""
        node = self._tag_node.get(tag)
        if node is None:
            return False
        old = self._tag_ste[tag]
        if old == ste:
            return False
        self._tag_ste[tag] = ste
        self._propagate(node, old, ste)
        return True

    # -- structure changes -----------------------------------------------------------------
    def on_split(self, upper: Node, lower: Node) -> None:
        """``upper`` was inserted as ``lower``'s new parent; it sees exactly ``lower``'s subtree."""
        p = self._prio.get(lower)
        if p is not None:
            self._prio[upper] = p
            self._hist[upper] = {p: 1}
        c = self._tags_below.get(lower)
        if c:
            self._tags_below[upper] = c

    def drop_node(self, node: Node) -> None:
        """``node`` leaves the tree (a leaf). Its own tags go with it; returns nothing."""
        for tag in list(self._node_tags.get(node, ())):
            self.remove_tag(tag)
        assert node not in self._hist and node not in self._tags_below, "dropped a non-leaf"

    # -- the incremental core --------------------------------------------------------------
    def _propagate(self, node: Node, old: float, new: float) -> None:
        """Replace one contribution ``old`` by ``new`` in ``node``'s histogram, then walk up
        while the node's minimum changes (the parent sees the child's minimum)."""
        prio, hists, on_change, parent_of = self._prio, self._hist, self.on_change, self._parent_of
        while node is not None and old != new:
            hist = hists.get(node)
            if hist is None:
                hist = hists[node] = {}
            before = prio.get(node, INF)
            if old != INF:
                c = hist[old]
                if c == 1:
                    del hist[old]
                else:
                    hist[old] = c - 1
            if new != INF:
                hist[new] = hist.get(new, 0) + 1
            # The minimum only needs a scan when the old minimum's last copy left.
            if new < before:
                after = new
            elif old != before or before in hist:
                after = before
            elif hist:
                after = min(hist)
            else:
                after = INF
            if after == before:
                return
            if after == INF:
                del hists[node]
                del prio[node]
            else:
                prio[node] = after
            if on_change is not None:
                on_change(node, before, after)
            old, new = before, after
            node = parent_of(node)

    # -- checking --------------------------------------------------------------------------
    def brute_force_priority(self, node: Node, children_of: Callable[[Node], Iterable[Node]]) -> float:
        """Reference: min STE over tags in the subtree, by a full walk (tests only)."""
        best, stack = INF, [node]
        while stack:
            n = stack.pop()
            for t in self._node_tags.get(n, ()):
                best = min(best, self._tag_ste[t])
            stack.extend(children_of(n))
        return best
