"""Prefetch: which host-only fixed prefixes to load, in which order (:class:`PrefetchPlanner`),
and the one executor every engine shares (:class:`Prefetcher`).

The planner is engine-agnostic: it sees candidates (an agent's tag, its STE, how many pages are
still on host only, its workflow's measured step time) and returns an ordered plan.
The :class:`Prefetcher` turns the tag book's near, host-only tags into candidates, plans them
once, and starts each under the shared limits (in-flight prefetches, the device budget beyond
the pages queued work will need, room to lower STEs first, the no-thrash rule: never evict a
node whose priority is <= the fetched agent's STE) through a :class:`PrefetchTarget`: our
tiered store, or SGLang's tree whose ``load_back`` starts the transfer.

Order = urgency, not arrival: ``urgency = transfer time still needed / time left before the
agent runs`` with ``transfer = pages x seconds-per-page`` and ``time left = STE x step time``
less the time already spent in the current step.
Most urgent first. Loads share one link, so the planner walks the list accumulating link time;
a load that would finish after its agent starts yields (moves behind every load that can still
finish in time) instead of delaying them all.

Load versus recompute: a candidate may carry ``recompute_s`` (the engine's estimate of
recomputing its host-only pages). A load that cannot finish before its agent runs is dropped
from the plan (listed in ``last_skipped``) when the agent would still wait longer for it than
recomputing takes (``finish - deadline > recompute_s``). Without ``recompute_s``: always loaded.

Agents further ahead only on an idle link (``busy_lookahead``): with ``lookahead`` 2 and
``busy_lookahead`` 1, an agent two steps away is planned only when the link would otherwise sit
idle (nothing in flight, no nearer load planned), one such load at a time. The link is FIFO and
a load cannot be overtaken once started, so prefetching two steps ahead unconditionally puts
loads for later agents in front of the next agents' loads whenever several workflows move at
once; filling only idle link time takes load off the busy periods without ever delaying a
nearer agent by more than the one load already on the link (RESULTS.md §6.52).

The idle band follows the pool (:meth:`Prefetcher.fill_fits`): an idle-link fill for an agent
of STE ``s`` starts only while every agent due by then fits on device beside the running
requests, i.e. the host-only pages of all tags of effective STE <= ``s`` (every workflow, not
only this plan's candidates) fit in ``free + evictable above s - reserve``: a fill does not take
the room of an agent due before it, which then evicted it unread when that agent loaded (up to
9 ahead on the 8-workflow smollm2 cell at 60 %, §6.63). It bounds the pages, not the volume:

fills cost link volume, so they run only while the link has headroom (``fill_link_cap``: the
share of the last 20 s the link carried loads, :meth:`LoadTracker.link_utilization`). Loading
an agent steps ahead means evicting, for it, one due later that would otherwise have stayed:
a band deeper than the set the pool can keep turns eviction at the time of need (which keeps a
fixed part of a cycle resident, close to Belady's) into a sliding window that evicts and loads
every agent once a cycle. On the 8-workflow smollm2 cell at 60 % the link moved 31 pages a
call with the plain lookahead, 49 with fills up to 4 ahead and 68 up to 9 ahead, where the
oracle's pace leaves it room for about 62 (RESULTS.md §6.64): the first fills hid the load
bursts, the deeper ones saturated the link. The cap bounds the fills, not the volume they
cause: the agents a fill evicted come back later as next-agent loads, which it does not hold
(with it, 9 ahead still moved 61 pages a call and came level with the plain lookahead).

"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Protocol

INF = math.inf


@dataclass
class PrefetchCandidate:
    tag: Hashable
    ste: float
    pages: int              # pages still host-only on the agent's fixed-prefix path
    step_s: float           # measured seconds per workflow step
    node: Any = None        # engine handle for the tagged node
    elapsed_s: float = 0.0  # time already spent in the workflow's current step
    recompute_s: float | None = None  # engine's estimate of recomputing those pages; None: load


@dataclass
class PlannedLoad:
    candidate: PrefetchCandidate
    transfer_s: float
    deadline_s: float       # seconds until the agent is expected to run
    urgency: float
    on_time: bool           # finishes before the deadline given the loads ahead of it
    finish_s: float = field(default=0.0)
    idle_fill: bool = False  # beyond ``busy_lookahead``: planned only because the link is idle


class PrefetchPlanner:
    def __init__(self, *, lookahead: float = 1, secs_per_page: float = 0.0,
                 busy_lookahead: float | None = None) -> None:
        self.lookahead = lookahead
        # STEs above this (and <= lookahead) load only on an idle link; None: no such band
        self.busy_lookahead = busy_lookahead
        self.secs_per_page = secs_per_page  # 0 = unknown: every load counts as instant
        self.last_skipped: list[PlannedLoad] = []  # dropped by the last plan(): recompute cheaper

    def eligible(self, ste: float) -> bool:
        return ste <= self.lookahead

    def idle_only(self, ste: float) -> bool:
        """An agent this far ahead loads only while the link would otherwise be idle."""
        band = self.busy_lookahead
        return band is not None and ste > band

    def plan(self, candidates: Iterable[PrefetchCandidate], *, link_busy_s: float = 0.0,
             link_idle: bool | None = None) -> list[PlannedLoad]:
        """Order candidates by urgency; loads that cannot finish in time go last (or are
        dropped when recomputing is cheaper than waiting for them), and the most urgent agent
        beyond ``busy_lookahead`` last of all (``idle_fill``; one of them is started), only
        when nothing else keeps the link busy (module doc). ``link_idle``: no load is in
        flight (default: no ``link_busy_s``); an engine that learns of landings late, or does
        not know the link's speed, says so."""
        spp = self.secs_per_page
        self.last_skipped = skipped = []
        items, idle_only = [], []
        for c in candidates:
            if c.pages <= 0 or not self.eligible(c.ste):
                continue
            transfer = c.pages * spp
            deadline = max(0.0, c.ste * c.step_s - c.elapsed_s)
            if transfer <= 0:
                urgency = 0.0
            elif deadline <= 0:
                urgency = INF
            else:
                urgency = transfer / deadline
            (idle_only if self.idle_only(c.ste) else items).append(
                PlannedLoad(c, transfer, deadline, urgency, True))
        items.sort(key=lambda p: (-p.urgency, p.candidate.ste, p.candidate.pages))
        on_time, late = [], []
        t = link_busy_s
        for p in items:
            if p.transfer_s == 0 or t + p.transfer_s <= p.deadline_s:
                t += p.transfer_s
                p.finish_s = t
                on_time.append(p)
            else:
                p.on_time = False
                late.append(p)
        late.sort(key=lambda p: (p.deadline_s, p.transfer_s))
        kept_late = []
        for p in late:
            rec = p.candidate.recompute_s
            if rec is not None and t + p.transfer_s - p.deadline_s > rec:
                skipped.append(p)  # the agent would wait longer than recomputing takes
                continue
            t += p.transfer_s
            p.finish_s = t
            kept_late.append(p)
        if idle_only and not (on_time or kept_late) and (
                link_busy_s <= 0 if link_idle is None else link_idle):
            # the executor starts the first of these it has room for, and no other
            idle_only.sort(key=lambda p: (-p.urgency, p.candidate.ste, p.candidate.pages))
            for p in idle_only:
                p.finish_s = p.transfer_s
                p.on_time = p.finish_s <= p.deadline_s
                p.idle_fill = True
            kept_late += idle_only
        return on_time + kept_late


