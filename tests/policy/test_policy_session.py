"""The per-request session (``manager.arrive`` -> ``poll`` -> ``admit`` -> ``commit`` ->
``finish``): the one protocol the embedded engine, the simulator and the conformance suite
drive. Readiness states with their reasons, pinning, the deadlock breaker, the prefetch
reserve taken from waiting sessions, load-wait accounting, the admission-delay charge."""

from __future__ import annotations

import pytest

from kvflow_agents.serving.policy import CacheFullError, Readiness
from policy_driver import hint, make_manager, put, to_host

READY, LOADING, NEEDS_LOAD, RECOMPUTE = (Readiness.READY, Readiness.LOADING,
                                         Readiness.NEEDS_LOAD, Readiness.RECOMPUTE)


def test_full_protocol_tags_caches_and_frees():
    m = make_manager("kvflow", page_size=2, device_pages=16, host_pages=32)
    prompt = list(range(10, 22))                       # 12 tokens: 8 fixed + 4 dynamic
    s = m.arrive(prompt, hint("A", {"A": 0, "B": 1}), fixed_len=8, kv_tokens=16)
    p = s.poll()
    assert (p.state, p.reason, p.ready) == (READY, "no_cache", True)
    assert s.admit() and len(s.pages) == 8 and s.reused == 0
    s.commit()
    assert m.agent_residency("w", "A") == "device" and m.fixed_prefix_len("w", "A") == 8
    s.finish(prompt + [1, 2, 3], 14)
    assert m.device.num_used == 7                       # 14 tokens cached, the rest freed
    # the same agent again: its prefix is a device hit, reused at admission
    s2 = m.arrive(list(range(10, 18)) + [90, 91, 92, 93], hint("A", {"A": 0}), fixed_len=8,
                  kv_tokens=12)
    assert s2.poll().reason == "cached" and s2.admit()
    assert (s2.device_hit, s2.host_hit, s2.reused) == (8, 0, 8)
    s2.finish(s2.tokens, 12)
    assert not m.waiting_sessions and not m.admitted_sessions
    m.check_invariants()


def test_host_prefix_loads_on_poll_then_ready_and_wait_is_measured():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0)
    to_host(m, [5] * 4, "A")
    s = m.arrive([5] * 4 + [6], hint("A", {"A": 0}), fixed_len=4)
    p = s.poll()
    assert (p.state, p.reason) == (LOADING, "demand_load") and p.ready_at == pytest.approx(4.0)
    assert (s.device_hit, s.host_hit) == (0, 4)
    assert s.poll().state is LOADING                    # still in flight
    m.clock.t = 4.0
    assert s.poll().state is READY and s.load_wait_s == pytest.approx(4.0)
    assert s.admit() and s.reused == 4
    s.finish(s.tokens, 5)
    assert m.metrics.demand_loads == 1
    m.check_invariants()


def test_start_load_false_leaves_the_choice_and_inline_load_reuses_the_host_part():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0)
    to_host(m, [5] * 4, "A")
    s = m.arrive([5] * 4 + [6], hint("A", {"A": 0}), fixed_len=4)
    p = s.poll(start_load=False)
    assert (p.state, p.reason, p.cached_len, p.device_len) == (NEEDS_LOAD, "host_only", 4, 0)
    assert s.admit(load_inline=True)                    # the batch waits for it instead
    assert s.reused == 4 and s.ready_at == pytest.approx(4.0)


