"""Lazy decode pages (``KVCacheManager(lazy_decode=True)``): admission allocates a request's
prompt pages and reserves the rest of ``kv_tokens``; ``grow`` allocates them as decoding
reaches them. Meanwhile the reserved pages hold cache (S1: every running reserve stays
coverable by free + evictable pages), a growth evicts only the tail pages it needs, waiting
sessions' pins give way to it, and it waits a step for a load in flight."""

from __future__ import annotations

import random

import pytest

from policy_driver import hint, make_manager, put, to_host


def test_admit_takes_the_prompt_pages_and_grow_the_rest_page_by_page():
    m = make_manager("kvflow", page_size=2, device_pages=16, host_pages=32, lazy_decode=True)
    s = m.arrive(list(range(6)), hint("A", {"A": 0}), kv_tokens=14)   # 3 prompt + 4 decode pages
    assert s.poll().ready and s.admit()
    assert (len(s.pages), s.decode_reserved, m.decode_reserved, m.device.num_used) == (3, 4, 4, 3)
    s.commit()
    assert s.grow(6) and len(s.pages) == 3          # token 5 is in the prompt's last page
    assert s.grow(7) and len(s.pages) == 4 and s.decode_reserved == 3
    m.check_invariants()                            # S2: pages + reserve == kv_tokens' pages
    assert s.grow(14) and len(s.pages) == 7 and m.decode_reserved == 0
    with pytest.raises(ValueError):
        s.grow(15)                                   # past what it was admitted for
    s.finish(list(range(14)), 13)
    assert m.decode_reserved == 0 and m.device.num_used == 6   # 12 tokens cached (6 pages)
    m.check_invariants()


def test_upfront_allocation_is_unchanged_without_the_flag():
    m = make_manager("kvflow", page_size=2, device_pages=16, host_pages=32)
    s = m.arrive(list(range(6)), hint("A", {"A": 0}), kv_tokens=14)
    assert s.poll().ready and s.admit()
    assert (len(s.pages), s.decode_reserved) == (7, 0)
    assert s.grow(14)                                # a no-op: the pages are there
    m.check_invariants()


@pytest.mark.parametrize("lazy", [True, False])
def test_the_unwritten_reserve_holds_the_next_agents_prefetch(lazy):
    """14 pages; A runs with 6 prompt + 6 decode pages; B (next, STE 1) has 4 pages on host.
    Allocated upfront, A leaves 2 free pages: no room for B. Lazily B is prefetched into A's
    reserve; when A writes its tokens, the growth evicts B's tail only (the store evicts
    whole nodes otherwise), so B keeps its head on device."""
    m = make_manager("kvflow", page_size=1, device_pages=14, host_pages=64, lazy_decode=lazy,
                     partial_eviction=False)
    b = [7] * 4
    to_host(m, b, "B")
    a = m.arrive(list(range(100, 106)), hint("A", {"A": 0, "B": 1}), kv_tokens=12)
    assert a.poll().ready and a.admit()
    a.commit()
    m.tick()
    assert m.agent_residency("w", "B") == ("device" if lazy else "host")
    for n in range(7, 13):                           # A decodes its 6 tokens
        assert a.grow(n)
        m.check_invariants()
    if lazy:  # 2 free pages, then 2 of B's 4 evicted (its tail; back to host)
        p = m.peek(b + [8])
        assert (p.device_len, p.cached_len) == (2, 4)
        assert m.metrics.prefetch_issued == 1
        # what evicted B's tail is labelled: a decode page's growth, not an admission
        # the growth's evictions are labelled as such; B's head stays to be read: not wasted
        assert m.metrics.evicted_pages["device:grow"] == 2
        assert m.metrics.prefetch_evicted_pages == 2 and m.metrics.prefetch_wasted == 0
        assert m.match(b + [8]).device_len == 2 and m.metrics.prefetch_used == 1
    a.finish(a.tokens + list(range(6)), 11)
    m.check_invariants()


def test_prefetch_reserve_counts_a_waiting_reserve_and_each_growing_next_page():
    """A prefetch's pages are not evictable while it loads, so it must not take what a waiting
    request needs to be admitted: its prompt pages and its decode reserve (else the request
    waits for the load to land); and a running request's next decode page."""
    m = make_manager("kvflow", page_size=1, device_pages=32, host_pages=64, lazy_decode=True)
    w = m.arrive(list(range(100, 106)), hint("A", {"A": 0}), kv_tokens=12)
    assert m.reserved_pages == 12                     # 6 to allocate + 6 to reserve
    assert w.poll().ready and w.admit()
    assert m.reserved_pages == 1                      # running, growing: its next page
    assert w.grow(12) and m.reserved_pages == 0      # nothing left to grow
    w.finish(w.tokens + [1] * 6, 11)
    m.check_invariants()