# ------------------------------------------------------------------------------ executor
class PrefetchTarget(Protocol):
    """What the prefetcher asks of the engine's tree (our store, or the SGLang adapter)."""

    evicts: bool                      # a bounded device pool (else: no budget to check)
    partial_prefetch: bool            # start_prefetch takes ``max_pages`` (load a head only)
    # bumped on every node state / lock / priority change; None: the target cannot say, so
    # the prefetcher re-plans on every tick instead of skipping unchanged ones
    state_ver: int | None

    def host_pages(self, node) -> int:
        """Pages a load must bring for ``node``'s path to be readable; 0: nothing to load now
        (already on device, loading, or gone)."""
        ...

    def free_pages(self) -> int: ...

    def evictable_pages(self) -> int: ...

    def evictable_above(self, ste: float) -> int:
        """Device pages a prefetch for an agent of STE ``ste`` may evict (priority > ste)."""
        ...

    def start_prefetch(self, candidate: PrefetchCandidate, now: float, max_pages: int | None = None):
        """Start loading ``candidate.node``'s host-only path (with ``max_pages``, where
        ``partial_prefetch``: only its head), evicting only priorities > ``candidate.ste``;
        return the tracker's :class:`~.loads.Load`, or None (no room / no slot: retried at
        the next plan)."""
        ...


