"""How much of a victim partial eviction takes: only the pages an allocation needs, at least
``min_evict_pages`` (so a tail reloaded later comes back as one longer run), or the whole node."""

from __future__ import annotations

import pytest
from policy_driver import make_manager, put


def _evict_two_pages_of_a_12_page_prefix(**kw):
    m = make_manager("lru", page_size=1, device_pages=20, host_pages=0, **kw)
    a = list(range(100, 112))
    put(m, a)                                   # 12 pages cached, unlocked
    got = m.allocate(10)                        # 8 free: 2 must come from a
    assert got is not None and len(got) == 10
    m.check_invariants()
    return m, a


@pytest.mark.parametrize("min_pages, kept", [(1, 10), (5, 7), (11, 1), (12, 0), (50, 0)])
def test_partial_eviction_takes_at_least_min_evict_pages(min_pages, kept):
    m, a = _evict_two_pages_of_a_12_page_prefix(min_evict_pages=min_pages)
    assert m.match(a, record=False).device_len == kept   # the head stays a usable prefix
    assert m.store.device.num_free == 20 - 10 - kept      # what was taken beyond need is free


def test_whole_node_eviction_ignores_the_minimum():
    m, a = _evict_two_pages_of_a_12_page_prefix(partial_eviction=False, min_evict_pages=5)
    assert m.match(a, record=False).device_len == 0


def test_min_evict_pages_must_be_positive():
    with pytest.raises(ValueError, match="min_evict_pages"):
        make_manager("lru", device_pages=8, min_evict_pages=0)
