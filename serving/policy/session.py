"""One request's conversation with the cache: the protocol every engine drives the same way.

Like vLLM's scheduler talking to its ``KVCacheManager`` through ``KVCacheBlocks``, an engine never
walks tree nodes; it holds a :class:`RequestSession` per request::

    s = manager.arrive(prompt_ids, hints, fixed_len=L, kv_tokens=len(prompt) + max_new)
    p = s.poll()              # each scheduler step while it waits: READY / LOADING / ...
    if p.ready and s.admit(): # device pages for the whole request (lazy: the prompt's): s.pages
        ...prefill with s.pages, reusing the first s.reused tokens...
        s.commit()            # the prompt's KV joins the tree; the agent's fixed prefix is tagged
        ...decode (lazy: s.grow(n) before a step writes token n - 1)...
    s.finish(seq, written)    # what was written joins the tree; own pages freed; unpinned

A running session whose growth finds no room (``grow`` False with ``needs_room``) is retracted
by its engine: ``s.retract(seq, written)`` puts what it wrote in the tree, frees its own pages and
returns it to waiting with ``tokens = seq[:written]`` (the engine prefills them again, mostly
from the cache, and decodes on).

``poll`` answers a :class:`Poll` whose ``state`` is a :class:`Readiness`:

- READY: the cached prefix is readable (or nothing is cached): admit now;
- LOADING: a load (a prefetch, or this request's demand load) is in flight on its prefix (a
  host-only rest below a prefetched head is queued behind it at once); a status-aware engine
  skips it (the wait is recorded: exposed load time) and polls again, or admits it now with
  ``admit(load_inline=True)``, overlapping the load with its prefill layer by layer as SGLang's
  HiCache does: ``layer_ready_times(L)`` says when each layer is readable, ``overlapped(waits)``
  records what the prefill waited (and credits what it hid);
- NEEDS_LOAD: a host-only part is not loading: ``poll(start_load=False)`` leaves the choice to
  the engine (``load()`` now, or ``admit(load_inline=True)`` to overlap it with its own
  prefill), or a started load found no device room (``reason="no_room"``: poll again);
- RECOMPUTE: a host-only part will be recomputed (the load tracker found that cheaper than
  waiting for the link, one admission delay included): admit now.

The session pins (locks) its matched path from the first look until it finishes, so nothing
it matched, nor a load started for it, is evicted while it waits. If the device is then too
full for a waiting request's admission or demand load while nothing runs and nothing loads,
the manager unpins the other waiting sessions (they look again later; their pins would
otherwise hold the room until admission, which may wait for this request); if an admission
still does not fit, ``admit`` raises :class:`CacheFullError`.

Decode pages (``KVCacheManager(lazy_decode=True)``, as SGLang and vLLM allocate them): ``admit``
allocates the prompt's pages and *reserves* the rest of ``kv_tokens`` (``decode_reserved``);
``grow`` allocates them page by page as decoding reaches them. Until then the reserved pages
hold cache (a prefetch for the next agent, say) instead of sitting empty: a request with
``max_tokens=240`` that writes 60 tokens leaves 11 of its 15 decode pages to the cache.
Invariant (S1): an admission needs ``free + evictable - reserved of all running sessions >=
its pages + its reserve`` (``manager.room_for``), so a running request's growth *within its
reserve* can always be met by evicting unlocked cache, once waiting sessions' pins are dropped
and loads in flight have landed (``grow`` does the first and answers False for the second:
decode it next step).

Optimistic reserve (``KVCacheManager(decode_reserve=r)``, r < 1; SGLang's ``new_token_ratio``):
admission reserves ``ceil(r x`` the decode pages ``max_tokens`` allows ``)``, as most replies stop
well short (PEER's executors write ~130 of 240; at r = 1 the third of three waited 3-16 s).
Growth past it takes pages only where ``room_for`` leaves every other running reserve coverable
(S1 holds for reserves); else ``grow`` answers False with ``needs_room`` and the engine retracts
a running optimistic session, the newest first (vLLM's preemption by recompute), re-admitted
with its whole remaining reserve (``full_reserve``): never retracted twice, no livelock.

The first look records hit counters (``match(record=True)``); the session's ``device_hit`` /
``host_hit`` say where its reused tokens were when it arrived, ``loads_read`` the loads this
request was the first to read, ``load_wait_s`` how long it waited for loads.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .tree import NodeState

if TYPE_CHECKING:  # pragma: no cover
    from .manager import KVCacheManager


class Readiness(enum.Enum):
    READY = "ready"
    LOADING = "loading"
    NEEDS_LOAD = "needs_load"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Poll:
    state: Readiness
    reason: str                  # "cached", "no_cache", "in_flight", "host_only", "no_room", "cheaper"
    ready_at: float | None = None  # LOADING: when the loads on its prefix land (backend clock)
    device_len: int = 0          # tokens readable on device now
    cached_len: int = 0          # tokens cached in any tier
    host_rest: bool = False      # LOADING: below what is in flight, some is host-only, unloaded

    @property
    def ready(self) -> bool:
        """Admit now (READY or RECOMPUTE)."""
        return self.state is Readiness.READY or self.state is Readiness.RECOMPUTE


class CacheFullError(RuntimeError):
    """The request cannot get device pages even with nothing else holding any."""


class RequestSession:
    """See the module docstring. Created by :meth:`KVCacheManager.arrive`.

    States: waiting -> admitted -> finished, and admitted -> waiting (``retract``)."""

    def __init__(self, manager: "KVCacheManager", tokens: Sequence[int], hints: Any = None, *,
                 fixed_len: int | None = None, kv_tokens: int | None = None) -> None:
        self._mgr = manager
        self.tokens = list(tokens)
        self.hints = hints
        self.fixed_len = fixed_len
        self.kv_tokens = max(len(self.tokens), kv_tokens or 0)
        self.state = "waiting"           # -> admitted -> finished (admitted -> waiting: retract)
        self.tag = None                  # (workflow key, agent) of its hints
        self.admission_key: tuple = ()   # engines try the smallest first (manager.admission)
        self.handle = None               # lock handle (the deepest matched node)
        self.device_hit = self.host_hit = 0
        self.recompute_host = False
        self.pages: list[int] = []
        self.decode_reserved = 0         # lazy decode: admitted pages not allocated yet (grow)
        self.own_from = 0                # pages[own_from:] are the request's, not the tree's
        self.reused = 0                  # tokens taken from the cache at (the last) admission
        self.prompt_reused = 0           # ... at the first admission: what the client's prompt got
        self.needs_room = False          # the last grow found no room past the reserve
        self.retractions = 0             # after one it reserves all of kv_tokens (full_reserve)
        self.ready_at: float | None = None  # an inline load lands then (admit(load_inline=True))
        self.inline_loads: list = []     # ... the loads on its reused prefix then in flight
        self.admitted_at: float | None = None
        self.loads_read, self.load_wait_s = [], 0.0  # the loads it read first; its wait for loads
        self._wait_since: float | None = None
        self._tagged = self._counted = False  # fixed prefix tagged; hit counters recorded (once)
        self.written: list[int] = []     # at finish: the tokens it left in the tree (prompt + output)

    @property
    def workflow(self):
        """Its hints' workflow key (:func:`~.hints.workflow_key`); None without hints."""
        return self.tag[0] if self.tag is not None else None

    # ------------------------------------------------------------------ waiting
    @property
    def looked(self) -> bool:
        return self.handle is not None

    def poll(self, *, start_load: bool = True) -> Poll:
        if self.state != "waiting":
            raise RuntimeError(f"poll: session is {self.state}")
        store = self._mgr.store
        if self.handle is None:  # first look: hit counters, pin the matched path
            m = store.match(self.tokens, record=not self._counted)
            self.handle = store.lock(m)
            if not self._counted:
                self._counted = True
                self.device_hit, self.host_hit = m.device_len, m.host_len
        else:
            m = store.peek(self.tokens)
        if m.loading and m.needs_load and start_load and not self.recompute_host:
            m = self._queue_rest() or m
        if m.loading:
            now = store.backend.now()
            ready = now
            for ld in store.path_loads(self.tokens):
                if not ld.done:
                    store.loads.note_wait(ld, now)
                    ready = max(ready, ld.ready)
            self._start_wait(now)
            return Poll(Readiness.LOADING, "in_flight", ready, m.device_len, m.cached_len,
                        m.needs_load)
        if m.needs_load:
            if self.recompute_host:
                return self._ready(Readiness.RECOMPUTE, "cheaper", m)
            if not start_load:
                self._start_wait(store.backend.now())
                return Poll(Readiness.NEEDS_LOAD, "host_only", None, m.device_len, m.cached_len)
            return self.load()
        return self._ready(Readiness.READY, "cached" if m.cached_len else "no_cache", m)

    def _queue_rest(self):
        """The head is in flight (a partial prefetch), the rest host-only: queue the rest behind
        it now, charged only what it adds (left until the head landed, the next agent's prefetch
        took the link first: AutoGen PEER's expresser, bench/RESULTS.md 6.57). Its new match,
        or None ("recompute" stands until the head lands; no room: the next poll tries again)."""
        store = self._mgr.store
        m = store.match(self.tokens, record=False)
        self._relock(m.node)
        ready, reason = store.demand_load(m)
        self.recompute_host = ready is None and reason == "recompute"  # (False on entry)
        return store.peek(self.tokens) if ready is not None else None

    def load(self, *, recompute_s: float | None = None) -> Poll:
        """Start loading the host-only part of the prefix (or decide to recompute it)."""
        store = self._mgr.store
        m = store.match(self.tokens, record=False)
        self._relock(m.node)
        now = store.backend.now()
        ready, reason = store.demand_load(m, recompute_s=recompute_s)
        if reason == "no_room" and self._mgr.unpin_if_stuck(keep=self):
            ready, reason = store.demand_load(m, recompute_s=recompute_s)
        if ready is None:
            if reason == "recompute":
                self.recompute_host = True
                return self._ready(Readiness.RECOMPUTE, "cheaper", m)
            self._start_wait(now)
            return Poll(Readiness.NEEDS_LOAD, reason, None, m.device_len, m.cached_len)
        if reason == "loading":
            self._start_wait(now)
            return Poll(Readiness.LOADING, "demand_load", ready, m.device_len, m.cached_len)
        m = store.peek(self.tokens)
        return self._ready(Readiness.READY, "cached", m)

    def _start_wait(self, now: float) -> None:
        if self._wait_since is None:
            self._wait_since = now

    def _ready(self, state: Readiness, reason: str, m) -> Poll:
        if self._wait_since is not None:
            self.load_wait_s += self._mgr.store.backend.now() - self._wait_since
            self._wait_since = None
        return Poll(state, reason, None, m.device_len, m.cached_len)

    def reserve_pages(self) -> int:
        """Device pages this waiting request will take at admission, allocated or (lazy decode)
        reserved: the prefetch budget's reserve. Lazy decode counts its reserve too: admission
        needs it free or evictable (S1), and a prefetch's pages are neither until it lands."""
        store = self._mgr.store
        p = store.peek(self.tokens)
        have = p.device_len if p.needs_load else p.cached_len
        take = self._upfront_pages() + self._decode_reserve()
        return max(0, take - self._reusable(have) // store.page_size)

    def _reusable(self, cached: int) -> int:
        """Tokens of a ``cached`` prefix admission reuses (the rest is prefilled): whole pages,
        at least one prompt token left to prefill, whole multiples of the manager's
        ``reuse_align``. The reserve and ``admit`` both count with it, so a prefetch never
        takes the pages a waiting request will still need (it once took the tail a 256-token
        alignment left to recompute, and the request waited for the prefetch to land)."""
        ps = self._mgr.store.page_size
        reuse = min(cached, (len(self.tokens) - 1) // ps * ps)  # prefill needs >= 1 new token
        return reuse - reuse % max(1, self._mgr.reuse_align)

    def _total_pages(self) -> int:
        return max(1, -(-self.kv_tokens // self._mgr.store.page_size))

    def _upfront_pages(self) -> int:
        """Pages ``admit`` allocates: all of ``kv_tokens``, or (lazy decode) the prompt's."""
        if not self._mgr.lazy_decode:
            return self._total_pages()
        return min(self._total_pages(), max(1, -(-len(self.tokens) // self._mgr.store.page_size)))

    def _decode_reserve(self) -> int:
        """Decode pages ``admit`` reserves: all the rest of ``kv_tokens``, or (an optimistic
        ``decode_reserve`` < 1, unless retracted before) that fraction of them, rounded up."""
        later = self._total_pages() - self._upfront_pages()
        r = self._mgr.decode_reserve
        if later <= 0 or r >= 1 or self.full_reserve:
            return later
        return min(later, math.ceil(later * r))

    @property
    def full_reserve(self) -> bool:
        """Reserve all of ``kv_tokens``: a retracted session is never retracted again."""
        return self.retractions > 0

    @property
    def growing(self) -> bool:
        """Admitted and not yet holding every page ``kv_tokens`` may take (lazy decode)."""
        return self.state == "admitted" and len(self.pages) < self._total_pages()

    # ------------------------------------------------------------------ admission
    def admit(self, *, load_inline: bool = False, recompute_s: float | None = None) -> bool:
        """Take device pages for the whole request (``kv_tokens``; lazy decode: the prompt's, and
        reserve the rest, S1): the cached prefix's own pages, then new ones. False: not now
        (memory is short; wait for running requests).
        ``load_inline``: a host-only or loading part is waited for inside the engine's batch
        (``ready_at``) instead of beforehand; ``recompute_s`` decides a load started here.
        The prefix is reused as :meth:`_reusable` says (the manager's ``reuse_align``)."""
        if self.state != "waiting":
            raise RuntimeError(f"admit: session is {self.state}")
        mgr, store = self._mgr, self._mgr.store
        if self.handle is None:
            self.poll(start_load=False)
        m = store.match(self.tokens, record=False)
        self._relock(m.node)
        usable, pages, self.ready_at = m.device_len, m.device_pages, None
        if load_inline and (m.needs_load or m.loading):
            ready = None
            if m.needs_load and not self.recompute_host:
                ready, _ = store.demand_load(m, recompute_s=recompute_s)
            if ready is not None or not m.needs_load:  # the whole cached prefix is coming
                landing = m.node.path()
            else:  # its host-only rest is recomputed (cheaper, or no room): reuse up to it
                landing = list(itertools.takewhile(lambda n: n.state is not NodeState.HOST,
                                                   m.node.path()))
            if ready is None and m.loading:
                ready = max((ld.ready for ld in store.path_loads(self.tokens) if not ld.done),
                            default=store.backend.now())
            if ready is not None:
                usable = min(m.cached_len, sum(len(n.key) for n in landing))
                pages = [p for n in landing for p in n.device_pages]
                self.ready_at = ready
        ps = store.page_size
        reuse = self._reusable(usable)
        prefix = list(pages[:reuse // ps])
        need = self._upfront_pages() - len(prefix)
        later = self._decode_reserve()
        new = store.allocate(need) if mgr.room_for(need + later) else None
        if new is None and mgr.unpin_if_stuck(keep=self):
            new = store.allocate(need) if mgr.room_for(need + later) else None
            if new is None:
                raise CacheFullError(f"{need + later} device pages needed; the pool holds "
                                     f"{mgr.device_pages}")
        if new is None:
            return False
        if self._wait_since is not None:
            self.load_wait_s += store.backend.now() - self._wait_since
            self._wait_since = None
        self.pages, self.own_from, self.reused = prefix + new, len(prefix), reuse
        self.decode_reserved = later
        if not self.retractions:  # the hit split describes the client's prompt, counted once
            self.prompt_reused = reuse
            self.host_hit = min(self.host_hit, max(0, reuse - self.device_hit))
            self.device_hit = reuse - self.host_hit
        self.admitted_at = store.backend.now()
        self.inline_loads = []
        for ld in store.path_loads(self.tokens[:reuse]):
            if not ld.read:
                ld.read = True
                self.loads_read.append(ld)
            if self.ready_at is not None and not ld.done:
                self.inline_loads.append(ld)
        self.state = "admitted"
        mgr._admitted(self)
        return True

    # ------------------------------------------------------------------ running
    def layer_ready_times(self, layers: int) -> list[float] | None:
        """Admitted with loads on its reused prefix still in flight (``admit(load_inline=True)``):
        when each of the model's ``layers`` layers of that prefix is readable, the latest of
        those loads layer by layer (:meth:`Load.layer_ready_at`). None when none is in flight
        (or none was when it was admitted): the prefill reads at once."""
        loads = [ld for ld in self.inline_loads if not ld.done]
        if not loads:
            return None
        return [max(ld.layer_ready_at(i, layers) for ld in loads) for i in range(layers)]

    def overlapped(self, waits: Sequence[tuple[float, float]]) -> None:
        """Its prefill read the loads it was admitted with layer by layer and waited during
        ``waits`` (intervals on the backend's clock): the wait is this request's load wait;
        what its compute hid moves from exposed to hidden (``LoadTracker.credit_overlap``);
        the loads, all landed now, are landed in the tree before its prompt joins it."""
        store = self._mgr.store
        self.load_wait_s += sum(max(0.0, b - a) for a, b in waits)
        for ld in self.inline_loads:
            store.loads.credit_overlap(ld, self.admitted_at, list(waits))
        self.inline_loads = []
        store.poll_loads(store.backend.now())

    def grow(self, n_tokens: int) -> bool:
        """Lazy decode: make ``pages`` cover the first ``n_tokens`` tokens (call it before a
        decode step writes token ``n_tokens - 1``), out of the admission's reserve; evicting
        unlocked cache takes only the tail pages needed. False: not now (a load in flight holds
        the room; decode this request next step), or (``needs_room``) growth past an optimistic
        reserve finds no room that every other running reserve can spare: the engine retracts
        a session. Raises :class:`CacheFullError` if nothing can free the room within the
        reserve (S1 broken: a bug) and ``ValueError`` past ``kv_tokens``."""
        if self.state != "admitted":
            raise RuntimeError(f"grow: session is {self.state}")
        store, mgr = self._mgr.store, self._mgr
        k = -(-n_tokens // store.page_size) - len(self.pages)
        if k <= 0:
            return True
        if len(self.pages) + k > self._total_pages():
            raise ValueError(f"grow: {n_tokens} tokens are more than the {self.kv_tokens} admitted")
        extra = k - min(k, self.decode_reserved)  # past the reserve: only what others can spare
        if extra and not mgr.room_for(extra):
            mgr.unpin_waiting()
            if not mgr.room_for(extra):
                if store.loads.in_flight:  # a landing load becomes evictable cache
                    mgr.metrics.decode_page_waits += 1
                    return False
                self.needs_room = True
                return False
        self.needs_room = False
        new = store.allocate(k, partial=True, reason="grow")
        if new is None:
            self._mgr.unpin_waiting()  # waiting sessions' pins give way to running requests
            new = store.allocate(k, partial=True, reason="grow")
        if new is None:
            if store.loads.in_flight:
                self._mgr.metrics.decode_page_waits += 1
                return False
            raise CacheFullError(f"grow: {k} device pages reserved at admission cannot be freed")
        self.pages.extend(new)
        self.decode_reserved -= k - extra
        return True

    def retract(self, seq: Sequence[int], written: int) -> None:
        """admitted -> waiting, to free room for the others (vLLM's preemption by recompute):
        the first ``written`` tokens of ``seq`` join the tree (cache, evictable now that
        nothing pins them), its own pages are freed, and it waits again for ``seq[:written]``
        with its whole remaining reserve (``full_reserve``). Hit counters are not counted
        again; its place in admission order is kept."""
        if self.state != "admitted":
            raise RuntimeError(f"retract: session is {self.state}")
        if written < len(self.tokens):
            raise ValueError(f"retract: {written} tokens written, fewer than its "
                             f"{len(self.tokens)}")
        self._insert(written, seq)
        self._release()
        self.tokens = list(seq[:written])
        self.own_from = 0
        self.ready_at, self.recompute_host, self.needs_room = None, False, False
        self.inline_loads = []
        self.retractions += 1
        self.state = "waiting"
        self._mgr._retracted(self)

    def commit(self, n_tokens: int | None = None, seq: Sequence[int] | None = None) -> None:
        """After prefill: the first ``n_tokens`` (default: the prompt) of ``seq`` join the tree
        (the tree takes those pages; the session switches to the tree's copies of duplicates)
        and, once, the agent's fixed prefix is tagged (declared ``fixed_len``, else inferred)."""
        self._insert(n_tokens if n_tokens is not None else len(self.tokens), seq)
        if not self._tagged:
            self._tagged = True
            h = self.hints
            if h is not None:
                book = self._mgr.tags
                b = self.fixed_len
                if b is None:
                    b = book.infer_boundary(h.workflow, h.agent, self.tokens, app=h.app)
                else:
                    # Sub-page boundary: tags are page-aligned, so the page holding the end of
                    # the fixed prompt (and a chat template's constant header of the next
                    # message) would stay untagged, go first and be recomputed every call.
                    # Tag it too while the agent's prompts agree through it; on its first
                    # call, with nothing to compare, assume they will (the next call corrects
                    # it: one page at stake, against recomputing it on the second call).
                    ps = book.page_size
                    up = -(-b // ps) * ps
                    if up > b:
                        first = book.prompts_seen(h.workflow, h.agent, app=h.app) == 0
                        if book.infer_boundary(h.workflow, h.agent, self.tokens, app=h.app) >= up or first:
                            b = up
                if self.fixed_len is not None or b > 0:
                    book.tag_fixed_prefix(self.tokens, b, h.workflow, h.agent, app=h.app)

    def finish(self, seq: Sequence[int] | None = None, written: int = 0, *, cache: bool = True) -> None:
        """The request is done (or aborted / failed): with ``cache``, its first ``written``
        tokens of ``seq`` join the tree; its own pages are freed and its path unpinned."""
        if self.state == "finished":
            return
        if self.state == "admitted" and self.pages and cache:
            self._insert(written, seq)
            self.written = list((self.tokens if seq is None else seq)[:written])
        self._release()
        self.state = "finished"
        self._mgr._finished(self)

    def unpin(self) -> None:
        """Waiting only: drop the pin; the next poll looks again (no hit counted twice)."""
        if self.state == "waiting" and self.handle is not None:
            self._mgr.store.unlock(self.handle)
            self.handle = None

    # ------------------------------------------------------------------ helpers
    def _release(self) -> None:
        """Free the request's own pages (the tree keeps what was inserted), drop its reserve
        and its pin: what finishing and retracting share."""
        store = self._mgr.store
        own = self.pages[self.own_from:]
        if own:
            store.free(own)
        self.pages = []
        self.decode_reserved = 0
        if self.handle is not None:
            store.unlock(self.handle)
            self.handle = None

    def _relock(self, node) -> None:
        store = self._mgr.store
        new = store.lock(node)
        if self.handle is not None:
            store.unlock(self.handle)
        self.handle = new

    def _insert(self, n_tokens: int, seq: Sequence[int] | None) -> None:
        store = self._mgr.store
        ps = store.page_size
        k = n_tokens // ps
        if k <= self.own_from or k == 0:
            return
        seq = self.tokens if seq is None else seq
        node = store.insert(seq[:k * ps], self.pages[:k])
        self._relock(node)
        tree_pages = [p for n in node.path() for p in n.device_pages]
        self.pages[:k] = tree_pages[:k]
        self.own_from = k
