"""``KVFlowRadixCache``: SGLang's ``UnifiedRadixCache`` with workflow-aware eviction and prefetch.

A thin adapter from SGLang's radix tree to the policy core (``kvflow_agents.serving.policy``):

- **Tags.** When a request with hints is cached (``checkpoint_into_tree``), the node where its
  agent's fixed prefix ends is split off (the same re-insert trick SGLang uses for the prompt
  boundary) and tagged ``(workflow, agent)`` in a :class:`~kvflow_agents.serving.policy.PriorityIndex`.
  The fixed-prefix length comes from ``kvflow_fixed_prefix_tokens`` (the HTTP layer turns
  ``kvflow_fixed_messages`` into tokens with the chat template), else it is inferred from the
  agent's recent requests (longest common prefix, as the policy core does).
- **Priorities.** STE per tag lives in the policy core's :class:`HintRegistry` (leases, merge,
  null = inf). Node priority = min STE of the tags in its subtree (the index), +inf elsewhere.
- **Eviction.** :class:`KVFlowStrategy` is an SGLang ``EvictionStrategy`` returning the policy
  core's ``KVFlowPolicy.eviction_key(priority, last_access_time)``: largest STE first, LRU among
  equals. SGLang rebuilds its eviction heap from ``get_priority`` on every eviction call, so a
  new hint takes effect at the next eviction. With no tags every key is ``(-inf, last_access)``,
  i.e. exactly SGLang's LRU: without hints this is SGLang + HiCache as shipped.
- **Prefetch.** Each scheduler step (``check_hicache_events``) the policy core's
  :class:`PrefetchPlanner` orders the agents with STE <= lookahead whose tagged prefix is
  host-only; each is loaded with SGLang's own ``load_back`` while a free load slot exists
  (``has_free_load_back_slot``), and the eviction that makes room may only take nodes whose
  priority is strictly larger than the fetched agent's STE (no thrash). Loads are started
  right away (``cache_controller.start_loading``); nothing consumes them, so requests whose
  prefix is still in flight are held back by the scheduler hook (:meth:`kvflow_blocked`).

Every decision is a function of what all TP ranks see identically (the broadcast requests, the
tree, rank-agreed load acks), so ranks agree, as SGLang's ``rank_consensus`` checks for
``insert``/``evict``. SGLang is imported here, and only inside ``serving/sglang``.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvflow_agents.protocol import HintError, Hints
from kvflow_agents.serving.policy.boundary import infer_boundary
from kvflow_agents.serving.policy import (EvictionStrategyAdapter, HintRegistry, KVFlowPolicy,
                                          PrefetchCandidate, PrefetchPlanner, PriorityIndex,
                                          workflow_key)

logger = logging.getLogger(__name__)

INF = math.inf
POLICY_NAME = "kvflow"
FIXED_TOKENS_KEY = "kvflow_fixed_prefix_tokens"  # added by the HTTP layer (chat template)


# ------------------------------------------------------------------------------ strategy
class KVFlowStrategy(EvictionStrategy):
    """SGLang eviction strategy = the policy core's :class:`EvictionStrategyAdapter` (KVFlow
    key ``(-priority, last_access_time)``); SGLang's heap pops the smallest key first.

    SGLang builds it from ``--radix-eviction-policy kvflow`` with the JSON of
    ``--radix-eviction-policy-config`` as keyword arguments; the cache reads the optional
    ``lookahead``, ``lease_s`` and ``max_prefetch`` from there. Until a
    :class:`KVFlowRadixCache` binds its index (e.g. ``kvflow`` chosen with another cache
    class), every node has priority +inf and the order is plain LRU.
    """

    def __init__(self, lookahead: Optional[float] = None, lease_s: Optional[float] = None,
                 max_prefetch: Optional[int] = None) -> None:
        self.options = {"lookahead": lookahead, "lease_s": lease_s,
                        "max_inflight_prefetch": max_prefetch}
        self.policy = KVFlowPolicy()
        self.adapter: Optional[EvictionStrategyAdapter] = None

    @property
    def index(self) -> Optional[PriorityIndex]:
        return self.adapter.index if self.adapter is not None else None

    def bind(self, index: PriorityIndex) -> None:
        self.adapter = EvictionStrategyAdapter(self.policy, index)

    def get_priority(self, node) -> tuple:
        if self.adapter is None:
            return self.policy.eviction_key(INF, node.last_access_time)
        return self.adapter.get_priority(node)


def ensure_eviction_policy_registered() -> None:
    """Put ``kvflow`` in SGLang's eviction-policy table and CLI choices (idempotent)."""
    from sglang.srt.mem_cache import utils as mc_utils

    mc_utils._EVICTION_POLICY_FACTORIES.setdefault(POLICY_NAME, KVFlowStrategy)
    try:
        from sglang.srt.arg_groups.choices import (RADIX_EVICTION_POLICY_CHOICES,
                                                   add_radix_eviction_policy_choices)

        if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
            add_radix_eviction_policy_choices([POLICY_NAME])
    except ImportError:  # pragma: no cover - older layouts
        logger.debug("kvflow: no CLI choice list to extend")


