"""Unit tests: page pool, radix tree, tier-state transitions, priority index."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow_agents.serving.policy import (IllegalTransition, NodeState, PagePool, PoolError,
                                          PriorityIndex, RadixTree)
from kvflow_agents.serving.policy.tree import TreeNode

INF = float("inf")


# ---------------------------------------------------------------- pages
def test_page_pool_alloc_free_and_double_free():
    pool = PagePool(4)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    assert pool.alloc(2) is None and pool.num_free == 1  # nothing taken on failure
    pool.free(a[:1])
    with pytest.raises(PoolError):
        pool.free(a[:1])
    with pytest.raises(PoolError):
        pool.free([7])
    assert sorted(pool.alloc(2)) == [0, 3]


def test_page_pool_hands_out_neighbouring_pages():
    """Best fit: the smallest free run that holds the request, ascending; freed neighbours merge."""
    pool = PagePool(32)
    a, b, c, d = pool.alloc(8), pool.alloc(4), pool.alloc(8), pool.alloc(4)
    assert a == list(range(8)) and b == list(range(8, 12)) and d == list(range(20, 24))
    pool.free(b)
    pool.free(c[::-1])                         # any order: runs are found after sorting
    assert pool.free_runs() == [(8, 20), (24, 32)]
    assert pool.alloc(6) == list(range(24, 30))  # the 8-page run fits 6 better than the 12
    assert pool.alloc(10) == list(range(8, 18))
    e = pool.alloc(4)                          # no run of 4 left (2 + 2): the longest pieces
    assert e == [18, 19, 30, 31] and pool.num_free == 0 and pool.num_runs == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.integers(0, 10**6)), max_size=60),
       st.booleans())
def test_page_pool_matches_a_set_model(ops, growable):
    """Against a brute-force set of free ids: ids unique and ascending, never handed out twice,
    counts agree, runs sorted/disjoint/non-adjacent and exactly the free ids, and a request
    that some free run holds comes out as one run."""
    pool = PagePool(24, growable=growable)
    free, held = set(range(24)), []
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            cap_before, runs_before = pool.capacity, pool.free_runs()
            got = pool.alloc(n)
            if got is None:
                assert not growable and n > len(free)
                continue
            free |= set(range(cap_before, pool.capacity))   # minted by a growable pool
            assert got == sorted(set(got)) and len(got) == n and set(got) <= free
            if n and any(e - s >= n for s, e in runs_before):
                assert got[-1] - got[0] == n - 1
            free -= set(got)
            held.append(got)
        else:
            pages = held.pop(pick % len(held))
            pool.free(pages)
            if pages:
                with pytest.raises(PoolError):
                    pool.free(pages[:1])
            free |= set(pages)
        assert pool.num_free == len(free) and pool.num_used == pool.capacity - len(free)
        runs = pool.free_runs()
        assert all(s < e for s, e in runs)
        assert all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))  # sorted, apart
        assert {p for s, e in runs for p in range(s, e)} == free


# ---------------------------------------------------------------- transitions
LEGAL = {
    (NodeState.DEVICE, NodeState.OFFLOADING), (NodeState.DEVICE, NodeState.HOST),
    (NodeState.OFFLOADING, NodeState.HOST), (NodeState.HOST, NodeState.LOADING),
    (NodeState.HOST, NodeState.DEVICE), (NodeState.LOADING, NodeState.DEVICE),
}


@pytest.mark.parametrize("src,dst", list(itertools.product(NodeState, NodeState)))
def test_only_legal_transitions(src, dst):
    node = TreeNode((1,), None, src)
    if (src, dst) in LEGAL:
        node.set_state(dst)
        assert node.state is dst
    else:
        with pytest.raises(IllegalTransition):
            node.set_state(dst)
        assert node.state is src


# ---------------------------------------------------------------- tree
def test_tree_match_split_page_aligned():
    tree = RadixTree(page_size=2)
    a = tree.add_child(tree.root, (1, 2, 3, 4, 5, 6), NodeState.DEVICE)
    path, n = tree.match([1, 2, 3, 4, 9, 9, 7])
    assert n == 4 and len(path) == 1 and path[0].key == (1, 2, 3, 4)
    assert path[0].children and a.key == (5, 6) and a.parent is path[0]
    # Partial pages never match: (1,2,3) aligns down to (1,2).
    path, n = tree.match([1, 2, 3])
    assert n == 2 and path[-1].key == (1, 2)
    # no split when asked
    tree2 = RadixTree(page_size=2)
    tree2.add_child(tree2.root, (1, 2, 3, 4), NodeState.DEVICE)
    path, n = tree2.match([1, 2, 5, 5], split=False)
    assert n == 2 and path[-1].key == (1, 2, 3, 4)


@settings(max_examples=200, deadline=None)
@given(ps=st.integers(1, 4), key=st.lists(st.integers(0, 2), min_size=1, max_size=24),
       toks=st.lists(st.integers(0, 2), min_size=0, max_size=24))
def test_common_len_matches_brute_force(ps, key, toks):
    tree = RadixTree(page_size=ps)
    key = tuple(key[:len(key) // ps * ps])
    if not key:
        return
    toks = tuple(toks)
    if tuple(toks[:ps]) != key[:ps]:
        toks = key[:ps] + toks
    want = 0
    while want + ps <= min(len(key), len(toks)) and key[want:want + ps] == toks[want:want + ps]:
        want += ps
    assert tree.common_len(key, toks, 0) == want


@settings(max_examples=200, deadline=None)
@given(step=st.integers(1, 4), a=st.lists(st.integers(0, 2), max_size=24),
       b=st.lists(st.integers(0, 2), max_size=24), hi=st.none() | st.integers(0, 30))
def test_common_prefix_len_matches_brute_force(step, a, b, hi):
    """The one common_prefix_len (tree, boundary inference, tokenizers, SGLang chat hook)."""
    from kvflow_agents.serving.policy import common_prefix_len

    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if hi is not None:
        n = min(n, hi)
    want = n // step * step
    assert common_prefix_len(a, b, hi, step=step) == want
    assert common_prefix_len(tuple(a), list(b), hi, step=step) == want


# ---------------------------------------------------------------- priority index
class N:
    def __init__(self, parent=None):
        self.parent = parent
        self.children = []
        if parent is not None:
            parent.children.append(self)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_priority_is_min_over_subtree_tags(data):
    root = N()
    nodes = [root]
    index = PriorityIndex(lambda n: n.parent)
    changes = []
    index.on_change = lambda n, old, new: changes.append((n, old, new))
    for _ in range(data.draw(st.integers(5, 60))):
        kind = data.draw(st.sampled_from(["add", "split", "tag", "ste", "untag", "drop"]))
        if kind == "add":
            nodes.append(N(data.draw(st.sampled_from(nodes))))
        elif kind == "split" and len(nodes) > 1:
            lower = data.draw(st.sampled_from(nodes[1:]))
            upper = N()
            parent = lower.parent
            parent.children.remove(lower)
            parent.children.append(upper)
            upper.parent = parent
            upper.children = [lower]
            lower.parent = upper
            nodes.append(upper)
            index.on_split(upper, lower)
        elif kind == "tag":
            tag = data.draw(st.integers(0, 8))
            node = data.draw(st.sampled_from(nodes))
            index.set_tag(tag, node, data.draw(st.sampled_from([0, 1, 2, 3, INF])))
        elif kind == "ste":
            index.set_ste(data.draw(st.integers(0, 8)), data.draw(st.sampled_from([0, 1, 2, 5, INF])))
        elif kind == "untag":
            index.remove_tag(data.draw(st.integers(0, 8)))
        elif kind == "drop":
            leaves = [n for n in nodes[1:] if not n.children]
            if leaves:
                leaf = data.draw(st.sampled_from(leaves))
                index.drop_node(leaf)
                leaf.parent.children.remove(leaf)
                nodes.remove(leaf)
        for n in nodes:
            assert index.priority(n) == index.brute_force_priority(n, lambda x: x.children)
            if n.parent is not None:
                assert index.priority(n.parent) <= index.priority(n)
    for n, old, new in changes:
        assert old != new


def test_shared_prefix_takes_min_across_agents_and_workflows():
    root = N()
    shared = N(root)
    a, b = N(shared), N(shared)
    index = PriorityIndex(lambda n: n.parent)
    index.set_tag(("w1", "planner"), a, 3)
    index.set_tag(("w2", "coder"), b, 1)
    assert index.priority(shared) == 1 and index.priority(a) == 3
    index.set_ste(("w2", "coder"), INF)
    assert index.priority(shared) == 3 and index.priority(b) == INF
    assert index.tags_below(shared) == 2


def test_policy_core_imports_only_the_stdlib():
    import ast
    import pathlib
    import sys

    import kvflow_agents.serving.policy as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", (path.name, name)