def test_a_loading_prefix_admitted_inline_lands_layer_by_layer_and_credits_what_its_prefill_hid():
    """Layer-wise overlap: a request admitted while its demand load is in flight reads layer
    i of its prefix at ``link_start + (i + 1) / L`` of the transfer; of the load's rest after
    admission, what the prefill did not wait for moves from exposed to hidden, once per load,
    and the waits are the request's load wait."""
    m = make_manager("hicache", page_size=1, device_pages=16, host_pages=64, link=1.0)
    to_host(m, [5] * 4, "A")
    s = m.arrive([5] * 4 + [6], None)
    assert s.poll().state is LOADING                    # 4 pages on the link: 0 .. 4 s
    assert m.metrics.load_exposed_s == pytest.approx(4.0)  # a demand load: charged from its start
    m.clock.t = 1.0
    assert s.admit(load_inline=True) and s.reused == 4 and s.ready_at == pytest.approx(4.0)
    assert s.layer_ready_times(4) == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert s.layer_ready_times(2) == pytest.approx([2.0, 4.0])
    # a second reader admitted inline on the same load: its prefill waits too
    s2 = m.arrive([5] * 4 + [7], None)
    assert s2.poll().state is LOADING and s2.admit(load_inline=True)
    m.clock.t = 4.0                                     # the prefill computed 1-2.5 s and 3-3.5 s
    s.overlapped([(2.5, 3.0), (3.5, 4.0)])
    assert s.load_wait_s == pytest.approx(1.0 + 1.0)    # skipped 0-1 s, then two layer waits
    assert m.metrics.load_hidden_s == pytest.approx(2.0)  # 3 s left at admission, 1 s waited
    assert m.metrics.load_exposed_s == pytest.approx(2.0)
    assert s.layer_ready_times(4) is None               # landed: nothing left to wait for
    s2.overlapped([])
    assert m.metrics.load_hidden_s == pytest.approx(2.0)  # credited once per load
    for x in (s, s2):
        x.commit()
        x.finish(x.tokens, 5)
    assert m.store.match([5] * 4).device_len == 4       # landed in the tree before the commits
    m.check_invariants()


def test_inline_admission_keeps_the_loading_part_when_the_host_rest_is_recomputed():
    """A prefix whose head is loading (another request's demand load) and whose rest is
    host-only: admitted inline with the rest cheaper to recompute, the request still reuses
    the loading head (it lands layer by layer under its prefill), not just what is on device."""
    m = make_manager("hicache", page_size=1, device_pages=16, host_pages=64, link=1.0)
    head, rest = [5] * 4, [7] * 4
    put(m, head)
    put(m, head + rest)                                 # two nodes: head, then rest
    held = m.allocate(m.device.num_free + m.evictable_device_pages)
    m.free(held)                                        # both pushed to host
    first = m.arrive(head + [9], None)
    assert first.poll().state is LOADING                # loads the head: 0 .. 4 s
    s = m.arrive(head + rest + [8], None)
    p = s.poll(start_load=False)
    assert p.state is LOADING and (p.device_len, p.cached_len) == (0, 8)
    assert s.admit(load_inline=True, recompute_s=0.0)   # the rest: cheaper to recompute
    assert s.reused == 4 and s.ready_at == pytest.approx(4.0)
    assert s.layer_ready_times(2) == pytest.approx([2.0, 4.0])
    m.clock.t = 4.0
    s.overlapped([(0.0, 4.0)])
    s.commit()
    s.finish(s.tokens, len(s.tokens))
    m.check_invariants()


def test_credit_overlap_moves_no_more_than_the_load_was_charged():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0)
    to_host(m, [5] * 4, "A")
    s = m.arrive([5] * 4 + [6], None)
    s.poll()
    (ld,) = m.store.path_loads([5] * 4)
    ld.exposed_s = 0.5                                  # as if a prefetch charged only its tail
    m.metrics.load_exposed_s = 0.5
    assert m.loads.credit_overlap(ld, 0.0, []) == pytest.approx(0.5)
    assert m.metrics.load_exposed_s == pytest.approx(0.0)
    assert m.loads.credit_overlap(ld, 0.0, []) == 0.0


