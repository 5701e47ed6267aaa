"""Loads in the SGLang plugin: what :class:`~.cache.KVFlowRadixCache` does with SGLang's
load-backs (a mixin, first in its bases, so these overrides wrap ``UnifiedRadixCache``'s).

- Every load-back, demand (``init_load_back``) or proactive (``load_back`` from the policy
  core's :class:`~kvflow_agents.serving.policy.Prefetcher`, through :class:`_SGLangTarget`), is
  tracked by the core's ``LoadTracker`` until SGLang reaps its ack (``loading_check``); the
  measured durations calibrate the link estimate. A demand load is skipped, and the host part
  recomputed, when the estimate exceeds recomputing.
- Proactive loads run on their own layer-counter ring (``_proactive_ring``), at most
  ``max_inflight_prefetch`` at once, and land *unread*: the first request whose match reads one
  credits it (``match_prefix``); one that leaves the device unread is wasted (``_landed_lost``).
- Status-aware admission: :meth:`KVFlowLoads.kvflow_blocked` says whether a queued request's
  match runs through a node still being loaded (``hooks.around_add_one_req`` skips it); a
  host-only rest below that node is loaded at once, behind it (``_queue_rest``).
- The scheduler's views it reads (``kvflow_watch_scheduler``, from the intake hook): the
  waiting queue (the prefetch reserve) and the running batch; and, while SGLang's
  ``PrefillAdder`` decides on a request, that adder (``kvflow_prefill_round``). The running
  batch and the adder's prefill batch so far are the requests a recompute would stall
  (``_recompute_stalls``): the demand decision and the prefetch planner weigh a recompute with
  them, as the embedded engine weighs it with its running requests.

State lives on the cache (set in ``KVFlowRadixCache._kv_reset_state``): ``_kv_loads``,
``_inflight``, ``_inflight_nodes``, ``_kv_ring``, ``_kv_landed``, ``_kv_queue``,
``_kv_running``, ``_kv_adder``.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

if TYPE_CHECKING:
    from .cache import KVFlowRadixCache

logger = logging.getLogger(__name__)

FULL = ComponentType.FULL


@dataclass
class InflightLoad:
    """A load in flight on the proactive ring: the nodes whose KV has not landed yet."""
    load: Any                       # the LoadTracker's Load
    nodes: tuple                    # SGLang tree nodes being loaded (device values not landed)
    asked: set = field(default_factory=set)  # rids whose host rest was weighed behind it


class _SGLangTarget:
    """The :class:`~kvflow_agents.serving.policy.PrefetchTarget` over SGLang's tree."""

    evicts = True
    partial_prefetch = False  # SGLang's load_back loads a node's whole host-only path
    state_ver = None          # SGLang's tree keeps no change counter: plan on every tick

    def __init__(self, cache: "KVFlowRadixCache") -> None:
        self.cache = cache

    def host_pages(self, node) -> int:
        c = self.cache
        if not c._alive(node) or not node.evicted or not node.backuped or node.id in c._kv_loads:
            return 0
        pages, n = 0, node
        while n is not None and n.evicted:
            pages += len(n.key) // c.page_size if n.key is not None else 0
            n = n.parent
        return pages

    def free_pages(self) -> int:
        return self.cache._component_available_size(FULL) // self.cache.page_size

    def evictable_pages(self) -> int:
        return self.cache.evictable_size() // self.cache.page_size

    def evictable_above(self, ste: float) -> int:
        c = self.cache
        prio, tokens = c.kv_index.priority, 0
        for n in c.tree_core._node_arena.values():
            if (n.parent is not None and not n.evicted and n.key is not None
                    and n.component_data[FULL].lock_ref == 0 and prio(n) > ste):
                tokens += len(n.key)
        return tokens // c.page_size

    def start_prefetch(self, cand, now: float):
        return self.cache._start_prefetch(cand, now)