class Prefetcher:
    """Candidates -> one budget -> planner -> start through the target (module doc).

    ``reserve`` (an int, or a callable evaluated only when a prefetch needs room): device pages
    queued and admitted work will still allocate. A prefetch of ``k`` pages for STE ``s``
    starts only if ``k <= free + evictable above s - reserve - what this plan's candidates of
    lower STE still need`` (M5), so neither the next admission nor a more urgent prefetch
    evicts it unused.

    An agent whose own request is already waiting (``hold(tag)`` until it is admitted or
    gone) is not prefetched: that request decides, with its demand load or by recomputing
    when that is cheaper, so the decision does not depend on whether the engine looks at a
    new request before or after its scheduler step's prefetch.
    """

    def __init__(self, book, loads, metrics, target: PrefetchTarget, *, page_size: int,
                 max_inflight: int = 4, default_step_s: float = 1.0,
                 reserve: "int | Callable[[], int]" = 0, min_partial_pages: int = 4,
                 busy_lookahead: float | None = None,
                 fill_link_cap: float | None = 0.75) -> None:
        self.book, self.loads, self.metrics, self.target = book, loads, metrics, target
        # a prefetch that does not fit whole loads its head when at least this many pages fit
        # (0: off): a prefix of a prefix is valid KV, so part of the load is hidden
        self.min_partial_pages = min_partial_pages
        # idle-link fills start only while the link's recent utilization is below this (None:
        # no cap; module doc)
        self.fill_link_cap = fill_link_cap
        self._idle_plan = None        # state signature of the last plan that started nothing
        self.page_size = page_size
        self.max_inflight = max_inflight
        self.default_step_s = default_step_s
        self.reserve = reserve
        self.planner = PrefetchPlanner(lookahead=book.lookahead, secs_per_page=loads.secs_per_page,
                                       busy_lookahead=busy_lookahead)
        self.pending: set = set()     # planned but not started (retried next time)
        self._held: dict = {}         # tag -> waiting requests of that agent
        self._held_ver = 0            # bumped by hold / unhold
        self._blocked = None          # (what the last idle plan saw, least STE, least need)
        self._overflow = None         # (what the last refused fill saw, its STE, pages needed)

    def hold(self, tag) -> None:
        self._held[tag] = self._held.get(tag, 0) + 1
        self._held_ver += 1

    def unhold(self, tag) -> None:
        self._held_ver += 1
        n = self._held.get(tag, 0) - 1
        if n > 0:
            self._held[tag] = n
        else:
            self._held.pop(tag, None)

    @property
    def reserved_pages(self) -> int:
        r = self.reserve
        v = r() if callable(r) else r
        return max(0, int(v or 0))

    def room(self, ste: float) -> int:
        """Device pages a prefetch for an agent of STE ``ste`` may take now."""
        t = self.target
        return t.free_pages() + t.evictable_above(ste) - self.reserved_pages

    def candidates(self, now: float, tags: list | None = None) -> list[PrefetchCandidate]:
        """``tags``: ``book.prefetch_candidates()``, if the caller has them."""
        book, loads, target = self.book, self.loads, self.target
        hints, index, ps = book.hints, book.index, self.page_size
        estimate = loads.has_recompute_estimate
        out, held = [], self._held
        for tag in book.prefetch_candidates() if tags is None else tags:
            if tag in held:
                continue  # its own request is waiting: that request decides
            rec = book.records[tag]
            node = rec.node
            if node is None:
                continue
            pages = target.host_pages(node)
            if pages <= 0:
                continue
            rec_s = (loads.recompute_cost_s(pages * ps, len(rec.tokens) - pages * ps)
                     if estimate else None)
            wf = tag[0]
            out.append(PrefetchCandidate(tag, index.ste(tag), pages,
                                         hints.step_seconds(wf, self.default_step_s), node,
                                         hints.step_elapsed(wf, now), rec_s))
        return out

    def fill_fits(self, ste: float, reserve: int) -> bool:
        """An idle-link fill for an agent of STE ``ste`` would be kept (module doc): the
        host-only pages of every tag of effective STE <= ``ste`` fit in the device pages such a
        load may take (free + evictable above ``ste``) beyond ``reserve``. Tags whose request is
        waiting are left out (the reserve has their pages); paths two tags share count twice
        (errs towards not filling). A prefix gone from both tiers is recomputed by its own
        request and not counted. Runs only for an idle fill about to start; while the link
        idles with the fill refused, the walk is skipped as long as nothing could have lowered
        the need (no host path shortened, no host-only tag's STE changed or gone, no hold
        changed) and the room has not reached it."""
        book, target = self.book, self.target
        room = target.free_pages() + target.evictable_above(ste) - reserve
        if room <= 0:
            return False
        tracked = book.is_host is not None
        key = ((len(book.host_tags), book.host_shrinks, book.host_ste_changes, self._held_ver)
               if tracked else None)
        last = self._overflow
        # the need at a higher STE is at least the need at a lower one (more tags count)
        if (key is not None and last is not None and last[0] == key and ste >= last[1]
                and room < last[2]):
            return False
        held, records, eff = self._held, book.records, book.effective_ste
        need = 0
        for tag in book.host_tags if tracked else records:
            if tag in held or eff(tag) > ste:
                continue
            node = records[tag].node
            if node is not None:
                need += target.host_pages(node)
        if need > room:
            self._overflow = (key, ste, need)
            return False
        return True

    def _link_has_no_room(self, now: float) -> bool:
        cap = self.fill_link_cap
        return cap is not None and self.loads.link_utilization(now) >= cap

    def _signature(self) -> tuple | None:
        t, book = self.target, self.book
        if t.state_ver is None:
            return None
        return (t.state_ver, len(book.near), len(book.host_tags), self.loads.inflight_prefetch,
                t.free_pages(), t.evictable_pages(), book.lookahead, self._held_ver)

    def _blocked_key(self, tags: list) -> tuple:
        book = self.book
        return (tags, book.host_shrinks, book.host_ste_changes, self.loads.inflight_prefetch,
                book.lookahead, self._held_ver)

    def _still_blocked(self, tags: list) -> bool:
        """Since the last plan that started nothing, the candidates are the same tags (none
        held or released since), with the same STEs (``book.host_ste_changes``) and no shorter
        host paths (``book.host_shrinks``; a longer one only needs more), and the pool still
        has less room than any start needs: the least of the candidates' host pages and a
        partial head's ``min_partial_pages``. Free + evictable above the least STE - reserve
        bounds every candidate's budget, so nothing could start. (A running decode changes the
        free and evictable counts on every step, which the exact ``_signature`` cannot see
        past; with 143 blocked candidates the walk cost ~0.6 ms a step at batch 32.) Counters
        per plan (budget skips, deferrals) count the plans made."""
        b = self._blocked
        if b is None or b[0] != self._blocked_key(tags):
            return False
        _, ste, need = b
        t = self.target
        room = t.free_pages() + t.evictable_above(ste)
        return room < need or room - self.reserved_pages < need

    def run(self, now: float) -> list:
        """Plan and start prefetches; returns the tags started. Runs every tick (= every
        decode step): when nothing the plan depends on changed since a plan that started
        nothing, it would start nothing again (deadlines and the link's backlog shrink together
        as time passes), so the candidate walk is skipped; so it is while the pool stays too
        full for any of the same candidates (:meth:`_still_blocked`)."""
        sig = self._signature()
        if sig is not None and sig == self._idle_plan:
            return []
        tags = self.book.prefetch_candidates()
        if self._still_blocked(tags):
            return []
        cands = self.candidates(now, tags)
        previously = self.pending
        if not cands and not previously:
            # nothing on host to fetch: nothing to do until the state changes (with one
            # workflow this is most steps: its next agent's prefix has landed)
            self._idle_plan = sig
            return []
        planner, loads, metrics, target, book = (self.planner, self.loads, self.metrics,
                                                 self.target, self.book)
        planner.lookahead = book.lookahead
        planner.secs_per_page = loads.secs_per_page
        busy = loads.link_busy_s(now)
        plan = planner.plan(cands, link_busy_s=busy, link_idle=busy <= 0 and not loads.in_flight)
        metrics.prefetch_recompute_skips += len(planner.last_skipped)
        planned = {p.candidate.tag for p in plan}
        for tag in previously - planned:
            node = book.node_of(tag)
            if node is not None and target.host_pages(node) > 0:
                metrics.prefetch_stale += 1  # a newer hint made this plan moot
        started, pending = [], set()
        reserve: int | None = None   # evaluated lazily: only when a prefetch needs room
        claims = _RoomClaims(plan) if target.evicts else None
        filled = False      # one idle-link fill at a time (module doc)
        fill_limit = INF    # an idle fill of this STE did not fit: none further ahead will
        link_capped = False
        for p in plan:
            c = p.candidate
            if p.idle_fill and (filled or c.ste >= fill_limit):
                continue    # (the idle fills come last in a plan)
            if p.idle_fill and fill_limit == INF and self._link_has_no_room(now):
                metrics.prefetch_fill_link_busy += 1
                link_capped = True  # time alone lifts it: the plan is not memoized below
                break       # no fill this plan
            if claims is not None:
                claims.drop(c)  # its own pages are what the budget below is about
            k = target.host_pages(c.node)
            if k <= 0:
                continue  # covered by a load started for a sibling agent
            if loads.inflight_prefetch >= self.max_inflight:
                pending.add(c.tag)
                continue
            if target.evicts:
                free = target.free_pages()
                if reserve is None:
                    reserve = self.reserved_pages
                if p.idle_fill and not self.fill_fits(c.ste, reserve):
                    if fill_limit == INF:
                        metrics.prefetch_fill_overflows += 1
                    fill_limit = c.ste
                    continue  # a nearer fill may still fit
                # room goes to lower STEs first, whatever the link order (the planner puts a
                # late load behind on-time ones): what a lower-STE candidate of this plan still
                # needs is not this one's to take, or it is evicted unused when that one starts
                avail = free - reserve - claims.below(c.ste)
                if avail < k and (avail + target.evictable_pages() < k or
                                  avail + target.evictable_above(c.ste) < k):
                    if not p.idle_fill:
                        pending.add(c.tag)
                    metrics.prefetch_budget_skips += 1
                    # partial prefetch: the head that fits now; the rest next tick or on demand.
                    # (Only then the room: a target without it, SGLang's, would walk its tree
                    # for nothing on every step a candidate waits.)
                    if not (target.partial_prefetch and self.min_partial_pages):
                        continue
                    room = avail + min(target.evictable_pages(), target.evictable_above(c.ste))
                    if room < self.min_partial_pages:
                        continue
                    ld = target.start_prefetch(c, now, max_pages=room)
                    if ld is not None:
                        metrics.prefetch_partial += 1
                        started.append(c.tag)
                        filled = p.idle_fill
                        loads.note_prefetch(ld)
                    continue
            ld = target.start_prefetch(c, now)
            if ld is None:
                if not p.idle_fill:
                    pending.add(c.tag)
                continue
            started.append(c.tag)
            filled = p.idle_fill
            loads.note_prefetch(ld)
        metrics.prefetch_deferred += len(pending - previously)
        self.pending = pending
        self._idle_plan = None if started or link_capped else self._signature()
        self._blocked = None
        if not started and cands and target.evicts and target.state_ver is not None:
            need = min(c.pages for c in cands)   # the least room a start needs
            if target.partial_prefetch and self.min_partial_pages:
                need = min(need, self.min_partial_pages)
            self._blocked = (self._blocked_key(tags), min(c.ste for c in cands), need)
        return started

    def forget(self, tags: Iterable) -> None:
        self.pending.difference_update(tags)


class _RoomClaims:
    """The device pages a plan's candidates still need, by STE: what a candidate of STE ``s``
    must leave for those of lower STE that have not had their turn (invariant: each candidate
    claims its pages until the executor reaches it, started or not). A fan-out's next agents
    and another workflow's next-but-one agent otherwise took turns evicting each other's
    prefetches unused (RESULTS.md §6.26). Few distinct STEs per plan: ``below`` is a short sum."""

    __slots__ = ("_by_ste",)

    def __init__(self, plan: Iterable[PlannedLoad]) -> None:
        self._by_ste: dict = {}
        for p in plan:
            c = p.candidate
            self._by_ste[c.ste] = self._by_ste.get(c.ste, 0) + c.pages

    def drop(self, c: PrefetchCandidate) -> None:
        self._by_ste[c.ste] -= c.pages

    def below(self, ste: float) -> int:
        return sum(n for s, n in self._by_ste.items() if s < ste)
