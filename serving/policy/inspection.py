"""Inspection: the JSON-able snapshot every engine shows (``/kvflow/v1/cache``) and the
structural invariant check the tests run.

:func:`agents_view` / :func:`workflows_view` read only the tag book, so SGLang's plugin builds
its snapshot from them over its own tree (passing its ``residency``); :func:`snapshot` and
:func:`check_invariants` cover a :class:`~.manager.KVCacheManager` (our tree and pools).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .tree import DEVICE_HOLDING, NodeState

INF = math.inf
DEVICE, HOST, LOADING = NodeState.DEVICE, NodeState.HOST, NodeState.LOADING


def _num(x):
    return None if x == INF else x


def agents_view(book, residency: Callable[[Any], str],
                tokens_of: Callable[[Any], int] | None = None) -> list[dict]:
    """Per tag: workflow, agent, fixed-prefix tokens, residency, STE and node priority
    (``None`` = infinity), demoted by a client cap. Sorted by (workflow, agent)."""
    out = []
    index = book.index
    for tag, rec in sorted(book.records.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        node = rec.node
        if node is not None and not book.alive(node):
            node = None
        out.append({
            "workflow": tag[0], "agent": tag[1],
            "tokens": tokens_of(rec) if tokens_of is not None else len(rec.tokens),
            "residency": residency(node),
            "ste": _num(index.ste(tag)) if node is not None else _num(book.effective_ste(tag)),
            "priority": _num(index.priority(node)) if node is not None else None,
            "demoted": tag in book.demoted,
        })
    return out


def workflows_view(hints) -> dict:
    return {wf: {"expired": w.expired, "step": w.step, "step_s": w.step_s, "client": w.client,
                 "trusted": w.trusted, "trust": round(w.trust, 3), "predictions": w.scored,
                 "mispredicted": w.missed}
            for wf, w in hints.workflows.items()}


def snapshot(mgr) -> dict:
    store = mgr.store
    tree_dev = tree_host = 0
    for n in store.tree.iter_nodes():
        tree_dev += len(n.device_pages) if n.device_pages is not None else 0
        tree_host += len(n.host_pages) if n.host_pages is not None else 0
    dev, host = store.device, store.host
    return {
        "policy": mgr.policy.name,
        "admission": mgr.admission.order,
        "page_size": mgr.page_size,
        "nodes": store.tree.num_nodes,
        "pools": {
            "device": {"capacity": dev.capacity, "used": dev.num_used, "free": dev.num_free,
                       "tree": tree_dev, "evictable": store.evictable,
                       "reserved": mgr.decode_reserved},  # running requests' decode pages to come
            "host": {"capacity": host.capacity, "used": host.num_used, "free": host.num_free,
                     "tree": tree_host},
        },
        "loads_in_flight": mgr.loads.in_flight,
        "workflows": workflows_view(mgr.tags.hints),
        "agents": agents_view(mgr.tags, store.residency),
        "gaps": mgr.gaps.as_dict(),
        "metrics": mgr.metrics.as_dict(),
    }


def check_invariants(mgr, *, priorities: bool = True) -> None:
    """Assert every structural invariant (tests; O(nodes), O(nodes x depth) with priorities):
    the tree's T1-T4, the store's M1-M2, the book's B1-B3, the tracker's L1, the sessions' S2."""
    store, book, loads = mgr.store, mgr.tags, mgr.loads
    tree, index, ps = store.tree, book.index, store.page_size
    for ste in (0, 1, 2, math.inf):  # the memoised prefetch budget equals a fresh count
        fresh = sum(len(n.device_pages) for n in tree.iter_nodes()
                    if n.state is DEVICE and n.lock_ref == 0 and index.priority(n) > ste)
        assert store.evictable_above(ste) == fresh, (ste, fresh)
    dev_seen: set[int] = set()
    host_seen: set[int] = set()
    evictable = 0
    for n in tree.iter_nodes():
        assert not n.detached, n
        assert len(n.key) % ps == 0 and len(n.key) > 0, n
        pages = len(n.key) // ps
        assert n.device_pages is not None or n.host_pages is not None, f"T2 {n}"
        assert n.lock_ref >= 0
        assert n.parent.lock_ref >= n.lock_ref or n.parent is tree.root, f"T3 {n}"
        if n.state in DEVICE_HOLDING:
            assert n.device_pages is not None and len(n.device_pages) == pages, n
            assert n.parent.parent is None or n.parent.device_pages is not None, f"T1 {n}"
        else:
            assert n.device_pages is None, n
        if n.state is HOST:
            assert n.host_pages is not None, n
        if n.state is LOADING:
            assert n.load is not None and not n.load.done and n in n.load.nodes, n
        if n.host_pages is not None:
            assert len(n.host_pages) == pages
            assert mgr.policy.host_tier, "host copy under a device-only policy"
            for p in n.host_pages:
                assert store.host.is_allocated(p) and p not in host_seen, p
                host_seen.add(p)
        if n.device_pages is not None:
            for p in n.device_pages:
                assert store.device.is_allocated(p) and p not in dev_seen, p
                dev_seen.add(p)
        assert n.n_device_children == sum(
            1 for c in n.children.values() if c.device_pages is not None), f"T4 {n}"
        if n.state is DEVICE and n.lock_ref == 0:
            evictable += pages
        if priorities:
            want = index.brute_force_priority(n, lambda x: x.children.values())
            assert index.priority(n) == want, (n, index.priority(n), want)
    assert tree.root.n_device_children == sum(
        1 for c in tree.root.children.values() if c.device_pages is not None)
    assert evictable == store.evictable, (evictable, store.evictable)
    if mgr.policy.evicts:
        assert store.device.num_used <= store.device.capacity
    assert store.host.num_used == len(host_seen), "host page leak"
    for tag, rec in book.records.items():
        if rec.node is not None:
            assert not rec.node.detached and index.node_of(tag) is rec.node, f"B1 {tag}"
        on_host = rec.node is not None and rec.node.state is HOST
        assert on_host == (tag in book.host_tags), ("B2 host-tag set out of sync", tag)
        assert (book.effective_ste(tag) <= book.lookahead) == (tag in book.near), f"B3 {tag}"
    for s in mgr.admitted_sessions:  # S2: a running session's pages + reserve cover kv_tokens
        assert s.decode_reserved >= 0 and (not s.decode_reserved or mgr.lazy_decode), s
        total = max(1, -(-s.kv_tokens // ps))
        if mgr.decode_reserve >= 1 or s.full_reserve:
            assert len(s.pages) + s.decode_reserved == total, "S2"
        else:  # optimistic: the reserve may cover only part of the rest
            assert len(s.pages) + s.decode_reserved <= total, "S2"
    assert loads.inflight_prefetch == sum(
        1 for ld in loads.inflight_loads() if ld.kind == "prefetch"), "L1"