class KVFlowLoads:
    """The load-back half of :class:`~.cache.KVFlowRadixCache` (module doc)."""

    # ------------------------------------------------------------------ landed prefetches
    def _evict_device_leaf(self, node_id, tracker):
        backup = super()._evict_device_leaf(node_id, tracker)
        if self._kv_landed:
            self._landed_lost(node_id)  # HiCache demotes it to host: it stays in the tree
        return backup

    def _landed_lost(self, node_id) -> None:
        """A node of a landed, unread prefetch left the device (demoted to host or dropped):
        the prefetch was fetched for nothing (``prefetch_wasted``), and a later load of the
        same prefix is not credited to it."""
        ld = self._kv_landed.pop(node_id, None)
        if ld is None:
            return
        for n in ld.nodes:
            self._kv_landed.pop(n.id, None)
        self.kv_loads.mark_wasted(ld, "alloc")  # SGLang evicts when it allocates

    # ------------------------------------------------------------------ loads
    def check_hicache_events(self) -> None:
        super().check_hicache_events()
        if self.cache_controller is None or self.disable:
            return
        try:
            self._observe_step()
            self.kvflow_expire()
            self.kvflow_prefetch()
        except Exception:
            logger.exception("kvflow: prefetch step failed")

    def loading_check(self, finish_count=None) -> None:
        super().loading_check(finish_count)
        if not self._kv_loads:
            return
        now, wall = self._kv_now(), time.perf_counter()
        multi = self._multi_rank()
        for anchor in [a for a in self._kv_loads if a not in self.ongoing_load_back]:
            ld = self._kv_loads.pop(anchor)
            measured = wall - ld.wall_start
            if multi:  # calibrate locally; decisions use the rank-agreed values
                self._kv_local.observe_load(ld.pages, measured)
                measured = 0.0
            self.kv_loads.complete(ld, now, measured_s=measured)
            inf = self._inflight.pop(anchor, None)
            if inf is not None:
                for n in inf.nodes:
                    self._inflight_nodes.pop(n.id, None)
                if ld.kind == "prefetch":  # landed, unread: the first reader credits it
                    for n in ld.nodes:
                        self._kv_landed[n.id] = ld

    def init_load_back(self, params):
        """SGLang's demand load (prefill admission), unless recomputing the host part is
        cheaper than waiting for the link (the policy core's ``should_load``)."""
        req = params.req
        host_len = int(getattr(params, "host_hit_length", 0) or 0)
        pages = host_len // self.page_size
        if (pages > 0 and req is not None and self.buffer_pipeline is None
                and getattr(self, "linker", None) is None):
            now = self._kv_now()
            device_len = len(getattr(req, "prefix_indices", ()) or ())
            # the policy core's cost: the prefill, once for this request and once for each
            # request it would stall (_recompute_stalls)
            rec = self.kv_loads.recompute_cost_s(host_len, device_len)
            if not self.kv_loads.should_load(pages, rec, now):
                self.kv_metrics.loads_declined += 1
                self.kv_metrics.declined_pages += pages
                return 0, req.last_node
        out = super().init_load_back(params)
        anchor = params.best_match_node
        if out is not None and out[0] > 0 and anchor in self.ongoing_load_back \
                and anchor not in self._kv_loads:
            ld = self.kv_loads.start([], out[0] // self.page_size, "demand", self._kv_now(),
                                     key=anchor)
            ld.wall_start = time.perf_counter()
            self._kv_loads[anchor] = ld
            self.kv_loads.note_demand(ld, self._kv_now())
        return out

    def match_prefix(self, params):
        result = super().match_prefix(params)
        if self._kv_landed and getattr(params, "req", None) is not None:
            self._credit_landed(result)
        return result

    def _credit_landed(self, result) -> None:
        node = self.tree_core._node_arena.get(result.last_device_node)
        now = self._kv_now()
        while node is not None:
            ld = self._kv_landed.get(node.id)
            if ld is not None:
                self.kv_loads.credit_use(ld, now)
                for n in ld.nodes:
                    self._kv_landed.pop(n.id, None)
            node = node.parent

    def kvflow_watch_scheduler(self, waiting: Callable[[], list],
                               running: Optional[Callable[[], Any]] = None) -> None:
        """Where the scheduler's waiting queue (the prefetch reserve reads it) and running
        batch (``_recompute_stalls``) are; callables, since SGLang replaces its batches."""
        self._kv_queue = waiting
        if running is not None:
            self._kv_running = running

    @contextmanager
    def kvflow_prefill_round(self, adder):
        """SGLang's ``PrefillAdder`` is deciding on a request (``hooks.around_add_one_req``):
        a demand load-back weighed meanwhile counts the requests it would stall from it."""
        self._kv_adder = adder
        try:
            yield
        finally:
            self._kv_adder = None

    def _recompute_stalls(self) -> int:
        """The requests a recompute would delay besides its own (the core's
        ``recompute_stalls``): SGLang's running decode batch, which waits for the prefill
        batch, and, inside an adder's round, the requests it already put in that batch."""
        adder = self._kv_adder
        if adder is not None:
            running = getattr(adder, "running_batch", None)
        else:
            running = self._kv_running() if self._kv_running is not None else None
        n = len(getattr(running, "reqs", None) or ())
        if adder is not None:
            n += len(getattr(adder, "can_run_list", None) or ())
        return n

    # ------------------------------------------------------------------ prefetch
    def _reserve_pages(self) -> int:
        """Device pages the waiting queue will still allocate (the prefetch budget's reserve)."""
        if self._kv_queue is None:
            return 0
        tokens = 0
        for i, r in enumerate(self._kv_queue() or ()):
            if i >= self.reserve_window:
                break
            try:  # prefix_len: what the scheduler's last match found on device (0 before)
                want = len(r.origin_input_ids) + int(r.sampling_params.max_new_tokens or 0)
                tokens += max(0, want - int(getattr(r, "prefix_len", 0) or 0))
            except (AttributeError, TypeError):
                continue
        return -(-tokens // self.page_size)

    def kvflow_prefetch(self) -> list:
        """Start loads for near agents whose tagged prefix is host-only. Returns the tags."""
        if self.cache_controller is None:
            return []
        book = self.kv_book
        if book.lookahead != self.lookahead:
            book.set_lookahead(self.lookahead)
        self.kv_prefetcher.max_inflight = self.max_inflight_prefetch
        self.kv_prefetcher.planner.busy_lookahead = self.busy_lookahead
        started = self.kv_prefetcher.run(self._kv_now())
        if started:
            # Start the H2D copies now, on the proactive loads' own ring slot: no batch
            # consumes them, so admission keeps requests off these nodes until the acks
            # (loading_check), and SGLang's ring stays the demand loads' (see _proactive_ring).
            with self._proactive_ring():
                self.cache_controller.start_loading()
        return started

    # SGLang's LayerDoneCounter is a ring of 3 per-layer event sets, sized for the overlap
    # scheduler: a demand load's slot is reused only after the batch that consumed it has run,
    # which the scheduler's pacing guarantees (and SGLang asserts). A proactive load has no
    # consuming batch, so on that ring it would hold a slot for as long as the link takes and a
    # later demand load would reuse it in flight. Proactive loads get a ring of their own: one
    # slot more than the prefetch in-flight cap, and a slot is taken only when its last load
    # has landed. The forward never waits on it (no batch names it as consumer).
    def _proactive_counter(self):
        cc = self.cache_controller
        n = max(2, int(self.max_inflight_prefetch) + 1)
        ring = self._kv_ring
        if ring is None or ring.num_counters != n:
            from sglang.srt.managers.cache_controller import LayerDoneCounter

            ring = LayerDoneCounter(cc.layer_done_counter.num_layers)
            if ring.num_counters != n:  # SGLang builds 3; size it to the cap
                ring.num_counters = n
                ring.events = [type(ring.events[0])(ring.num_layers) for _ in range(n)]
            self._kv_ring = ring
        return ring

    def _proactive_slot_free(self) -> bool:
        ring = self._proactive_counter()
        nxt = (ring.producer_index + 1) % ring.num_counters
        return bool(ring.events[nxt].finish_event.query())

    @contextmanager
    def _proactive_ring(self):
        cc = self.cache_controller
        main, cc.layer_done_counter = cc.layer_done_counter, self._proactive_counter()
        try:
            yield
        finally:
            cc.layer_done_counter = main

    def _start_prefetch(self, cand, now: float):
        """The prefetch target's start: SGLang's ``load_back`` with the eviction floor."""
        if not self._proactive_slot_free():
            self.kv_stats["prefetch_skipped_no_slot"] += 1
            return None
        ld = self._load_on_ring(cand.node, "prefetch", now, floor=cand.ste, tag=cand.tag)
        if ld is None:
            self.kv_stats["prefetch_declined"] += 1
        return ld

    def _load_on_ring(self, node, kind: str, now: float, *, floor: float, tag=None):
        """SGLang's ``load_back`` of ``node``'s evicted path (eviction stops at ``floor``),
        tracked until its ack as a load in flight on the proactive ring: requests whose match
        runs through it are held (:meth:`kvflow_blocked`). None if SGLang declined it."""
        loading, n = [], node
        while n is not None and n.evicted:
            loading.append(n)
            n = n.parent
        ntok = sum(len(x.key) for x in loading)
        with self._eviction_floor(floor):
            ok = self.load_back(node.id)
        if not ok:
            return None
        loading.reverse()
        ld = self.kv_loads.start(loading, ntok // self.page_size, kind, now, tag=tag, key=node.id)
        ld.wall_start = time.perf_counter()
        self._kv_loads[node.id] = ld
        inf = self._inflight[node.id] = InflightLoad(ld, tuple(loading))
        for n in loading:
            self._inflight_nodes[n.id] = inf
        return ld

    def _queue_rest(self, req, head: InflightLoad) -> None:
        """``req`` is held for ``head`` (a prefetch of its agent's prefix) and the rest of its
        match is host-only (say, its own history below the tag): load the rest now, behind the
        head on the link, charged only what it adds past the head's landing. Left to
        ``init_load_back`` at admission, the next agent's prefetch may hold the link by then
        and the rest be recomputed (the embedded engine's ``RequestSession._queue_rest``,
        bench/RESULTS.md 6.57). Weighed once per request and head; a declined rest is
        weighed again at admission."""
        host_len = int(getattr(req, "host_hit_length", 0) or 0)
        node = self.tree_core._node_arena.get(getattr(req, "last_host_node", None))
        rid = getattr(req, "rid", None)
        if (host_len < self.page_size or node is None or not node.evicted or rid in head.asked
                or node.id in self._kv_loads or self.buffer_pipeline is not None
                or getattr(self, "linker", None) is not None or not self._proactive_slot_free()):
            return
        head.asked.add(rid)
        now = self._kv_now()
        rec = self.kv_loads.recompute_cost_s(host_len, int(getattr(req, "prefix_len", 0) or 0))
        if not self.kv_loads.should_load(host_len // self.page_size, rec, now,
                                         ready_anyway=head.load.ready):
            return
        ld = self._load_on_ring(node, "demand", now, floor=0.0)
        if ld is None:
            head.asked.discard(rid)  # no room now: weighed again next round
            return
        self.kv_loads.note_demand(ld, now)
        self.kv_stats["rest_queued"] += 1
        with self._proactive_ring():
            self.cache_controller.start_loading()

    # ------------------------------------------------------------------ status-aware admission
    def kvflow_has_inflight(self) -> bool:
        return bool(self._inflight)

    def kvflow_blocked(self, req) -> bool:
        """Whether ``req``'s matched device prefix runs through a node whose proactive load
        has not landed (the wait is recorded: the load's exposed time runs from the first
        request it holds back).

        Structural: SGLang's own match of the request (``req.last_node``, set by
        ``init_next_round_input`` right before admission, with whatever key SGLang builds:
        page-aligned, EAGLE bigrams, extra keys) is walked up to the root against the set of
        nodes being loaded. SGLang counts a node as on device from the moment its load starts;
        this is the check that it is not readable yet. Cost: the path's depth, no token read.
        """
        if not self._inflight_nodes:
            return False
        handle = getattr(req, "last_node", None)
        node = self.tree_core._node_arena.get(handle) if handle is not None else None
        root = self.tree_core.root_node
        while node is not None and node is not root:
            inf = self._inflight_nodes.get(node.id)
            if inf is not None:
                self.kv_loads.note_wait(inf.load, self._kv_now())
                if getattr(req, "host_hit_length", 0):
                    self._queue_rest(req, inf)
                return True
            node = node.parent
        return False