def test_recompute_when_the_link_is_slower_than_prefill_plus_one_step():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64, link=1.0,
                     recompute_s_per_token=1.5)        # loading 4 pages: 4 s; recompute: 6 s
    to_host(m, [5] * 4, "A")
    s = m.arrive([5] * 4 + [6], hint("A", {"A": 0}), fixed_len=4)
    assert s.poll().state is LOADING                    # 4 s <= 6 s: load
    m.clock.t = 10.0
    s.admit()
    s.finish(s.tokens, 5)
    to_host(m, [7] * 4, "B")
    m.observe_step(30.0)                                # a loaded request waits a step more
    assert m.loads.admission_delay_s == pytest.approx(3.0)
    s = m.arrive([7] * 4 + [8], hint("B", {"B": 0}), fixed_len=4)
    p = s.poll()                                        # 4 s + 3 s > 6 s: recompute
    assert (p.state, p.reason) == (RECOMPUTE, "cheaper") and p.ready
    assert s.admit() and s.reused == 0 and s.load_wait_s == 0.0
    assert m.metrics.loads_declined == 1


def test_waiting_sessions_are_the_prefetch_reserve():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64)
    to_host(m, [10] * 4, "B")
    put(m, [50] * 12)                                  # +inf leftovers fill the device
    assert m.device.num_free == 4
    s = m.arrive(list(range(100, 114)), hint("A", {"A": 0, "B": 1}), kv_tokens=14)
    assert m.reserved_pages == 14                      # nothing of it cached
    # B's prefetch would take room A's admission needs: 4 free + 12 evictable - 14 < 4
    assert m.tick().prefetches_started == [] and m.metrics.prefetch_budget_skips == 1
    s.finish()                                         # the request went away (abort)
    assert m.reserved_pages == 0
    assert m.tick().prefetches_started == [("w", "B")]
    m.check_invariants()


def test_agent_with_its_own_request_waiting_is_not_prefetched():
    m = make_manager("kvflow", page_size=1, device_pages=16, host_pages=64)
    to_host(m, [10] * 4, "A")
    s = m.arrive([10] * 4 + [11], hint("A", {"A": 0}), fixed_len=4)
    assert m.tick().prefetches_started == []            # A's own request decides
    assert s.poll().state is READY                      # instant link: its demand load
    assert m.metrics.demand_loads == 1 and m.metrics.prefetch_issued == 0
    s.admit()
    s.finish(s.tokens, 5)
    to_host(m, [10] * 4, "A")
    m.update_hints("w", {"A": 1})                       # no request of A waiting: prefetch
    assert m.metrics.prefetch_issued == 1


def test_deadlock_breaker_unpins_other_waiters_then_cache_full():
    m = make_manager("lru", page_size=1, device_pages=8, host_pages=0)
    put(m, [1] * 4)
    put(m, [2] * 4)
    waiter = m.arrive([2] * 4 + [3], kv_tokens=5)
    waiter.poll()                                       # pins [2]*4
    big = m.arrive([9] * 7, kv_tokens=7)
    big.poll()
    assert big.admit()                                  # [1]*4 evicted, then the breaker
    assert not waiter.looked                            # ... unpinned the waiter's prefix
    waiter.poll()                                       # it looks again, not counted twice
    assert m.metrics.requests == 2 and waiter.device_hit == 4
    huge = m.arrive([7] * 20, kv_tokens=20)
    huge.poll()
    big.finish(big.tokens, 7)
    with pytest.raises(CacheFullError):
        huge.admit()


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_deadlock_breaker_unpins_other_waiters_for_a_demand_load(policy):
    """A request whose host-only prefix finds no device room while nothing runs and nothing
    loads: the room is held by other waiting requests' pins, which only admission would
    release. An engine that makes it wait for its load (head-of-line) would wait forever (a
    kvflow server without the status-aware skip hung for minutes in the fan-out bench); the
    manager unpins the other waiters, as for an admission."""
    m = make_manager(policy, page_size=1, device_pages=8, host_pages=32, link=1.0)
    to_host(m, [5] * 6, "A")
    put(m, [2] * 4)
    waiter = m.arrive([2] * 4 + [3], kv_tokens=5)
    assert waiter.poll().ready                          # pins [2]*4: 4 pages left
    head = m.arrive([5] * 6 + [6], hint("A", {"A": 0}), fixed_len=6, kv_tokens=7)
    p = head.poll()                                     # 6 pages to load
    assert (p.state, p.reason, p.ready_at) == (LOADING, "demand_load", pytest.approx(6.0))
    assert not waiter.looked and m.metrics.demand_loads == 1
    m.clock.t = 6.0
    assert head.poll().ready and head.admit() and head.reused == 6
    m.check_invariants()


