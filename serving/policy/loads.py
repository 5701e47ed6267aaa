"""The load tracker: host -> device transfers in flight, the link clock, and what a load costs.

Engine-agnostic: a :class:`Load` names the engine's nodes it brings back only as opaque
handles, so the same tracker serves our :class:`~.store.TieredStore` (whose backend says when
each load lands) and SGLang's ``load_back`` (whose landing is known only when the ack is reaped:
``start(..., ready=None)`` estimates it, :meth:`LoadTracker.complete` records the real time).

What it answers:

- ``estimate_load_s(pages)``: seconds until ``pages`` started now are readable: queueing behind
  the loads on the (FIFO) link + ``pages x secs_per_page``, plus, when that is not zero, one
  *admission delay* (the engine admits a request whose load landed at its next scheduler step at
  the earliest, while recomputed tokens join the current step's prefill; engines report their
  step time with :meth:`observe_step`);
- ``should_load(pages, recompute_s)``: load rather than recompute (True without an estimate).
  Where the request already waits for a load in flight on its own prefix (``ready_anyway``:
  the host-only rest below a prefetched head, which the session queues behind it), only what
  this load adds past that wait counts, since the wait is paid either way (AutoGen PEER's
  expresser, ``bench/RESULTS.md`` 6.57). Otherwise
  the admission delay counts only while the engine runs requests (:meth:`engine_busy`): an
  idle engine starts the loaded request when its load lands, so a 3-page load (17 ms) was
  declined for a 65 ms recompute because a 58 ms step that was not running was added to it
  (AutoGen PEER's reviewer, ``bench/RESULTS.md`` 6.47);
- ``link_utilization(now)``: the share of the last ``UTILIZATION_WINDOW_S`` seconds the link
  carried loads (estimated spans where the engine learns of landings late): the headroom an
  idle-link fill may use (:mod:`.prefetch`);
- ``recompute_s(n_tokens, ctx)``: the engine's recompute estimate (``recompute_cost`` callable,
  a fixed ``recompute_s_per_token``, or the prefill speed it reports with
  :meth:`observe_prefill`, weighted by tokens); ``None`` means "no estimate: always load";
- ``recompute_cost_s(n_tokens, ctx)``: what a load is weighed against: that prefill times
  (1 + the requests it would stall, ``recompute_stalls()``, the engine's running requests).
  Recomputing in a step delays every request in the running batch by as much, while a load
  waited for delays only its own request (the status-aware skip lets the others run; a
  layer-wise load overlaps the request's own prefill); the simulator's cost is the same.
  Without it a busy engine whose link had a queue recomputed its host hits one after another
  (hicache, 32 workflows in a pool of 10 %: 300 of 320 host hits recomputed, 3.4x slower
  than loading them; ``bench/RESULTS.md`` 6.45).

``secs_per_page`` is configured (bytes per page / link bytes per second) or measured from the
loads that landed (link time only: a load queued behind another is timed from when the link
freed up for it). A measured estimate is the median of the last ``CALIBRATION_SAMPLES`` loads of
at least ``CALIBRATION_MIN_PAGES`` pages: an engine that learns of a landing only at its next
step (SGLang reaps acks there) adds a fixed lag that swamps a one-page load, and one such sample
must not price the link 100x too slow. A measured estimate is also only refreshed by loads, so
after ``PROBE_AFTER_DECLINES`` declines in a row ``should_load`` lets one through (a probe):
otherwise a too-slow estimate would decline every load forever and never be corrected.

Hidden / exposed accounting (``metrics.load_hidden_s`` / ``load_exposed_s``): a demand load is
exposed from its start to its landing; a prefetch is credited when a request first reads it
(:meth:`credit_use`): exposed = ``ready - first attempt`` (at most its transfer), hidden = the
rest, where the first attempt is the earliest :meth:`note_wait` (a request skipped because the
prefetch was still in flight), else the use itself. A request admitted while a load on its
prefix is still in flight (layer-wise overlap: its prefill waits for each layer as it lands)
moves what its prefill hid from exposed to hidden (:meth:`credit_overlap`). Wasted: a prefetch
wholly evicted or whose workflow ended before any use (:meth:`mark_wasted`, :meth:`abandon`),
counted by what took it (``metrics.prefetch_wasted_by``); a tail evicted while its head stays
readable is not wasted (its pages count in ``prefetch_evicted_pages``; the store decides,
:mod:`.eviction`).

Invariant L1: ``inflight_prefetch`` = prefetch loads started and not done.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

from .metrics import CacheMetrics

Tag = Hashable  # (workflow key, agent)


@dataclass(eq=False)
class Load:
    """One host -> device transfer of a chain of nodes."""
    nodes: list                # the engine's node handles being loaded (root side first)
    pages: int
    start: float
    ready: float               # when readable (backend clock); an estimate until done if not timed
    kind: str                  # "demand" or "prefetch"
    tag: Tag | None = None
    key: Any = None            # the engine's id for it (SGLang: the anchor node id)
    timed: bool = True         # ready is known at start (our backends) vs reported (SGLang acks)
    link_start: float = 0.0    # when the link began this transfer (after the loads ahead of it)
    done: bool = False
    used: bool = False         # a request read it (prefetch)
    wasted: bool = False
    read: bool = False         # some admitted request claimed it (engines' per-request stats)
    first_wait: float | None = None  # first time a request was skipped because it was in flight
    exposed_s: float = 0.0     # what it charged to ``load_exposed_s`` (note_demand / credit_use)
    overlapped: bool = False   # a reader's prefill overlapped its rest (credit_overlap ran)

    @property
    def transfer_s(self) -> float:
        return max(0.0, self.ready - self.start)

    def layer_ready_at(self, i: int, layers: int) -> float:
        """When layer ``i`` of ``layers`` is readable: a load moves one layer after another
        over its link time (``link_start`` .. ``ready``), as SGLang's HiCache loads do."""
        return self.link_start + (self.ready - self.link_start) * (i + 1) / max(1, layers)


