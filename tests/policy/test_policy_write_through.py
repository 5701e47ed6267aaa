"""Write-through under pressure on both tiers: the bytes follow the tree.

A shadow backend holds, per page, the token whose KV an engine would have written there, and
applies the policy's copies in order. Every prefix a request finds on device must then hold
its own tokens, whatever was evicted, backed up, dropped from host or loaded back meanwhile.
It also checks what the embedded pool's one-call batches rely on: no host page is written
twice, and no device page read twice, by one ``backup_to_host`` call (the store sends one per
eviction pass; a gathered copy with a repeated destination has no defined winner)."""

from __future__ import annotations

import random

import pytest

from kvflow_agents.serving.policy import KVCacheManager
from policy_driver import VirtualClock


class ShadowBackend:
    def __init__(self, clock) -> None:
        self.clock = clock
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.backup_calls = self.backup_pages = 0

    def now(self) -> float:
        return self.clock()

    def backup_to_host(self, device_pages, host_pages) -> None:
        assert len(device_pages) == len(host_pages)
        assert len(set(host_pages)) == len(host_pages), "a host page written twice in one call"
        assert len(set(device_pages)) == len(device_pages)
        for d, h in zip(device_pages, host_pages):
            self.host[h] = self.device[d]
        self.backup_calls += 1
        self.backup_pages += len(device_pages)

    def start_load(self, host_pages, device_pages) -> float:
        for h, d in zip(host_pages, device_pages):
            self.device[d] = self.host[h]
        return self.clock()


def serve_writing(m: KVCacheManager, backend: ShadowBackend, tokens, fixed: int, agent: str) -> bool:
    """One request as an engine serves it: load what is on host, check what it reads, write
    the KV of the rest into fresh pages, insert, tag."""
    pm = m.match(tokens)
    if pm.needs_load:
        m.load_on_demand(pm)
        m.tick(m.clock.t)  # (no link: landed)
        pm = m.match(tokens, record=False)
    got = [backend.device[p] for p in pm.device_pages]
    assert got == tokens[:len(got)], "device KV of another prompt"
    handle = m.lock(pm)
    pages = m.allocate(len(tokens) - len(pm.device_pages))
    if pages is None:
        m.unlock(handle)
        return False
    for p, t in zip(pages, tokens[len(pm.device_pages):]):
        backend.device[p] = t
    m.insert(tokens, pm.device_pages + pages)
    m.unlock(handle)
    m.tag_fixed_prefix(tokens, fixed, "w", agent)
    return True


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_prefixes_found_on_device_hold_their_own_tokens(policy):
    clock = VirtualClock()
    backend = ShadowBackend(clock)
    # a host tier smaller than some passes' write-throughs: a pass's later victim evicts an
    # earlier one's host copy (found only so: without the flush before a host eviction, a
    # host page is written twice in one call)
    m = KVCacheManager(policy, page_size=1, device_pages=40, host_pages=12, backend=backend)
    m.clock = clock
    rng = random.Random(7)
    prefixes = [[a * 100 + i for i in range(rng.randint(6, 14))] for a in range(10)]
    for _ in range(600):
        a = rng.randrange(len(prefixes))
        tokens = prefixes[a] + [10_000 + rng.randrange(3) for _ in range(rng.randint(1, 4))]
        clock.t += 1.0
        serve_writing(m, backend, tokens, len(prefixes[a]), f"agent{a}")
    # both tiers overflowed, and passes wrote several victims through in one call
    ev = m.metrics.evictions
    host_evictions = sum(n for r, n in ev.items() if r.startswith("host:"))
    device_evictions = sum(n for r, n in ev.items() if r.startswith("device:"))
    assert host_evictions > 20 and m.metrics.hit_tokens_host > 0, dict(ev)
    assert 0 < backend.backup_calls < device_evictions
    assert backend.backup_pages == m.metrics.backup_pages


class FailingLoads(ShadowBackend):
    """A backend whose next ``fail`` loads raise (a broken tier, a pinned staging buffer the
    device could not allocate)."""

    fail = 0

    def start_load(self, host_pages, device_pages) -> float:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("copy engine gone")
        return super().start_load(host_pages, device_pages)


