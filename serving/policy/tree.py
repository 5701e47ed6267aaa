"""Radix tree over page-aligned token runs, with per-node tier state.

Each node holds a run of whole pages (``len(key)`` is a multiple of ``page_size``; ``page_size``
may be 1). Children are keyed by their first page of tokens, so a lookup costs one dict probe per
node plus one slice comparison.

Tier state of a node (:class:`NodeState`) and the transitions the policy may make:

    DEVICE ──(write-through starts)──> OFFLOADING ──(copy done)──> HOST
    DEVICE ──(host copy already there)──────────────────────────> HOST
    HOST ──(load starts)──> LOADING ──(ready time passed)──> DEVICE
    HOST ──(insert brings fresh device KV)──> DEVICE
    DEVICE / HOST ──> removed (evicted with no copy left)

Anything else raises :class:`IllegalTransition`. A LOADING node is never evicted (its device
pages are being written); an OFFLOADING node is not a device-eviction candidate, so it cannot be
evicted twice.

Structural invariants (checked by ``inspection.check_invariants``):
- T1: a node with device pages (DEVICE, LOADING, OFFLOADING) has a parent with device pages,
  or the root as parent: a device prefix is always contiguous from the root;
- T2: every non-root node holds device pages, host pages, or both;
- T3: ``lock_ref`` of a node >= sum of the locks taken on paths through it (locks are taken on
  a whole root path), so a locked node's ancestors are locked too;
- T4: ``n_device_children`` equals the number of children holding device pages.
"""

from __future__ import annotations

import enum
import itertools
from typing import Callable, Sequence

from .boundary import common_prefix_len


class NodeState(enum.Enum):
    DEVICE = "device"          # device pages readable (a host backup may exist too)
    HOST = "host"              # host-only backup; device pages freed
    LOADING = "loading"        # host -> device copy in flight
    OFFLOADING = "offloading"  # device -> host copy in flight


class IllegalTransition(RuntimeError):
    """A node state change the tier protocol forbids."""


_LEGAL: dict[NodeState, frozenset[NodeState]] = {
    NodeState.DEVICE: frozenset({NodeState.OFFLOADING, NodeState.HOST}),
    NodeState.OFFLOADING: frozenset({NodeState.HOST}),
    NodeState.HOST: frozenset({NodeState.LOADING, NodeState.DEVICE}),
    NodeState.LOADING: frozenset({NodeState.DEVICE}),
}
DEVICE_HOLDING = frozenset({NodeState.DEVICE, NodeState.LOADING, NodeState.OFFLOADING})

_ids = itertools.count(1)


class TreeNode:
    """One run of pages. ``key`` is a tuple of token ids; page lists are parallel to its pages."""

    __slots__ = (
        "id", "key", "parent", "children", "device_pages", "host_pages", "state", "lock_ref",
        "last_access", "n_device_children", "dev_ver", "host_ver", "load", "detached",
        "__weakref__",
    )

    def __init__(self, key: tuple, parent: "TreeNode | None", state: NodeState) -> None:
        self.id = next(_ids)
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.device_pages: list[int] | None = None
        self.host_pages: list[int] | None = None
        self.state = state
        self.lock_ref = 0
        self.last_access = 0
        self.n_device_children = 0
        self.dev_ver = 0    # version stamps for the lazy eviction heaps
        self.host_ver = 0
        self.load = None    # the in-flight or last Load that brought this node to device
        self.detached = False  # removed from the tree; handles to it are dead

    def set_state(self, new: NodeState) -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalTransition(f"node {self.id}: {self.state.name} -> {new.name}")
        self.state = new

    def path(self) -> list["TreeNode"]:
        """Nodes from the first below the root down to ``self``."""
        out = []
        node = self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, state={self.state.name}, "
                f"lock={self.lock_ref})")


class RadixTree:
    """Structure only: match, split, add and remove nodes. Tier policy lives in the manager.

    ``on_split(upper, lower)`` is called after a split so side indexes (priorities, loads)
    can follow; ``upper`` is the new parent holding the first part of ``lower``'s old key.
    """

    def __init__(self, page_size: int = 1, *,
                 on_split: Callable[[TreeNode, TreeNode], None] | None = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.root = TreeNode((), None, NodeState.DEVICE)
        self.root.lock_ref = 1  # the root is never evicted
        self.on_split = on_split
        self.num_nodes = 0

    # -- keys ------------------------------------------------------------------------------
    def child_key(self, tokens: Sequence[int], i: int):
        ps = self.page_size
        return tokens[i] if ps == 1 else tuple(tokens[i:i + ps])

    def aligned(self, tokens: Sequence[int]) -> tuple:
        t = tuple(tokens)
        return t[:len(t) - len(t) % self.page_size]

    def common_len(self, key: tuple, tokens: tuple, i: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``tokens[i:]``."""
        n = len(key)
        return common_prefix_len(key, tokens[i:i + n], n, step=self.page_size)

    # -- queries ---------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], *, split: bool = True) -> tuple[list[TreeNode], int]:
        """Longest cached page-aligned prefix: (nodes from the root down, matched tokens).

        With ``split`` the last node is split so that it ends exactly at the match, which is
        what locking and tagging need.
        """
        tokens = self.aligned(tokens)
        node, i, path = self.root, 0, []
        n = len(tokens)
        while i < n:
            child = node.children.get(self.child_key(tokens, i))
            if child is None:
                break
            m = self.common_len(child.key, tokens, i)
            if m < len(child.key):
                if not split:
                    path.append(child)
                    i += m
                    break
                child = self.split(child, m)
            path.append(child)
            i += m
            node = child
        return path, i

    # -- mutation --------------------------------------------------------------------------
    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens (page-aligned, 0 < at < len); return the upper part."""
        ps = self.page_size
        assert 0 < at < len(node.key) and at % ps == 0, (at, len(node.key))
        pages_at = at // ps
        upper = TreeNode(node.key[:at], node.parent, node.state)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.load = node.load
        if node.device_pages is not None:
            upper.device_pages = node.device_pages[:pages_at]
            node.device_pages = node.device_pages[pages_at:]
            upper.n_device_children = 1
        if node.host_pages is not None:
            upper.host_pages = node.host_pages[:pages_at]
            node.host_pages = node.host_pages[pages_at:]
        parent = node.parent
        parent.children[self.child_key(upper.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self.child_key(node.key, 0)] = node
        self.num_nodes += 1
        if self.on_split is not None:
            self.on_split(upper, node)
        return upper

    def add_child(self, parent: TreeNode, key: tuple, state: NodeState) -> TreeNode:
        node = TreeNode(key, parent, state)
        parent.children[self.child_key(key, 0)] = node
        self.num_nodes += 1
        return node

    def remove_leaf(self, node: TreeNode) -> None:
        assert not node.children and node.parent is not None
        del node.parent.children[self.child_key(node.key, 0)]
        node.detached = True
        self.num_nodes -= 1

    def iter_nodes(self):
        """All non-root nodes, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