class LoadTracker:
    """In-flight loads, the link clock and load-versus-recompute estimates (module doc)."""

    CALIBRATION_SAMPLES = 9
    CALIBRATION_MIN_PAGES = 4
    PROBE_AFTER_DECLINES = 16
    UTILIZATION_WINDOW_S = 20.0   # several workflow steps: a fill decision sees the trend

    def __init__(self, metrics: CacheMetrics, *, secs_per_page: float | None = None,
                 recompute_s_per_token: float | None = None,
                 recompute_cost: Callable[[int, int], float] | None = None,
                 recompute_stalls: Callable[[], int] | None = None,
                 step_ema: float = 0.1, prefill_ema: float = 0.2) -> None:
        self.metrics = metrics
        self.recompute_stalls = recompute_stalls  # requests a recompute now would delay too
        self.configured_spp = secs_per_page or None
        self.measured_spp: float | None = None
        self.recompute_s_per_token = recompute_s_per_token
        self.recompute_cost = recompute_cost
        self.admission_delay_s = 0.0     # EMA of the engine's busy scheduler step
        self.measured_prefill_spt: float | None = None
        self._prefill_s = self._prefill_n = 0.0  # decayed sums behind it (observe_prefill)
        self._step_ema, self._prefill_ema = step_ema, prefill_ema
        self.link_free_at = 0.0
        self.inflight_prefetch = 0
        self.by_tag: dict = {}           # tag -> its latest prefetch Load (wasted on release)
        self._heap: list = []            # (ready, seq, Load) for timed loads
        self._inflight: dict[int, Load] = {}
        self._seq = itertools.count()
        self._spp_samples: collections.deque = collections.deque(maxlen=self.CALIBRATION_SAMPLES)
        self._declined_in_row = 0
        # (link start, ready) of recent loads; FIFO link, so they do not overlap
        self._busy_spans: collections.deque = collections.deque()

    # ------------------------------------------------------------------ costs
    @property
    def secs_per_page(self) -> float:
        """Host->device seconds per page: configured or measured; 0 while unknown."""
        return self.configured_spp or self.measured_spp or 0.0

    def link_busy_s(self, now: float) -> float:
        return max(0.0, self.link_free_at - now)

    def link_utilization(self, now: float) -> float:
        """Share of the last ``UTILIZATION_WINDOW_S`` seconds the link was carrying a load."""
        w = self.UTILIZATION_WINDOW_S
        lo, spans = now - w, self._busy_spans
        while spans and spans[0][1] <= lo:
            spans.popleft()
        busy = sum(min(e, now) - max(s, lo) for s, e in spans if s < now)
        return max(0.0, busy) / w

    def estimate_load_s(self, n_pages: int, now: float, *, admission: bool = True) -> float:
        """Seconds until ``n_pages`` started ``now`` are usable (module doc)."""
        t = self.link_busy_s(now) + n_pages * self.secs_per_page
        return t + self.admission_delay_s if admission and t > 0 else t

    @property
    def has_recompute_estimate(self) -> bool:
        return (self.recompute_cost is not None or self.recompute_s_per_token is not None
                or self.measured_prefill_spt is not None)

    def recompute_s(self, n_tokens: int, ctx_tokens: int = 0) -> float | None:
        if self.recompute_cost is not None:
            return float(self.recompute_cost(n_tokens, ctx_tokens))
        spt = self.recompute_s_per_token
        if spt is None:
            spt = self.measured_prefill_spt
        return None if spt is None else n_tokens * spt

    def recompute_cost_s(self, n_tokens: int, ctx_tokens: int = 0) -> float | None:
        """What recomputing ``n_tokens`` costs the engine, for load-versus-recompute: the
        prefill (:meth:`recompute_s`) once for this request and once for each running request
        it delays (module doc). ``recompute_s`` alone is how long the prefill takes."""
        r = self.recompute_s(n_tokens, ctx_tokens)
        if r is None or self.recompute_stalls is None:
            return r
        return r * (1 + max(0, int(self.recompute_stalls())))

    def engine_busy(self) -> bool:
        """Is a step in progress that a loaded request would wait for? Not when the engine
        runs nothing (``recompute_stalls() == 0``): it sleeps until the load lands (or, with
        layer-wise loads, until the request's own prefill can hide the rest) and starts the
        request's step then, so no admission delay is added. Unknown (no ``recompute_stalls``):
        busy, as before."""
        return self.recompute_stalls is None or int(self.recompute_stalls()) > 0

    def should_load(self, n_pages: int, recompute_s: float | None, now: float, *,
                    ready_anyway: float | None = None) -> bool:
        """``ready_anyway``: when the request's prefix is readable without this load (a load
        already in flight on its path, which it waits for either way): the load is charged
        only what it adds past that (module doc)."""
        if recompute_s is None:
            cost = 0.0
        elif ready_anyway is not None and ready_anyway > now:
            # queued behind the in-flight part on the FIFO link, the rest lands after it; the
            # wait up to ``ready_anyway`` (and the admission delay after it) is paid either way
            cost = max(0.0, now + self.estimate_load_s(n_pages, now, admission=False) - ready_anyway)
        else:
            cost = self.estimate_load_s(n_pages, now, admission=self.engine_busy())
        if recompute_s is None or cost <= recompute_s:
            self._declined_in_row = 0
            return True
        if self.configured_spp is None and self.measured_spp is not None:
            self._declined_in_row += 1
            if self._declined_in_row >= self.PROBE_AFTER_DECLINES:  # re-measure the link (doc)
                self._declined_in_row = 0
                return True
        return False

    def observe_step(self, seconds: float) -> None:
        """The engine's busy scheduler step took ``seconds`` (the admission delay, EMA)."""
        a = self._step_ema
        self.admission_delay_s = (1 - a) * self.admission_delay_s + a * max(0.0, seconds)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """The engine prefilled ``n_tokens`` in ``seconds`` (the recompute estimate).

        Token-weighted: the ratio of decayed sums of seconds and tokens, not an average of
        per-prefill ratios. A prefill of a few tokens (a request whose prompt was cached) takes
        mostly the step's fixed cost, and as a ratio it would price every token 10-100x too
        high; the question the estimate answers is what a prompt's worth of tokens costs."""
        if n_tokens <= 0 or seconds < 0:
            return
        keep = 1.0 - self._prefill_ema
        self._prefill_s = keep * self._prefill_s + seconds
        self._prefill_n = keep * self._prefill_n + n_tokens
        self.measured_prefill_spt = self._prefill_s / self._prefill_n

    # ------------------------------------------------------------------ life cycle
    def start(self, nodes: list, pages: int, kind: str, now: float, *, ready: float | None = None,
              tag: Tag | None = None, key: Any = None) -> Load:
        """Record a started load. ``ready`` None: estimated now, reported by :meth:`complete`."""
        link_start = max(now, self.link_free_at)
        timed = ready is not None
        if ready is None:
            ready = link_start + pages * self.secs_per_page
        ld = Load(list(nodes), pages, now, ready, kind, tag, key, timed, link_start)
        self._inflight[id(ld)] = ld
        if timed:
            heapq.heappush(self._heap, (ready, next(self._seq), ld))
        if kind == "prefetch":
            self.inflight_prefetch += 1
            if tag is not None:
                self.by_tag[tag] = ld
        self.link_free_at = max(self.link_free_at, ready)
        spans = self._busy_spans
        start = max(link_start, spans[-1][1]) if spans else link_start  # (an estimate cut short)
        if ready > start:
            spans.append((start, ready))
        return ld

    def due(self, now: float) -> Iterator[Load]:
        """Pop the timed loads whose ready time passed (the caller lands their nodes)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            ld = heapq.heappop(heap)[2]
            if not ld.done:
                self.complete(ld, ld.ready)
                yield ld

    def complete(self, ld: Load, now: float, *, measured_s: float | None = None) -> None:
        """``ld`` landed at ``now`` (a timed load: at its ready time). Its link time calibrates
        ``secs_per_page``; ``measured_s`` overrides it (an engine that times transfers on
        another clock; 0 = do not calibrate from this one)."""
        if ld.done:
            return
        ld.done = True
        self._inflight.pop(id(ld), None)
        if not ld.timed:
            ld.ready = now
            if self.link_free_at > now and not any(not x.done for x in self._inflight.values()):
                self.link_free_at = now  # the estimate was pessimistic: the link is free
        if ld.kind == "prefetch":
            self.inflight_prefetch -= 1
        self.observe_load(ld.pages, ld.ready - ld.link_start if measured_s is None else measured_s)

    def observe_load(self, pages: int, seconds: float) -> None:
        """A transfer of ``pages`` took ``seconds`` on the link (``secs_per_page``: median of recent
        loads of at least ``CALIBRATION_MIN_PAGES`` pages, module doc)."""
        if pages >= self.CALIBRATION_MIN_PAGES and seconds > 0:
            self._spp_samples.append(seconds / pages)
            self.measured_spp = statistics.median(self._spp_samples)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def inflight_loads(self) -> list[Load]:
        return list(self._inflight.values())

    @property
    def next_ready(self) -> float | None:
        """When the earliest in-flight load lands (estimated for untimed ones), or None."""
        heap = self._heap
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        t = heap[0][0] if heap else None
        for ld in self._inflight.values():
            if not ld.timed and (t is None or ld.ready < t):
                t = ld.ready
        return t

    # ------------------------------------------------------------------ accounting
    def note_demand(self, ld: Load, now: float) -> None:
        m = self.metrics
        m.demand_loads += 1
        m.demand_load_pages += ld.pages
        ld.exposed_s = max(0.0, ld.ready - now)
        m.load_exposed_s += ld.exposed_s

    def note_prefetch(self, ld: Load) -> None:
        self.metrics.prefetch_issued += 1
        self.metrics.prefetch_pages += ld.pages

    def note_wait(self, ld: Load, now: float) -> None:
        """A request that would run now was skipped because ``ld`` is still in flight."""
        if not ld.done and ld.first_wait is None:
            ld.first_wait = now

    def credit_use(self, ld: Load, now: float) -> None:
        """The first request reads prefetch ``ld``: split its transfer into hidden / exposed."""
        if ld.kind != "prefetch" or ld.used or ld.wasted:
            return
        ld.used = True
        m = self.metrics
        m.prefetch_used += 1
        if self.by_tag.get(ld.tag) is ld:
            del self.by_tag[ld.tag]
        first = now if ld.first_wait is None else min(ld.first_wait, now)
        transfer = ld.transfer_s
        exposed = min(transfer, max(0.0, ld.ready - max(first, ld.start)))
        m.load_hidden_s += transfer - exposed
        m.load_exposed_s += exposed
        ld.exposed_s = exposed

    def credit_overlap(self, ld: Load, since: float, waits: list[tuple[float, float]]) -> float:
        """A request admitted at ``since`` read ``ld`` while it was still in flight, its prefill
        waiting layer by layer (layer-wise overlap) during the intervals ``waits``: of the rest
        of the transfer (``since`` .. ``ready``), what it did not wait was hidden behind its
        compute. That part moves from exposed to hidden, once per load, at most what the load
        was charged (a demand load is charged from its start, a prefetch from its first
        reader's first look, both before ``since``). Returns the seconds moved."""
        if ld.overlapped or ld.wasted:
            return 0.0
        ld.overlapped = True
        rest = max(0.0, ld.ready - since)
        waited = sum(max(0.0, min(b, ld.ready) - max(a, since)) for a, b in waits)
        moved = min(ld.exposed_s, max(0.0, rest - waited))
        ld.exposed_s -= moved
        self.metrics.load_exposed_s -= moved
        self.metrics.load_hidden_s += moved
        return moved

    def mark_wasted(self, ld: Load | None, reason: str) -> None:
        """``ld``'s pages left the device before any request read it (``reason``: what evicted
        them, or ``"workflow_end"``)."""
        if ld is None or ld.kind != "prefetch" or ld.used or ld.wasted:
            return
        ld.wasted = True
        self.metrics.prefetch_wasted += 1
        self.metrics.prefetch_wasted_by[reason] += 1
        if self.by_tag.get(ld.tag) is ld:
            del self.by_tag[ld.tag]

    def abandon(self, tag: Tag) -> None:
        """``tag``'s workflow ended: its unused prefetch was fetched for nothing."""
        self.mark_wasted(self.by_tag.pop(tag, None), "workflow_end")