def test_admission_keeps_every_running_reserve_coverable():
    m = make_manager("lru", page_size=1, device_pages=16, host_pages=0, lazy_decode=True)
    a = m.arrive([1] * 4, kv_tokens=12)
    assert a.poll().ready and a.admit()               # 4 pages now, 8 reserved
    big = m.arrive([2] * 4, kv_tokens=8)
    big.poll()
    assert not big.admit()                            # 12 free - 8 reserved < 4 + 4
    small = m.arrive([3] * 2, kv_tokens=4)
    small.poll()
    assert small.admit()                              # 2 + 2 fit exactly
    assert a.grow(12) and small.grow(4)               # both reserves are there to take
    assert m.device.num_free == 0
    m.check_invariants()


def test_growth_unpins_waiting_sessions():
    m = make_manager("lru", page_size=1, device_pages=8, host_pages=0, lazy_decode=True)
    a = m.arrive([1, 1], kv_tokens=6)
    assert a.poll().ready and a.admit()               # 2 pages, 4 reserved
    put(m, [5] * 4)                                   # cache that a finished request left
    w = m.arrive([5] * 4 + [6], kv_tokens=5)
    w.poll()                                          # pins [5]*4: free 2 + evictable 0 < 4
    assert a.grow(6) and len(a.pages) == 6
    assert not w.looked                               # its pin gave way; it looks again later
    assert m.peek([5] * 4).device_len == 2            # only the tail pages needed went
    m.check_invariants()


def test_growth_waits_for_a_load_in_flight_that_holds_the_room():
    m = make_manager("kvflow", page_size=1, device_pages=8, host_pages=64, lazy_decode=True,
                     link=1.0)                        # 1 page per second
    to_host(m, [7] * 4, "B")
    a = m.arrive([1, 1], hint("A", {"A": 0, "B": 1}), kv_tokens=8)
    assert a.poll().ready and a.admit()               # 2 pages, 6 reserved
    a.commit()
    assert m.tick().prefetches_started == [("w", "B")]  # 4 of the 6 free pages, loading
    assert a.grow(4)                                  # the 2 free pages
    assert not a.grow(5)                              # the rest is B's load: next step
    assert m.metrics.decode_page_waits == 1
    m.clock.t = 10.0
    m.tick()
    assert a.grow(8) and m.peek([7] * 4 + [8]).device_len == 0
    m.check_invariants()


def test_random_traffic_never_leaves_a_growth_without_pages():
    """An engine-like driver: three workflows each cycling through five agents (whose prefixes
    do not all fit), random dynamic parts and output lengths, hints from the cycle: every
    growth is met (S1), prefetches run, and the invariants hold after every step."""
    rng = random.Random(7)
    m = make_manager("kvflow", page_size=2, device_pages=28, host_pages=200, lazy_decode=True)
    n_agents = 5
    prefixes = [[100 + i] * rng.choice([8, 10, 12]) for i in range(n_agents)]
    nxt = {f"w{k}": 0 for k in range(3)}                # each workflow's next agent
    busy: set = set()
    waiting, running, grown = [], [], 0
    for step in range(600):
        idle = sorted(set(nxt) - busy)
        if idle and rng.random() < 0.3:
            wf = rng.choice(idle)
            i = nxt[wf]
            prompt = prefixes[i] + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 5))]
            ste = {f"a{j}": (j - i) % n_agents for j in range(n_agents)}
            out = rng.randint(1, 12)
            s = m.arrive(prompt, hint(f"a{i}", ste, wf=wf, step=step),
                         fixed_len=len(prefixes[i]), kv_tokens=len(prompt) + out)
            waiting.append((s, out, wf))
            busy.add(wf)
        m.tick()
        for item in list(waiting):
            s, out, wf = item
            if not s.poll().ready:
                continue
            if not s.admit():
                break                                 # no overtaking
            s.commit()
            waiting.remove(item)
            running.append([s, out, len(s.tokens), wf])
        for r in list(running):
            s, out, n, wf = r
            if n < len(s.tokens) + out - 1:
                assert s.grow(n + 1)                  # never short: instant link, S1
                r[2], grown = n + 1, grown + 1
            else:
                s.finish(s.tokens + [1] * out, n)
                running.remove(r)
                busy.discard(wf)
                nxt[wf] = (nxt[wf] + 1) % n_agents
        m.check_invariants(priorities=False)
    assert grown > 300 and m.metrics.prefetch_issued > 10


# -- optimistic reserve (decode_reserve < 1) and retraction ----------------------------------

def test_an_optimistic_reserve_admits_what_a_full_one_keeps_waiting():
    """16 pages. A (4 prompt + 8 decode pages) runs; B (4 + 4) fits beside it only if A's
    reserve is half its decode pages, as SGLang's new_token_ratio reserves."""
    full = make_manager("lru", page_size=1, device_pages=16, host_pages=0, lazy_decode=True)
    half = make_manager("lru", page_size=1, device_pages=16, host_pages=0, lazy_decode=True,
                        decode_reserve=0.5)
    for m, fits in ((full, False), (half, True)):
        a = m.arrive([1] * 4, kv_tokens=12)
        assert a.poll().ready and a.admit()
        assert a.decode_reserved == (8 if m is full else 4)
        b = m.arrive([2] * 4, kv_tokens=8)
        b.poll()
        assert b.admit() is fits
        m.check_invariants()