def first_prompt_on_host(policy: str, backend_cls):
    """A manager over ``backend_cls`` that served two 16-token prompts in a 24-page pool: the
    second evicted the first to host. Returns (manager, backend, clock, first prompt)."""
    clock = VirtualClock()
    backend = backend_cls(clock)
    m = KVCacheManager(policy, page_size=1, device_pages=24, host_pages=64, backend=backend)
    m.clock = clock
    first, second = list(range(100, 116)), list(range(200, 216))
    for tokens, agent in ((first, "a"), (second, "b")):
        clock.t += 1.0
        assert serve_writing(m, backend, tokens, len(tokens), agent)
    return m, backend, clock, first


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_a_load_that_cannot_start_leaves_the_prefix_on_host(policy):
    """The error reaches the caller (the engine fails that request) and the store is as before
    the attempt: the prefix still host-only, not LOADING for ever (requests waiting on it hung),
    its device pages free again; the next load of it works and reads its own tokens."""
    m, backend, clock, first = first_prompt_on_host(policy, FailingLoads)
    pm = m.match(first)
    assert pm.needs_load
    backend.fail = 1
    with pytest.raises(RuntimeError, match="copy engine gone"):
        m.load_on_demand(pm)
    m.check_invariants()               # (page accounting: the allocated pages went back)
    pm = m.match(first, record=False)
    assert pm.needs_load and not pm.loading
    clock.t += 1.0
    assert serve_writing(m, backend, first, len(first), "a")   # loads it, checks its tokens
    assert m.match(first, record=False).device_pages


class FailingBackups(ShadowBackend):
    """A backend whose next ``fail`` write-throughs raise."""

    fail = 0

    def backup_to_host(self, device_pages, host_pages) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("host tier gone")
        super().backup_to_host(device_pages, host_pages)


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_a_write_through_that_fails_leaves_no_host_copy_to_find(policy):
    """The eviction pass has already given the victims' device pages back when their backup
    fails: the host pages hold nothing, so the victims leave the tree (a later request
    recomputes them) instead of being found there and loaded as another prompt's KV."""
    clock = VirtualClock()
    backend = FailingBackups(clock)
    m = KVCacheManager(policy, page_size=1, device_pages=24, host_pages=64, backend=backend)
    m.clock = clock
    first, second = list(range(100, 116)), list(range(200, 216))
    assert serve_writing(m, backend, first, len(first), "a")
    clock.t += 1.0
    backend.fail = 1
    backed_up = m.metrics.backup_pages
    with pytest.raises(RuntimeError, match="host tier gone"):
        m.allocate(len(second))                           # evicts part of the first prompt
    m.check_invariants()
    pm = m.match(first, record=False)
    assert not pm.needs_load and pm.cached_len == len(pm.device_pages) < len(first)
    assert m.metrics.dropped_pages == len(first) - pm.cached_len
    assert m.metrics.backup_pages == backed_up            # none of them was written
    for tokens, agent in ((second, "b"), (first, "a"), (second, "b"), (first, "a")):
        clock.t += 1.0                                    # each checks the KV it reads
        assert serve_writing(m, backend, tokens, len(tokens), agent)
    assert m.metrics.hit_tokens_host > 0                  # write-through works again


class SlowLink(ShadowBackend):
    """Loads land 5 s after they start (an emulated link)."""

    def start_load(self, host_pages, device_pages) -> float:
        return super().start_load(host_pages, device_pages) + 5.0


@pytest.mark.parametrize("policy", ["hicache", "kvflow"])
def test_discard_all_forgets_every_prefix_without_copying_one(policy):
    """What the engine does when its KV bytes can no longer be trusted (a copy failed on its
    copy thread): every prefix goes, device, host and loading alike, and none is written
    through to host on its way out (the copy would carry the bad bytes)."""
    m, backend, clock, first = first_prompt_on_host(policy, SlowLink)
    second = list(range(200, 216))
    pm = m.match(first)
    m.load_on_demand(pm)                                  # lands at t + 5: in flight
    assert m.match(first, record=False).loading
    calls = backend.backup_calls
    m.discard_all()
    m.check_invariants()
    assert backend.backup_calls == calls
    assert m.device.num_used == 0 and m.host.num_used == 0
    for tokens in (first, second):
        assert m.match(tokens, record=False).cached_len == 0
    clock.t += 1.0
    assert serve_writing(m, backend, first, len(first), "a")   # serves on from an empty cache
