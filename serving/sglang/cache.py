"""``KVFlowRadixCache``: SGLang's ``UnifiedRadixCache`` with workflow-aware eviction and prefetch.

SGLang keeps its own tree, scheduler and transfers; this adapter runs the policy core's parts
over them (``kvflow_agents.serving.policy``), so the plugin shares one implementation with the
embedded engine and the simulator:

- :class:`~kvflow_agents.serving.policy.TagBook` (``kv_book``): tags, hints with leases, the
  priority index, boundary inference, app-prefix memory. The adapter only finds the node where
  a fixed prefix ends (:meth:`_prefix_node`: SGLang's own prompt-boundary split trick, a re-insert
  with ``prev_prefix_len``) and keeps the index in step with SGLang's splits and leaf removals.
- :class:`~.strategy.KVFlowStrategy` (``--radix-eviction-policy kvflow``, ``strategy.py``):
  SGLang's heap pops the smallest ``KVFlowPolicy.eviction_key(priority, last_access_time)``:
  largest STE first, LRU among equals.
  With no tags every key is ``(-inf, last_access)``: exactly SGLang's LRU.
- :class:`~kvflow_agents.serving.policy.Prefetcher` (``kv_prefetcher``) over a target whose
  ``start_prefetch`` is SGLang's ``load_back`` (eviction floored at the fetched agent's STE: no
  thrash), with the core's prefetch reserve (what the scheduler's waiting queue will still
  allocate), in-flight cap and load-vs-recompute plan.
- :class:`~kvflow_agents.serving.policy.LoadTracker` (``kv_loads``): every load-back, demand
  or prefetch, is tracked until its ack is reaped (``loading_check``); the measured durations
  calibrate the link estimate (seconds per page) the planner and the demand decision use. A
  demand load (``init_load_back``) is skipped, and the host part recomputed, when the estimate
  (link queue + transfer + one scheduler step while requests run) exceeds recomputing (the
  prefill speed measured per batch, or ``recompute_s_per_token``, times 1 + the requests the
  recompute would stall: SGLang's running batch and the round's prefill batch so far). A
  request held back because its prefix is still loading records the wait
  (:meth:`kvflow_blocked`): exposed load time;
  the first request that reads a prefetch credits it (hidden / exposed, ``kv_metrics``). These
  overrides of SGLang's load path live in ``loads.py`` (:class:`~.loads.KVFlowLoads`, a mixin
  of this class).
- :class:`~kvflow_agents.serving.policy.toolgap.ToolGaps` (``kv_gaps``): a tool hint
  (``kvflow_tool_s``) gives the waiting agent's whole last turn (SGLang's record of the finished
  request) a resume tag in the same book, with its time plan (moved in :meth:`kvflow_expire`);
  an agent whose prompts extend its last turn gets one at its own STE (a turn gap).
- :class:`~kvflow_agents.serving.policy.admission.AdmissionOrder` (``kv_admission``): each
  queued request's admission key; ``hooks.after_calc_priority`` sorts SGLang's queue by it.
- :mod:`~kvflow_agents.serving.policy.inspection`: the snapshot's agents and workflows.

Hint intake, the admission key and the hint book's upkeep live in ``hints.py``
(:class:`~.hints.KVFlowHints`, a mixin of this class, like :class:`~.loads.KVFlowLoads`);
placing fixed-prefix tags in SGLang's tree and recording finished turns, in ``tagging.py``
(:class:`~.tagging.KVFlowTagging`).

Every decision is a function of what all TP ranks see identically (broadcast requests, the
tree, rank-agreed acks, a rank-agreed clock and, with several ranks, rank-agreed calibration:
see :meth:`_kv_tick`), so ranks agree, as SGLang's ``rank_consensus`` checks for
``insert``/``evict``. SGLang is imported here, and only inside ``serving/sglang``.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvflow_agents.serving.policy import (CacheMetrics, KVFlowPolicy, LoadTracker, Prefetcher,
                                          PriorityIndex, TagBook)
from kvflow_agents.serving.policy.admission import AdmissionOrder
from kvflow_agents.serving.policy.inspection import agents_view, workflows_view
from kvflow_agents.serving.policy.toolgap import ToolGaps

from .hints import KVFlowHints, ReqHints
from .loads import InflightLoad, KVFlowLoads, _SGLangTarget
from .strategy import POLICY_NAME, KVFlowStrategy, ensure_eviction_policy_registered
from .tagging import KVFlowTagging

logger = logging.getLogger(__name__)

INF = math.inf
FULL = ComponentType.FULL


class KVFlowRadixCache(KVFlowTagging, KVFlowHints, KVFlowLoads, UnifiedRadixCache):
    """UnifiedRadixCache + KVFlow tags, STE eviction order and proactive load-back."""

    # Tunables (class attributes so a launcher / test can set them; plain ints and floats)
    lookahead: float = 1
    busy_lookahead: Optional[float] = None  # agents beyond it load only on an idle link
    lease_s: float = 60.0
    max_inflight_prefetch: int = 2   # proactive loads in flight (their own ring has one slot more)
    infer_window: int = 3
    default_step_s: float = 1.0
    recompute_s_per_token: Optional[float] = None  # None: measured prefill speed
    reserve_window: int = 64         # waiting requests counted in the prefetch reserve
    admission: str = "workflow"      # waiting-queue order (policy/admission.py; hooks.py sorts)
    skip_scope: str = KVFlowPolicy.skip_scope  # who may go ahead of a loading request (hooks.py)

    def __init__(self, params, **kwargs) -> None:
        ensure_eviction_policy_registered()
        backend = params.tree_core_backend
        if backend is None:
            from sglang.srt.environ import envs

            backend = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.get()
        if backend == "rust":
            # The Rust TreeCore maps policy names to native code and rejects custom ones.
            logger.info("kvflow: using the Python TreeCore (the Rust core has no custom policies)")
            params = replace(params, tree_core_backend="python")
        for k, v in kwargs.items():
            if not hasattr(type(self), k):
                raise TypeError(f"KVFlowRadixCache: unknown option {k!r}")
            setattr(self, k, v)
        self._kv_ready = False
        super().__init__(params)
        core = self.tree_core
        if not (hasattr(core, "_split_node") and hasattr(core, "_remove_leaf_from_parent")):
            raise TypeError(f"KVFlowRadixCache needs SGLang's Python TreeCore, got {type(core).__name__}")
        strategy = getattr(core, "eviction_strategy", None)
        if isinstance(strategy, KVFlowStrategy):  # --radix-eviction-policy-config wins
            for k, v in strategy.options.items():
                if v is not None:
                    setattr(self, k, v)
        # Rank-agreed clock for leases (see _kv_now); identical on every rank from the start.
        self._kv_steps = 0
        self._kv_clock = 0.0
        self._kv_reset_state()
        self._install_tree_hooks()
        self._kv_ready = True

    # ------------------------------------------------------------------ setup
    def _kv_reset_state(self) -> None:
        self.kv_metrics = CacheMetrics()
        self.kv_book = TagBook(page_size=self.page_size, parent_of=lambda n: n.parent,
                               alive=self._alive, lookahead=self.lookahead, lease_s=self.lease_s,
                               infer_window=self.infer_window, locate=self._locate)
        self.kv_loads = LoadTracker(self.kv_metrics, recompute_s_per_token=self.recompute_s_per_token,
                                    recompute_stalls=self._recompute_stalls)
        # several ranks: local measurements, agreed on at each clock sync (_kv_tick)
        self._kv_local = LoadTracker(CacheMetrics())
        self.kv_prefetcher = Prefetcher(self.kv_book, self.kv_loads, self.kv_metrics,
                                        _SGLangTarget(self), page_size=self.page_size,
                                        max_inflight=self.max_inflight_prefetch,
                                        default_step_s=self.default_step_s,
                                        reserve=self._reserve_pages,
                                        busy_lookahead=self.busy_lookahead)
        strategy = getattr(self.tree_core, "eviction_strategy", None)
        self.kv_strategy_bound = isinstance(strategy, KVFlowStrategy)
        if self.kv_strategy_bound:
            strategy.bind(self.kv_index)
        elif self.tree_components:
            logger.warning("kvflow: eviction policy is %s, not 'kvflow': STE hints will tag and "
                           "prefetch but not reorder eviction", type(strategy).__name__)
        self.kv_admission = AdmissionOrder(self.admission)
        # tool gaps (kvflow_tool_s): the waiting agent's whole last turn gets a resume tag
        self.kv_gaps = ToolGaps(self.kv_book, load_s=self._host_load_s)
        self._req_hints: dict[Any, ReqHints] = {}
        self._kv_loads: dict[int, Any] = {}        # anchor node id -> Load (demand + prefetch)
        self._inflight: dict[int, InflightLoad] = {}  # anchor node id -> proactive load
        self._inflight_nodes: dict[int, InflightLoad] = {}  # every node id being loaded -> it
        self._kv_ring = None   # the proactive loads' own layer-counter ring (_proactive_ring)
        self._kv_landed: dict[int, Any] = {}       # loaded node id -> landed, unread prefetch
        self._kv_queue: Optional[Callable[[], list]] = None
        self._kv_running: Optional[Callable[[], Any]] = None  # SGLang's running batch
        self._kv_adder = None  # the PrefillAdder of the add_one_req in progress (_recompute_stalls)
        self._kv_last_step: Optional[float] = None
        self._kv_prefills: dict[float, list] = {}   # batch forward entry -> [tokens, end]
        self._evict_floor: Optional[float] = None
        self.kv_stats = {"tags": 0, "prefetch_skipped_no_slot": 0, "prefetch_declined": 0,
                         "hints": 0, "hint_errors": 0, "stale_hints": 0, "requeued": 0,
                         "blocked_polls": 0, "held_for_workflow": 0, "floor_stops": 0,
                         "inferred_tags": 0, "queue_sorts": 0, "rest_queued": 0}

    @property
    def kv_index(self) -> PriorityIndex:
        return self.kv_book.index

    @property
    def kv_hints(self):
        return self.kv_book.hints

    def _install_tree_hooks(self) -> None:
        """Keep the priority index in step with the tree: SGLang's TreeCore splits nodes
        (the new node becomes the *parent*; the tagged lower node keeps its identity and
        end position) and removes leaves. Wrapped on this core instance only."""
        core = self.tree_core
        orig_split = core._split_node
        orig_remove = core._remove_leaf_from_parent
        cache = self

        def _split_node(key, child, split_len):
            new_node, action = orig_split(key, child, split_len)
            cache.kv_index.on_split(new_node, child)
            return new_node, action

        def _remove_leaf_from_parent(node):
            orig_remove(node)
            cache._landed_lost(node.id)  # a landed prefetch dropped unread (ids are not reused)
            try:
                cache.kv_book.node_removed(node)
                cache.kv_index.drop_node(node)
            except AssertionError:  # should not happen; never let bookkeeping crash serving
                logger.exception("kvflow: index out of step on node removal; rebuilding")
                cache._rebuild_index()

        core._split_node = _split_node
        core._remove_leaf_from_parent = _remove_leaf_from_parent

    def _rebuild_index(self) -> None:
        self.kv_book.rebuild_index()
        if self.kv_strategy_bound:
            self.tree_core.eviction_strategy.bind(self.kv_index)

    def reset(self) -> None:
        super().reset()
        if getattr(self, "_kv_ready", False):
            self._kv_reset_state()

    # ------------------------------------------------------------------ helpers
    def _alive(self, node) -> bool:
        return self.tree_core._node_arena.get(node.id) is node

    @staticmethod
    def _key_tokens(node) -> list:
        return list(node.key.token_ids) if node.key is not None else []

    def _path_tokens(self, node) -> list:
        chunks, n, root = [], node, self.tree_core.root_node
        while n is not None and n is not root:
            chunks.append(self._key_tokens(n))
            n = n.parent
        out: list = []
        for c in reversed(chunks):
            out.extend(c)
        return out

    def _residency(self, node) -> str:
        if node is None or not self._alive(node):
            return "none"
        n = node
        while n is not None and n is not self.tree_core.root_node:
            if n.evicted:
                return "host"
            n = n.parent
        if node.id in self._inflight_nodes:
            return "loading"
        return "device"

    # ------------------------------------------------------------------ time and calibration
    CLOCK_SYNC_STEPS = 32

    def _multi_rank(self) -> bool:
        return self.tp_world_size > 1 or (self.pp_size or 1) > 1

    def _kv_now(self) -> float:
        """The clock leases and load estimates use. Single rank: the local monotonic clock.
        Several ranks: a value all ranks agreed on (MIN all-reduce every CLOCK_SYNC_STEPS
        scheduler steps, see :meth:`kvflow_step`), so a lease expires at the same step
        everywhere and eviction stays identical across ranks."""
        if not self._multi_rank():
            return self._local_clock()
        return self._kv_clock

    @staticmethod
    def _local_clock() -> float:
        # Monotonic, not time.time(): a wall-clock step (NTP, a VM resumed) would expire every
        # lease at once, or keep them for ever. Across ranks the MIN all-reduce agrees on one
        # rank's clock (on several hosts, whichever booted last), which advances like any other.
        return time.monotonic()

    def kvflow_step(self) -> None:
        """Once per scheduler loop iteration, on every rank at the same point of its request
        stream (the hook on ``process_input_requests``): the only place the plugin runs a
        collective. Never from eviction or allocation: SGLang does not make those collective
        (a rank may evict alone), and an all-reduce there would wait forever for the others."""
        if getattr(self, "_kv_ready", False):
            self._kv_tick()

    def _kv_tick(self) -> None:
        self._kv_steps += 1
        if self._kv_prefills:
            self._time_prefills()
        if self._multi_rank() and self._kv_steps % self.CLOCK_SYNC_STEPS == 1:  # first, then every N
            import torch

            # One MIN all-reduce: [clock, -calibration...] = [min clock, -max calibration];
            # the slowest rank's link, step and prefill speed (0 = not measured yet).
            loc = self._kv_local
            ns = [int((v or 0.0) * 1e9) for v in (loc.measured_spp, loc.admission_delay_s,
                                                  loc.measured_prefill_spt)]
            t = torch.tensor([int(self._local_clock() * 1000)] + [-x for x in ns],
                             dtype=torch.int64, device="cpu")
            self._all_reduce(t, torch.distributed.ReduceOp.MIN)
            self._kv_clock = int(t[0].item()) / 1000.0
            spp, step, spt = (-int(x.item()) / 1e9 for x in t[1:])
            self.kv_loads.measured_spp = spp or None
            self.kv_loads.admission_delay_s = step
            self.kv_loads.measured_prefill_spt = spt or None

    def _calibration(self) -> LoadTracker:
        """Where local measurements go: the live tracker (one rank) or the local one."""
        return self._kv_local if self._multi_rank() else self.kv_loads

    def _observe_step(self) -> None:
        wall = time.perf_counter()
        last, self._kv_last_step = self._kv_last_step, wall
        if last is not None and wall - last < 0.5:  # a busy loop; longer gaps are idle time
            self._calibration().observe_step(wall - last)

    def _host_load_s(self, node) -> float:
        """Link time to bring ``node``'s host-only path back (0 on device): a tool gap's lead."""
        pages = self.kv_prefetcher.target.host_pages(node) if node is not None else 0
        return self.kv_loads.estimate_load_s(pages, self._kv_now()) if pages else 0.0

    # ------------------------------------------------------------------ prefill timing
    def _note_prefill(self, req) -> None:
        """Add a request whose prefill just finished to its batch's prefill timing (every
        request, hinted or not: they share the batch's forward time)."""
        if getattr(req, "kvflow_prefill_noted", False):
            return
        ts = getattr(req, "time_stats", None)
        t0, t1 = getattr(ts, "forward_entry_time", 0.0), getattr(ts, "prefill_finished_time", 0.0)
        if not (t0 and t1 and t1 > t0):
            return  # a middle chunk: its prefill has not finished
        req.kvflow_prefill_noted = True
        n = len(req.origin_input_ids) - int(getattr(req, "cached_tokens", 0) or 0)
        if t0 not in self._kv_prefills and len(self._kv_prefills) >= 64:
            self._time_prefills()  # no scheduler step came (the cache driven on its own)
        batch = self._kv_prefills.setdefault(t0, [0, t1])
        batch[0] += max(0, n)
        batch[1] = max(batch[1], t1)

    def _time_prefills(self) -> None:
        """The prefill speed (the recompute estimate), one sample per prefill batch.

        SGLang stamps every request of a new prefill batch with one ``forward_entry_time``
        (``set_time_batch``), and each request's ``prefill_finished_time`` is the batch's end:
        one request's ``t1 - t0`` is the whole batch's time. Divided by that request's own
        tokens it priced a token up to 100x too high when a request with a cached prompt shared
        the batch with an uncached one; summed per batch it is the batch's tokens per second.
        Called at the next scheduler step, after every request of the batch was cached."""
        batches, self._kv_prefills = self._kv_prefills, {}
        for t0, (n, t1) in batches.items():
            if n > 0:
                self._calibration().observe_prefill(n, t1 - t0)

    # ------------------------------------------------------------------ eviction
    def _evict(self, params, available_size_targets=None, *, allocation_reclaim_satisfied=None):
        # Leases are checked right before eviction decisions, on the rank-agreed clock (no
        # collective here: a rank may evict alone; the clock advances in kvflow_step).
        if getattr(self, "_kv_ready", False):
            try:
                self.kvflow_expire()
            except Exception:
                logger.exception("kvflow: lease check failed")
        return super()._evict(params, available_size_targets,
                              allocation_reclaim_satisfied=allocation_reclaim_satisfied)

    @contextmanager
    def _eviction_floor(self, floor: float):
        """While active, device eviction stops before a node whose priority is <= floor."""
        prev = self._evict_floor
        self._evict_floor = floor
        try:
            yield
        finally:
            self._evict_floor = prev

    def _evict_device_next_node(self, component_type, tracker):
        node_id, progress = super()._evict_device_next_node(component_type, tracker)
        floor = self._evict_floor
        if floor is not None and node_id is not None and component_type == FULL:
            node = self.tree_core._node_arena.get(node_id)
            if node is not None and self.kv_index.priority(node) <= floor:
                self.kv_stats["floor_stops"] += 1
                return None, False  # stop the walk: the rest is at least as urgent
        return node_id, progress

    # ------------------------------------------------------------------ introspection
    def kvflow_snapshot(self) -> dict:
        loads = self.kv_loads
        return {
            "engine": "sglang",
            "policy": POLICY_NAME if self.kv_strategy_bound else type(self.tree_core.eviction_strategy).__name__,
            "hicache": self.cache_controller is not None,
            "page_size": self.page_size,
            "lookahead": self.lookahead,
            "device": {"evictable": self.evictable_size(), "protected": self.protected_size(),
                       "available": self._component_available_size(FULL)},
            "loads_in_flight": loads.in_flight,
            "link": {"secs_per_page": loads.secs_per_page,
                     "admission_delay_s": loads.admission_delay_s,
                     "recompute_s_per_token": loads.recompute_s_per_token or loads.measured_prefill_spt},
            "workflows": workflows_view(self.kv_hints),
            "agents": agents_view(self.kv_book, self._residency),
            "gaps": self.kv_gaps.as_dict(),
            "metrics": self.kv_metrics.as_dict(),
            "stats": dict(self.kv_stats),
        }