def _grow_until_short(s, n):
    while s.grow(n + 1):
        n += 1
    return n


def test_growth_past_the_reserve_takes_only_what_other_reserves_spare_then_retracts():
    m = make_manager("lru", page_size=1, device_pages=16, host_pages=0, lazy_decode=True,
                     decode_reserve=0.5)
    a = m.arrive([1] * 4, kv_tokens=12)                 # 4 pages + 4 reserved
    assert a.poll().ready and a.admit()
    a.commit()
    b = m.arrive([2] * 4, kv_tokens=8)                  # 4 pages + 2 reserved
    assert b.poll().ready and b.admit()
    b.commit()
    requests = m.metrics.requests
    # A writes past its reserve while 8 pages are free: it may take 6, never B's 2 reserved
    n = _grow_until_short(a, 4)
    assert n == 14 - 4 and len(a.pages) == 10 and a.needs_room and b.decode_reserved == 2
    m.check_invariants()
    assert b.grow(6)                                     # B's reserve is there to take
    assert not b.grow(7) and b.needs_room                # past it: nothing left to spare
    # the engine retracts one of them (the newest optimistic; here A, to free B's room)
    a.retract(a.tokens + [9] * 6, 10)
    assert a.state == "waiting" and a.full_reserve and not a.pages and a.tokens == [1] * 4 + [9] * 6
    assert m.metrics.retractions == 1 and m.decode_reserved == 0
    assert m.peek(a.tokens).device_len == 10             # what it wrote stays cached, unpinned
    m.check_invariants()
    assert b.grow(8) and not b.needs_room                # by evicting A's cached tail
    b.finish(b.tokens + [3] * 4, 7)
    # re-admitted: no hit counted twice; it reuses its cached tokens and reserves all the rest
    cached = m.peek(a.tokens).device_len
    assert 0 < cached < 10
    assert a.poll().ready and a.admit()
    assert m.metrics.requests == requests and a.prompt_reused == 0 and a.device_hit == 0
    assert a.reused == cached and len(a.pages) == 10 and a.decode_reserved == 2
    m.check_invariants()
    assert a.grow(12) and not a.needs_room
    a.finish(a.tokens + [9, 9], 11)
    m.check_invariants()


def test_retract_needs_what_was_admitted_written():
    m = make_manager("lru", page_size=1, device_pages=16, host_pages=0, lazy_decode=True,
                     decode_reserve=0.5)
    a = m.arrive([1] * 4, kv_tokens=12)
    assert a.poll().ready and a.admit()
    with pytest.raises(ValueError):
        a.retract([1] * 4, 3)                              # not even its prompt
    with pytest.raises(ValueError):
        make_manager("lru", device_pages=4, lazy_decode=True, decode_reserve=0)


def test_random_traffic_with_an_optimistic_reserve_retracts_and_finishes_everything():
    """The engine's rule on random traffic: growth past a reserve that finds no room retracts
    the newest running optimistic session; a retracted one comes back with its whole reserve.
    Every request finishes with all its tokens, retractions happen, invariants hold."""
    rng = random.Random(11)
    m = make_manager("kvflow", page_size=2, device_pages=40, host_pages=200, lazy_decode=True,
                     decode_reserve=0.25)
    waiting, running, done, retracted = [], [], 0, 0
    for step in range(3000):
        if len(waiting) + len(running) < 6 and rng.random() < 0.3 and step < 2000:
            prompt = [100 + step % 3] * 6 + [rng.randrange(1000, 2000) for _ in range(4)]
            out = rng.randint(4, 20)
            s = m.arrive(prompt, hint(f"a{step % 3}", {f"a{step % 3}": 0}, wf=f"w{step}"),
                         kv_tokens=len(prompt) + out)
            waiting.append([s, len(prompt) + out - 1])
        m.tick()
        for item in sorted(waiting, key=lambda it: it[0].admission_key):
            s, _ = item
            if not s.poll().ready:
                continue
            if not s.admit():
                break
            s.commit()
            waiting.remove(item)
            running.append([s, item[1], len(s.tokens)])
        for r in list(running):
            s, end, n = r
            if s.state != "admitted":
                continue
            if n >= end:
                s.finish(s.tokens + [1] * (end - len(s.tokens)), n)
                running.remove(r)
                done += 1
            elif s.grow(n + 1):
                r[2] = n + 1
            else:
                assert s.needs_room
                victim = next(v for v in reversed(running)
                              if v[0].state == "admitted" and not v[0].full_reserve)
                vs, vend, vn = victim
                vs.retract(vs.tokens + [1] * (vn - len(vs.tokens)), vn)
                running.remove(victim)
                waiting.append([vs, vend])
                retracted += 1
        m.check_invariants(priorities=False)
    assert not waiting and not running and done > 100 and retracted > 5
    assert m.metrics.retractions == retracted