# ------------------------------------------------------------------------------ bookkeeping
@dataclass
class ReqHints:
    """What the cache remembers about a request's hints until it is cached."""
    tag: tuple                      # (workflow key, agent)
    workflow: str
    app: Optional[str]
    fixed_tokens: Optional[int]     # declared boundary in tokens (None: infer)
    tagged: bool = False            # done for this request (later checkpoints skip the work)


@dataclass
class InflightLoad:
    """A proactive load: the anchor's path tokens and where the loaded part starts."""
    anchor_id: int
    tag: tuple
    ste: float
    tokens: tuple                   # page-aligned tokens root -> anchor
    extra_key: Any
    ready_len: int                  # tokens readable before the first loaded node
    nodes: tuple                    # node objects being loaded
    started: float


class KVFlowRadixCache(UnifiedRadixCache):
    """UnifiedRadixCache + KVFlow tags, STE eviction order and proactive load-back."""

    # Tunables (class attributes so a launcher / test can set them; plain ints and floats)
    lookahead: float = 1
    lease_s: float = 60.0
    max_inflight_prefetch: int = 2   # <= SGLang's load-back slots (3); leaves one for demand
    infer_window: int = 3
    default_step_s: float = 1.0

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
        self.kv_policy = KVFlowPolicy()
        self.kv_hints = HintRegistry(lease_s=self.lease_s)
        self.kv_planner = PrefetchPlanner(lookahead=self.lookahead)
        # Rank-agreed clock for leases (see _kv_now); identical on every rank from the start.
        self._kv_steps = 0
        self._kv_clock = 0.0
        self._kv_reset_state()
        self._install_tree_hooks()
        self._kv_ready = True

    # ------------------------------------------------------------------ setup
    def _kv_reset_state(self) -> None:
        self.kv_index = PriorityIndex(lambda n: n.parent)
        strategy = getattr(self.tree_core, "eviction_strategy", None)
        self.kv_strategy_bound = isinstance(strategy, KVFlowStrategy)
        if self.kv_strategy_bound:
            strategy.bind(self.kv_index)
        elif self.tree_components:
            logger.warning("kvflow: eviction policy is %s, not 'kvflow': STE hints will tag and "
                           "prefetch but not reorder eviction", type(strategy).__name__)
        self._req_hints: dict[Any, ReqHints] = {}
        self._history: dict[tuple, deque] = {}
        self._wf_tags: dict[str, set] = {}
        self._inflight: dict[int, InflightLoad] = {}
        self._evict_floor: Optional[float] = None
        self.kv_stats = {"tags": 0, "prefetch_issued": 0, "prefetch_tokens": 0,
                         "prefetch_skipped_no_slot": 0, "prefetch_declined": 0,
                         "hints": 0, "hint_errors": 0, "blocked_polls": 0,
                         "floor_stops": 0, "inferred_tags": 0}

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
            try:
                cache.kv_index.drop_node(node)
            except AssertionError:  # should not happen; never let bookkeeping crash serving
                logger.exception("kvflow: index out of step on node removal; rebuilding")
                cache._rebuild_index()

        core._split_node = _split_node
        core._remove_leaf_from_parent = _remove_leaf_from_parent

    def _rebuild_index(self) -> None:
        old = self.kv_index
        self.kv_index = PriorityIndex(lambda n: n.parent)
        if self.kv_strategy_bound:
            self.tree_core.eviction_strategy.bind(self.kv_index)
        for tag in list(old.tags()):
            node = old.node_of(tag)
            if node is not None and self._alive(node):
                self.kv_index.set_tag(tag, node, self._effective_ste(tag))

    def reset(self) -> None:
        super().reset()
        if getattr(self, "_kv_ready", False):
            self._kv_reset_state()

    # ------------------------------------------------------------------ helpers
    def _alive(self, node) -> bool:
        return self.tree_core._node_arena.get(node.id) is node

    def _effective_ste(self, tag: tuple) -> float:
        return self.kv_hints.ste(tag[0], tag[1])

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

    # ------------------------------------------------------------------ time
    CLOCK_SYNC_STEPS = 32

    def _kv_now(self) -> float:
        """The clock leases are measured on. Single rank: wall time. Several ranks: a value
        all ranks agreed on (MIN all-reduce every CLOCK_SYNC_STEPS scheduler steps), so a lease
        expires at the same step everywhere and eviction stays identical across ranks."""
        if self.tp_world_size <= 1 and (self.pp_size or 1) <= 1:
            return self._wall_clock()
        return self._kv_clock

    @staticmethod
    def _wall_clock() -> float:
        return time.time()

    def _kv_tick(self) -> None:
        self._kv_steps += 1
        if (self.tp_world_size > 1 or (self.pp_size or 1) > 1) and \
                self._kv_steps % self.CLOCK_SYNC_STEPS == 1:  # the first step, then every N
            import torch

            t = torch.tensor([int(self._wall_clock() * 1000)], dtype=torch.int64, device="cpu")
            self._all_reduce(t, torch.distributed.ReduceOp.MIN)
            self._kv_clock = int(t.item()) / 1000.0

    # ------------------------------------------------------------------ hints in
    def kvflow_on_request(self, req) -> Optional[Hints]:
        """A request was queued: read its hints (``custom_params``), merge the STEs, remember
        its tag for when it is cached. Malformed hints are counted and ignored."""
        sp = getattr(req, "sampling_params", None)
        params = getattr(sp, "custom_params", None)
        try:
            hints = Hints.from_custom_params(params)
        except HintError as e:
            self.kv_stats["hint_errors"] += 1
            logger.debug("kvflow: ignoring malformed hints on %s: %s", getattr(req, "rid", "?"), e)
            return None
        if hints is None:
            return None
        fixed = params.get(FIXED_TOKENS_KEY) if isinstance(params, dict) else None
        if isinstance(fixed, bool) or not isinstance(fixed, int) or fixed <= 0:
            fixed = None
        wf = workflow_key(hints.workflow, hints.app)
        self._req_hints[req.rid] = ReqHints((wf, hints.agent), hints.workflow, hints.app, fixed)
        self.kvflow_apply_hints(hints)
        return hints

    def kvflow_apply_hints(self, hints: Hints, *, now: Optional[float] = None) -> None:
        """Merge one hint (from a request or the out-of-band endpoint) into the STE table."""
        now = self._kv_now() if now is None else now
        wf = workflow_key(hints.workflow, hints.app)
        self.kv_stats["hints"] += 1
        if hints.event == "end":
            self.kvflow_release_workflow(wf)
            return
        ste = dict(hints.ste)
        if hints.agent not in ste:
            ste[hints.agent] = 0  # the sender is running now
        changed, revived = self.kv_hints.update(wf, ste, now=now, step=hints.step,
                                                client=hints.app or None)
        agents = [t[1] for t in self._wf_tags.get(wf, ())] if revived else list(changed)
        for agent in agents:
            tag = (wf, agent)
            if tag in self.kv_index:
                self.kv_index.set_ste(tag, self._effective_ste(tag))

    def kvflow_release_workflow(self, wf: str) -> None:
        self.kv_hints.release(wf)
        for tag in self._wf_tags.pop(wf, ()):
            self.kv_index.remove_tag(tag)
            self._history.pop(tag, None)

    def kvflow_expire(self, now: Optional[float] = None) -> list:
        now = self._kv_now() if now is None else now
        expired = self.kv_hints.expire(now)
        for wf in expired:
            for tag in self._wf_tags.get(wf, ()):
                if tag in self.kv_index:
                    self.kv_index.set_ste(tag, INF)
        for wf in self.kv_hints.drain_removed():  # forgotten or over the registry's bounds
            self.kvflow_release_workflow(wf)
        return expired

    # ------------------------------------------------------------------ tagging
    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        info = self._req_hints.get(getattr(req, "rid", None))
        if info is None:
            return
        if req.finished():
            self._req_hints.pop(req.rid, None)
        if info.tagged:
            return
        try:
            info.tagged = self._tag_request(req, info)
        except Exception:  # advisory: a tagging bug must not fail the request
            info.tagged = True
            logger.exception("kvflow: tagging failed for %s", req.rid)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._req_hints.pop(getattr(req, "rid", None), None)

    def _tag_request(self, req, info: ReqHints) -> bool:
        """Tag the request's fixed prefix; True when done (or nothing to do ever)."""
        if self.disable or req.last_node is None:
            return True
        ps = self.page_size
        cached = int(req.kv.cache_protected_len)  # tokens of this request now owned by the tree
        prompt = list(req.origin_input_ids)
        if info.fixed_tokens is not None:
            boundary = min(info.fixed_tokens, len(prompt))
            if cached < boundary // ps * ps:
                return False  # chunked prefill: not all of the fixed prefix is cached yet
        else:
            boundary = self._infer_boundary(info.tag, prompt)
            if boundary:
                self.kv_stats["inferred_tags"] += 1
        boundary = min(boundary, cached) // ps * ps
        if boundary <= 0:
            return True
        self.tag_prefix(info.tag, prompt[:boundary], req.extra_key, getattr(req, "cache_salt", None),
                        req_last_node=req.last_node)
        return True

    def tag_prefix(self, tag: tuple, tokens: list, extra_key=None, cache_salt=None,
                   *, req_last_node=None) -> Optional[int]:
        """Split the tree where ``tokens`` end (page-aligned, already cached on device) and
        tag that node. Returns its node id, or None when the prefix is not cached."""
        b = len(tokens) // self.page_size * self.page_size
        if b <= 0:
            return None
        key = RadixKey(array("q", tokens[:b]), extra_key, is_bigram=self.tree_core.is_eagle,
                       cache_salt=cache_salt).page_aligned(self.page_size)
        b = len(key)
        if b <= 0:
            return None
        anchor = req_last_node
        if anchor is None:
            return None
        if not self._full_only():
            return self._tag_without_split(tag, anchor, b)
        # Values of the cached path (the tree's own pages): re-inserting key[:b] with them
        # and prev_prefix_len = b only splits (no page changes hands, nothing is freed).
        path_values = self.path_device_indices(anchor)
        if len(path_values) < b:
            return None
        result = self.insert(InsertParams(key=key, value=path_values[:b].clone(),
                                          prev_prefix_len=b, inserted_len=b))
        node_id = result.last_device_node
        node = self.tree_core._node_arena.get(node_id)
        if node is None or result.prefix_len < b:
            return None
        if self.kv_index.node_of(tag) is not node:
            self.kv_index.set_tag(tag, node, self._effective_ste(tag))
            self._wf_tags.setdefault(tag[0], set()).add(tag)
            self.kv_stats["tags"] += 1
        return node_id

    def _full_only(self) -> bool:
        comps = self._components_tuple
        return len(comps) == 1 and comps[0].component_type == ComponentType.FULL

    def _tag_without_split(self, tag: tuple, anchor_id, b: int) -> Optional[int]:
        """Hybrid models (SWA / Mamba state per node): SGLang splits only Full-only trees, so
        neither do we; the tag goes on the deepest cached node that ends within the fixed
        prefix (a slightly shorter protected prefix, never a longer one)."""
        node = self.tree_core._node_arena.get(anchor_id)
        if node is None:
            return None
        ends, n, root = [], node, self.tree_core.root_node
        while n is not None and n is not root:
            ends.append(n)
            n = n.parent
        depth, best = 0, None
        for n in reversed(ends):
            depth += len(n.key)
            if depth > b:
                break
            best = n
        if best is None:
            return None
        if self.kv_index.node_of(tag) is not best:
            self.kv_index.set_tag(tag, best, self._effective_ste(tag))
            self._wf_tags.setdefault(tag[0], set()).add(tag)
            self.kv_stats["tags"] += 1
        return best.id

    def _infer_boundary(self, tag: tuple, prompt: list) -> int:
        """No declared boundary: what this agent's recent prompts share (the policy core's
        rule, :func:`kvflow_agents.serving.policy.boundary.infer_boundary`)."""
        return infer_boundary(self._history, tag, prompt, self.infer_window)

    # ------------------------------------------------------------------ eviction
    def _evict(self, params, available_size_targets=None, *, allocation_reclaim_satisfied=None):
        # Leases are checked right before eviction decisions. Without HiCache the scheduler
        # never calls check_hicache_events, so the (rank-agreed) clock is advanced here too.
        if getattr(self, "_kv_ready", False):
            try:
                if self.cache_controller is None:
                    self._kv_tick()
                self.kvflow_expire()
            except Exception:
                logger.exception("kvflow: lease check failed")
        return super()._evict(params, available_size_targets,
                              allocation_reclaim_satisfied=allocation_reclaim_satisfied)

    # ------------------------------------------------------------------ eviction floor
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
        if floor is not None and node_id is not None and component_type == ComponentType.FULL:
            node = self.tree_core._node_arena.get(node_id)
            if node is not None and self.kv_index.priority(node) <= floor:
                self.kv_stats["floor_stops"] += 1
                return None, False  # stop the walk: the rest is at least as urgent
        return node_id, progress

    # ------------------------------------------------------------------ prefetch
    def check_hicache_events(self) -> None:
        super().check_hicache_events()
        if self.cache_controller is None or self.disable:
            return
        try:
            self._kv_tick()
            self.kvflow_expire()
            self.kvflow_prefetch()
        except Exception:
            logger.exception("kvflow: prefetch step failed")

    def loading_check(self, finish_count=None) -> None:
        super().loading_check(finish_count)
        if self._inflight:
            for anchor in [a for a in self._inflight if a not in self.ongoing_load_back]:
                del self._inflight[anchor]

    def kvflow_prefetch(self) -> list:
        """Start loads for near agents whose tagged prefix is host-only. Returns the tags."""
        if self.cache_controller is None:
            return []
        index, hints = self.kv_index, self.kv_hints
        now = self._kv_now()
        self.kv_planner.lookahead = self.lookahead
        cands = []
        for tag in list(index.tags()):
            ste = index.ste(tag)
            if not self.kv_planner.eligible(ste):
                continue
            node = index.node_of(tag)
            if node is None or not self._alive(node) or not node.evicted or not node.backuped:
                continue
            if node.id in self._inflight:
                continue
            pages, n = 0, node
            while n is not None and n.evicted:
                pages += len(n.key) // self.page_size if n.key is not None else 0
                n = n.parent
            cands.append(PrefetchCandidate(tag, ste, pages,
                                           hints.step_seconds(tag[0], self.default_step_s), node,
                                           hints.step_elapsed(tag[0], now)))
        if not cands:
            return []
        started = []
        for p in self.kv_planner.plan(cands):
            c = p.candidate
            node = c.node
            if not self._alive(node) or not node.evicted or node.id in self._inflight:
                continue  # loaded meanwhile by a sibling agent's load
            if len(self._inflight) >= self.max_inflight_prefetch or not self.has_free_load_back_slot():
                self.kv_stats["prefetch_skipped_no_slot"] += 1
                break
            loading, n = [], node
            while n is not None and n.evicted:
                loading.append(n)
                n = n.parent
            path = self._path_tokens(node)
            ntok = sum(len(x.key) for x in loading)
            with self._eviction_floor(c.ste):
                ok = self.load_back(node.id)
            if not ok:
                self.kv_stats["prefetch_declined"] += 1
                continue
            self._inflight[node.id] = InflightLoad(
                node.id, c.tag, c.ste, tuple(path), node.key.extra_key if node.key else None,
                len(path) - ntok, tuple(loading), time.monotonic())
            self.kv_stats["prefetch_issued"] += 1
            self.kv_stats["prefetch_tokens"] += ntok
            started.append(c.tag)
        if started:
            # Start the H2D copies now, as their own producer: no batch consumes them, so the
            # scheduler hook keeps requests off these nodes until the acks (loading_check).
            self.cache_controller.start_loading()
        return started

    # ------------------------------------------------------------------ status-aware admission
    def kvflow_has_inflight(self) -> bool:
        return bool(self._inflight)

    def kvflow_blocked(self, req) -> bool:
        """Whether ``req``'s cached prefix reaches into a proactive load still in flight."""
        if not self._inflight:
            return False
        ids = req.origin_input_ids
        extra = getattr(req, "extra_key", None)
        ps = self.page_size
        for ld in self._inflight.values():
            if ld.extra_key != extra:
                continue
            toks = ld.tokens
            n = min(len(toks), len(ids))
            if n <= ld.ready_len:
                continue
            i = ld.ready_len
            # the first loaded page must match entirely for the match to reach it
            while i < n and toks[i] == ids[i]:
                i += 1
            if i // ps * ps > ld.ready_len:
                return True
        return False

    # ------------------------------------------------------------------ introspection
    def kvflow_snapshot(self) -> dict:
        def num(x):
            return None if x == INF else x

        agents = []
        for tag in sorted(self.kv_index.tags(), key=lambda t: (str(t[0]), str(t[1]))):
            node = self.kv_index.node_of(tag)
            alive = node is not None and self._alive(node)
            res = "none"
            if alive:
                res = "device"
                n = node
                while n is not None and n is not self.tree_core.root_node:
                    if n.evicted:
                        res = "host"
                        break
                    n = n.parent
                if res == "device" and any(node in ld.nodes for ld in self._inflight.values()):
                    res = "loading"
            agents.append({"workflow": tag[0], "agent": tag[1],
                           "tokens": len(self._path_tokens(node)) if alive else 0,
                           "residency": res, "ste": num(self.kv_index.ste(tag)),
                           "priority": num(self.kv_index.priority(node)) if alive else None})
        return {
            "engine": "sglang",
            "policy": POLICY_NAME if self.kv_strategy_bound else type(self.tree_core.eviction_strategy).__name__,
            "hicache": self.cache_controller is not None,
            "page_size": self.page_size,
            "lookahead": self.lookahead,
            "device": {"evictable": self.evictable_size(), "protected": self.protected_size(),
                       "available": self._component_available_size(ComponentType.FULL)},
            "loads_in_flight": len(self._inflight),
            "workflows": {wf: {"expired": w.expired, "step": w.step, "step_s": w.step_s}
                          for wf, w in self.kv_hints.workflows.items()},
            "agents": agents,
            "stats": dict(self.kv_stats),
        }