def test_waiters_keep_their_pins_while_a_request_runs():
    """The breaker above is for a stuck engine only: a running request will free its pages."""
    m = make_manager("kvflow", page_size=1, device_pages=8, host_pages=32, link=1.0)
    to_host(m, [5] * 6, "A")
    put(m, [2] * 4)
    running = m.arrive([9] * 3, kv_tokens=3)
    assert running.poll().ready and running.admit()
    waiter = m.arrive([2] * 4 + [3], kv_tokens=5)
    waiter.poll()
    head = m.arrive([5] * 6 + [6], hint("A", {"A": 0}), fixed_len=6, kv_tokens=7)
    assert head.poll().reason == "no_room" and waiter.looked
    running.finish(running.tokens, 3)                   # its 3 pages stay cached: 4 < 6
    assert head.poll().state is LOADING and not waiter.looked  # now nothing runs: the breaker


def test_finish_before_admission_and_twice_is_harmless():
    m = make_manager("kvflow", page_size=1, device_pages=8, host_pages=8)
    s = m.arrive([1, 2, 3], hint("A", {"A": 0}))
    s.poll()
    s.finish()
    s.finish()
    assert not m.waiting_sessions and m.tick().prefetches_started == []
    with pytest.raises(RuntimeError):
        s.poll()
    m.check_invariants()


def test_a_host_rest_below_a_loading_head_is_queued_behind_it_at_once():
    """A partial prefetch brought A's head (3 of 6 pages) and left the rest on host. A's request
    arrives while the head is in flight: the rest is queued behind it now (all of the prefix is
    coming, so the engine may overlap it with the prefill), before the prefetch of the agent
    after A takes the link: 3 s past the head against a 4.5 s recompute. Left until the head
    landed, the rest queued behind B's prefetch too (6 s) and was recomputed (as the last two
    pages of the expresser's prompt were on AutoGen PEER, bench/RESULTS.md 6.57)."""
    for queue_now in (True, False):
        m = make_manager("kvflow", page_size=1, device_pages=32, host_pages=64, link=1.0,
                         recompute_s_per_token=1.5, recompute_stalls=lambda: 0)
        to_host(m, [5] * 6, "A")
        to_host(m, [7] * 6, "B")
        head = m.load_on_demand(m.match([5] * 3))       # the head: 3 s on the link
        assert head == pytest.approx(3.0)
        s = m.arrive([5] * 6 + [6], hint("A", {"A": 0, "B": 1}), fixed_len=6)
        p = s.poll(start_load=queue_now)                 # (False: the rule before, a look only)
        assert p.state is LOADING and p.host_rest is (not queue_now)
        m.update_hints("w", {"A": 0, "B": 1})            # B's prefetch wants the link now
        m.clock.t = 3.0                                  # the head lands
        p = s.poll()
        if queue_now:                                    # the rest is loaded, not recomputed
            assert p.state in (READY, LOADING) and m.metrics.loads_declined == 0
            assert m.metrics.demand_loads == 2
            m.clock.t = 6.0
            assert s.poll().state is READY and s.admit() and s.reused == 6
        else:                                            # 3 s for B + 3 s > 4.5 s: recompute
            assert p.state is RECOMPUTE and m.metrics.loads_declined == 1
            assert s.admit() and s.reused == 3
        m.check_invariants()
