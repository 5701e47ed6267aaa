"""``KVCacheManager``: the one facade the embedded engine, the simulator and tests drive.

It owns the radix tree, page allocation for both tiers, node states, eviction, write-through,
loads, the prefetch planner and the hint registry. The engine owns the bytes (tensors indexed by
page id) and moves them when asked through :class:`~.backend.KVTransferBackend`.

Engine-facing API (page ids are ints; token sequences are any sequence of ints; only whole
pages are ever cached, so lengths below are multiples of ``page_size``):

- ``KVCacheManager(policy, *, page_size, device_pages, host_pages=0, backend=None, lookahead=1,
  max_inflight_loads=4, lease_s=60.0, client_cap_pages=None, bytes_per_page=None,
  link_bytes_per_s=None, default_step_s=1.0, infer_window=3, partial_eviction=True,
  reserve_pages=0, recompute_s_per_token=None, recompute_cost=None)``
- ``match(tokens, *, record=True) -> PrefixMatch``: longest cached prefix; device part
  (``device_len``, ``device_pages``), host-only / loading part, the lock handle ``node``.
  Splits the last node at the match end and touches LRU. ``record=False``: no hit counters
  (re-matching after a load, polling).
- ``status(tokens, *, record=False) -> PrefixStatus``: READY / LOADING / NEEDS_LOAD, read-only
  (no split, no LRU). ``record=True``: "this request would run now but for its prefix"; the
  prefetches in flight on its path note their first wait (see *Hidden / exposed load time*).
  ``peek(tokens) -> PrefixMatch``: a read-only match (estimates; never lock its node).
- ``load_on_demand(match, *, recompute_s=None) -> float | None``: start loading the host-only
  part of a match; returns when the whole prefix is readable (backend clock), ``None`` if
  device space ran out or recomputing is cheaper (then recompute the host part). Once
  ``status`` says READY, ``match`` again for the device page ids.
- ``lock(match_or_node) -> TreeNode`` / ``unlock(node)``: pin the root path of a node (no
  eviction from either tier). Lock what a running request reads; unlock when it is done.
- ``allocate(n_pages) -> list[int] | None``: device pages for new KV, evicting per policy;
  ``None`` (and nothing evicted) when even eviction cannot make room: wait or reject.
  ``free(pages)``: give back pages that will not be inserted.
- ``insert(tokens, device_pages) -> TreeNode``: after prefill / at request end. The tree takes
  ownership of the first ``len(tokens) // page_size`` pages (pass the matched prefix's pages
  followed by the new ones); pages that duplicate an already-cached part are freed, so read
  ``match(tokens).device_pages`` afterwards if the request keeps running (and lock the node);
  any further pages (a partial tail page) stay the caller's.
- ``tag_fixed_prefix(tokens, fixed_len_tokens, workflow, agent, app=None) -> TreeNode | None``:
  tag where the agent's fixed prefix ends (page-aligned down), after ``insert``; cheap when
  unchanged, so call it per request. ``infer_fixed_prefix(workflow, agent, tokens, *, app=None,
  tag=True) -> int`` when no boundary is declared.
- ``update_hints(workflow, ste, *, agent=None, step=None, app=None, client=None, now=None,
  plan=True) -> list[tag]``: merge hints v1 (``{agent: steps | None}``; ``agent`` = the sender,
  STE 0); reprioritises, then (``kvflow``) plans and starts prefetches; returns their tags.
  ``release_workflow(workflow, app=None)``: the workflow ended; drop its hints and tags.
- ``tick(now=None) -> TickReport``: once per scheduler step: finish due loads, expire leases,
  run the prefetch planner.
- Prefetch admission budget: ``set_reserved_pages(n | callable)`` (or ``reserve_pages=``):
  the device pages the engine's waiting + admitted requests will still ``allocate``; a
  prefetch for an agent of STE ``s`` starts only if it fits in free pages + pages evictable
  from priorities strictly larger than ``s``, beyond the reserve (``prefetch_room(s)``), so
  the next admission does not evict it unused (thrash). A callable is evaluated only when a
  prefetch needs room. ``reserved_pages`` reads it.
- Load versus recompute (off by default: a host hit is always loaded): with
  ``recompute_cost(n_tokens, ctx_tokens) -> s`` or ``recompute_s_per_token``, ``load_on_demand``
  declines (``None``) when ``should_load(n_pages, recompute_s)`` is False, i.e. when
  ``estimate_load_s(n_pages)`` (queueing behind in-flight loads + pages x ``secs_per_page``)
  exceeds the recompute estimate; the planner drops a prefetch that cannot land before its
  agent runs when the agent would wait longer than recomputing takes. ``recompute_s(n, ctx)``.
- ``snapshot() -> dict`` (JSON-able), ``metrics`` (:class:`~.metrics.CacheMetrics`,
  ``metrics.as_dict()``), ``free_device_pages``, ``evictable_device_pages``,
  ``loads_in_flight``, ``next_load_at``, ``residency(node)``, ``on_evict`` observer,
  ``check_invariants()`` (tests).

Not thread-safe: call it from the scheduler thread only. Under ``oracle`` the device pool grows
past ``device_pages`` (page ids keep counting up); ``lru`` and ``oracle`` keep no host copies.

Engine protocol per request (what SGLang's scheduler does too):
``status`` while waiting → ``match`` when admitted → ``load_on_demand`` if ``needs_load`` →
``lock`` → ``allocate`` for the uncached rest → run → ``insert`` → ``unlock`` the old handle →
``tag_fixed_prefix`` (or ``infer_fixed_prefix``) → ``update_hints`` as hints arrive; ``tick``
once per scheduler step, after ``set_reserved_pages`` (or give a callable once).

Hidden / exposed load time (``metrics.load_hidden_s`` / ``load_exposed_s``): a demand load is
exposed from ``load_on_demand`` to its landing. A prefetch is credited at the first
``match(record=True)`` whose path reads it: exposed = ``ready - first attempt`` (at most its
transfer), hidden = the rest, where the first attempt is the earliest
``status(tokens, record=True)`` that found it in flight, else that match. So an engine that
skips a request whose prefix is LOADING (status-aware) MUST make that check with
``status(tokens, record=True)``; with plain ``status`` the wait is counted as hidden.

Wasted prefetch (``metrics.prefetch_wasted``): its pages were evicted before any
``match(record=True)`` read them, or its workflow was released first; a plan dropped by a
newer hint is ``prefetch_stale``, one that did not fit ``prefetch_deferred`` /
``prefetch_budget_skips``, one dropped for recomputing ``prefetch_recompute_skips``.

Invariants (besides the tree's T1-T4, see :mod:`.tree`):
- M1: tree device pages + pages held by the engine = device pool used <= capacity (unless oracle);
- M2: only unlocked DEVICE nodes with no device child are device-eviction candidates; only
  unlocked HOST leaves (or host backups of DEVICE nodes) are host-eviction candidates;
- M3: under ``kvflow`` a node is evicted only when no candidate has a larger priority, so the
  dynamic suffix (+inf) goes before any tagged prefix of finite STE;
- M4: a prefetch never evicts a node whose priority is <= the STE of the agent it fetches for;
- M5: a prefetch starts only if ``pages <= free + evictable above its STE - reserved pages``
  (so it does not take room an admission will reclaim, nor evict and then fail for lack of
  room, except when an evictable node sits above a loading child: counted, not yet evictable). An allocation
  evicts a prefetched, unused prefix (priority <= its STE) only after every candidate of larger
  priority (M3); just-fetched nodes are the most recently used among equal priorities.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .backend import KVTransferBackend, NullTransferBackend
from .boundary import infer_boundary
from .hints import HintRegistry, workflow_key
from .metrics import CacheMetrics
from .pages import PagePool
from .policies import CachePolicy, get_policy
from .prefetch import PrefetchCandidate, PrefetchPlanner
from .priority import PriorityIndex
from .tree import DEVICE_HOLDING, NodeState, RadixTree, TreeNode

INF = math.inf
DEVICE, HOST, LOADING, OFFLOADING = (NodeState.DEVICE, NodeState.HOST, NodeState.LOADING,
                                     NodeState.OFFLOADING)
Tag = tuple  # (workflow key, agent)


class PrefixStatus(enum.Enum):
    READY = "ready"            # everything cached is readable on device (maybe nothing cached)
    LOADING = "loading"        # part of it is in flight host -> device: skip for now
    NEEDS_LOAD = "needs_load"  # part of it is host-only: call load_on_demand


@dataclass
class PrefixMatch:
    tokens_len: int            # len(tokens) asked about
    cached_len: int            # tokens cached in some tier (page-aligned)
    device_len: int            # leading tokens readable on device now
    device_pages: list[int]    # page ids of those device_len tokens
    node: TreeNode             # deepest matched node (root if none): the lock handle
    device_node: TreeNode      # deepest node of the readable part
    loading: bool              # some of the rest is in flight
    needs_load: bool           # some of the rest is host-only

    @property
    def host_len(self) -> int:
        """Cached tokens not readable yet (host-only or loading)."""
        return self.cached_len - self.device_len

    @property
    def status(self) -> PrefixStatus:
        if self.needs_load:
            return PrefixStatus.NEEDS_LOAD
        return PrefixStatus.LOADING if self.loading else PrefixStatus.READY


@dataclass(eq=False)
class Load:
    """One host -> device transfer of a chain of nodes."""
    nodes: list[TreeNode]
    pages: int
    start: float
    ready: float
    kind: str                  # "demand" or "prefetch"
    tag: Tag | None = None
    done: bool = False
    used: bool = False
    wasted: bool = False
    first_wait: float | None = None  # first time a request found it in flight (status record)


@dataclass
class AgentPrefix:
    tag: Tag
    tokens: tuple              # the page-aligned fixed prefix
    node: TreeNode | None      # tagged node, None while not in the tree


@dataclass
class TickReport:
    now: float
    loads_finished: int = 0
    prefetches_started: list = field(default_factory=list)
    expired_workflows: list = field(default_factory=list)


class KVCacheManager:
    """Radix tree + two page pools + a policy. See the module docstring for the API."""

    def __init__(self, policy: "str | CachePolicy" = "kvflow", *, page_size: int = 16,
                 device_pages: int, host_pages: int = 0,
                 backend: KVTransferBackend | None = None, lookahead: float = 1,
                 max_inflight_loads: int = 4, lease_s: float = 60.0,
                 client_cap_pages: int | None = None, bytes_per_page: int | None = None,
                 link_bytes_per_s: float | None = None, default_step_s: float = 1.0,
                 infer_window: int = 3, partial_eviction: bool = True,
                 reserve_pages: "int | Callable[[], int]" = 0,
                 recompute_s_per_token: float | None = None,
                 recompute_cost: Callable[[int, int], float] | None = None,
                 min_partial_prefetch_pages: int = 4) -> None:
        self.policy = get_policy(policy)
        # a prefetch that does not fit loads its head when at least this many pages do (0: off)
        self.min_partial_prefetch_pages = min_partial_prefetch_pages
        self.page_size = page_size
        self.backend = backend if backend is not None else NullTransferBackend()
        self.tree = RadixTree(page_size, on_split=self._on_split)
        self.device = PagePool(device_pages, name="device", growable=not self.policy.evicts)
        self.host = PagePool(host_pages if self.policy.host_tier else 0, name="host")
        self.index = PriorityIndex(lambda n: n.parent, on_change=self._on_priority_change)
        self.hints = HintRegistry(lease_s=lease_s)
        self.lookahead = lookahead
        self.max_inflight_loads = max_inflight_loads
        self.client_cap_pages = client_cap_pages
        self.default_step_s = default_step_s
        self.infer_window = infer_window
        # Evict only as many tail pages of the last victim as needed (splitting it) rather
        # than the whole node: the head keeps serving as a prefix. Same for every policy.
        self.partial_eviction = partial_eviction
        self.metrics = CacheMetrics()
        bpp = bytes_per_page if bytes_per_page is not None else getattr(self.backend, "bytes_per_page", 0)
        bw = link_bytes_per_s if link_bytes_per_s is not None else getattr(self.backend, "link_bytes_per_s", None)
        self._configured_spp = (bpp / bw) if bpp and bw else None
        self._measured_spp: float | None = None
        self.planner = PrefetchPlanner(lookahead=lookahead, secs_per_page=self._configured_spp or 0.0)
        # Prefetch admission budget: device pages queued / admitted work will still allocate.
        self._reserve: "int | Callable[[], int]" = reserve_pages
        # Load-versus-recompute: off (always load a host hit) unless the engine gives an estimate.
        self.recompute_s_per_token = recompute_s_per_token
        self.recompute_cost = recompute_cost
        self._prefetch_by_tag: dict = {}     # tag -> its latest prefetch Load (wasted on release)
        self._tag_seq: dict = {}             # tag -> order of first tagging (deterministic plans)
        # Optional observer, called as on_evict(node, tier, priority, reason) before a node
        # leaves a tier; tests use it to check eviction order.
        self.on_evict: Callable[[TreeNode, str, float, str], None] | None = None

        self._dev_heap: list = []
        self._host_heap: list = []
        self._clock = 0                      # logical LRU clock
        self._evictable = 0                  # pages in unlocked DEVICE nodes
        self._state_ver = 0                  # bumped on any node state/priority change
        self._evictable_memo: dict = {}      # _evictable_above results for the current state
        self._idle_plan = None               # state signature of the last plan that started nothing
        self._loads: list = []               # heap (ready, seq, Load)
        self._seq = itertools.count()
        self._inflight_prefetch = 0
        self._link_free_at = 0.0
        self._records: dict[Tag, AgentPrefix] = {}
        self._wf_tags: dict[str, set] = {}
        self._near: set = set()              # tags with effective STE <= lookahead
        self._host_tags: set = set()         # tags whose node is host-only (prefetchable)
        self._pending: set = set()           # prefetches planned but not started
        self._demoted: set = set()           # tags over their client's device cap
        self._history: dict[Tag, deque] = {}
        self._evict_floor: float | None = None
        # (app, agent) -> that agent's fixed prefix, remembered across workflow instances: a
        # new instance of an app (a new LangGraph thread, a new PEER question) can protect and
        # prefetch an agent's prefix from its first hint, before the agent runs in it.
        self._app_prefix: "OrderedDict[tuple[str, str], tuple]" = OrderedDict()
        self.max_app_prefixes = 4096

    # ================================================================ reads
    @property
    def free_device_pages(self) -> int:
        return self.device.num_free

    @property
    def evictable_device_pages(self) -> int:
        """Pages in unlocked device-resident nodes (an upper bound on what eviction can free)."""
        return self._evictable

    def match(self, tokens: Sequence[int], *, record: bool = True) -> PrefixMatch:
        now = self.backend.now()
        self._poll_loads(now)
        path, cached = self.tree.match(tokens, split=True)
        self._clock += 1
        clock = self._clock
        for n in path:
            n.last_access = clock
            self._reindex(n)
        m = self._classify(path, cached, len(tokens))
        if record:
            self._record_match(m, path, now)
        return m

    def status(self, tokens: Sequence[int], *, record: bool = False) -> PrefixStatus:
        """READY / LOADING / NEEDS_LOAD, read-only (no split, no LRU, no hit counters).

        ``record=True``: the caller is a request that would run now but for its prefix; every
        prefetch still in flight on that path notes this as its first wait (once), so the
        hidden/exposed accounting charges ``ready - first wait`` as exposed. Status-aware
        engines must pass it when they skip a request because of a load."""
        now = self.backend.now()
        self._poll_loads(now)
        path, cached = self.tree.match(tokens, split=False)
        m = self._classify(path, cached, len(tokens))
        if record and m.loading:
            for n in path:
                ld = n.load
                if (n.state is LOADING and ld is not None and not ld.done
                        and ld.first_wait is None):
                    ld.first_wait = now
        return m.status

    def peek(self, tokens: Sequence[int]) -> PrefixMatch:
        """Like ``match`` but read-only (no split, no LRU, no counters): for estimates such as
        how many pages a waiting request will still allocate. Do not lock its ``node``."""
        self._poll_loads(self.backend.now())
        path, cached = self.tree.match(tokens, split=False)
        return self._classify(path, cached, len(tokens))

    # ---------------------------------------------------------------- prefetch budget
    def set_reserved_pages(self, pages: "int | Callable[[], int]") -> None:
        """Device pages that queued + admitted requests will still allocate (an int, or a
        callable the manager evaluates only when a prefetch needs room). Prefetch never
        takes this space: it uses only free pages plus pages evictable from nodes of strictly
        larger priority, beyond the reserve. Update it every scheduler step (or pass a callable
        once). 0 (default) = no reserve."""
        self._reserve = pages

    @property
    def reserved_pages(self) -> int:
        r = self._reserve
        v = r() if callable(r) else r
        return max(0, int(v or 0))

    def _evictable_above(self, ste: float) -> int:
        """Pages in unlocked device-resident nodes whose priority is strictly larger than
        ``ste`` (what a prefetch for an agent of that STE may evict). O(nodes), memoised until
        a node's state, lock or priority changes: a deferred prefetch re-checks its budget on
        every tick, i.e. every decode step, which must not walk the tree each time."""
        key = (ste, self._state_ver, self._evictable, self.device.num_free, self.tree.num_nodes)
        hit = self._evictable_memo.get(key)
        if hit is not None:
            return hit
        prio = self.index.priority
        total = 0
        for n in self.tree.iter_nodes():
            if n.state is DEVICE and n.lock_ref == 0 and prio(n) > ste:
                total += len(n.device_pages)
        if len(self._evictable_memo) > 64:
            self._evictable_memo.clear()
        self._evictable_memo[key] = total
        return total

    def prefetch_room(self, ste: float) -> int:
        """Device pages a prefetch for an agent of STE ``ste`` may take now: free pages +
        pages evictable from strictly larger priorities - the reserve."""
        return self.device.num_free + self._evictable_above(ste) - self.reserved_pages

    # ---------------------------------------------------------------- load vs recompute
    @property
    def secs_per_page(self) -> float:
        """Host->device seconds per page: configured (bytes / link) or measured; 0 unknown."""
        return self._configured_spp or self._measured_spp or 0.0

    def estimate_load_s(self, n_pages: int, now: float | None = None) -> float:
        """Seconds until ``n_pages`` started now would land: queueing behind in-flight loads
        on the (FIFO) link + transfer."""
        now = self.backend.now() if now is None else now
        return max(0.0, self._link_free_at - now) + n_pages * self.secs_per_page

    def recompute_s(self, n_tokens: int, ctx_tokens: int = 0) -> float | None:
        """The engine's estimate of recomputing ``n_tokens`` after ``ctx_tokens`` cached ones
        (``recompute_cost`` or ``recompute_s_per_token``); ``None``: no estimate given."""
        if self.recompute_cost is not None:
            return float(self.recompute_cost(n_tokens, ctx_tokens))
        if self.recompute_s_per_token is not None:
            return n_tokens * self.recompute_s_per_token
        return None

    def should_load(self, n_pages: int, recompute_s: float | None = None,
                    now: float | None = None) -> bool:
        """Load ``n_pages`` from host rather than recompute them? True without an estimate
        (``recompute_s`` None) or when the estimated load time is <= ``recompute_s``.
        Override (subclass) for another rule."""
        if recompute_s is None:
            return True
        return self.estimate_load_s(n_pages, now) <= recompute_s

    def _classify(self, path: list[TreeNode], cached: int, asked: int) -> PrefixMatch:
        device_len, pages, device_node = 0, [], self.tree.root
        loading = needs = False
        readable = True
        for n in path:
            st = n.state
            if readable and (st is DEVICE or st is OFFLOADING):
                device_len += len(n.key)
                pages.extend(n.device_pages)
                device_node = n
                continue
            readable = False
            if st is LOADING:
                loading = True
            elif st is HOST:
                needs = True
            else:
                loading = True  # device node below a loading one: readable once that lands
        if device_len > cached:  # a partially matched last node (status(): no split)
            device_len = cached
            pages = pages[:cached // self.page_size]
        return PrefixMatch(asked, cached, device_len, pages,
                           path[-1] if path else self.tree.root, device_node, loading, needs)

    def _record_match(self, m: PrefixMatch, path: list[TreeNode], now: float) -> None:
        mt = self.metrics
        mt.requests += 1
        mt.hit_tokens_device += m.device_len
        rest = m.cached_len - m.device_len
        if m.needs_load:
            mt.hit_tokens_host += rest
        else:
            mt.hit_tokens_loading += rest
        mt.miss_tokens += m.tokens_len - m.cached_len
        for n in path:
            ld = n.load
            if ld is None or ld.kind != "prefetch" or ld.used or ld.wasted:
                continue
            ld.used = True
            mt.prefetch_used += 1
            if self._prefetch_by_tag.get(ld.tag) is ld:
                del self._prefetch_by_tag[ld.tag]
            # Exposed = what the first request that wanted it waited: from its first attempt
            # (status(record=True), else this match) to the landing; the rest was hidden.
            first = now if ld.first_wait is None else min(ld.first_wait, now)
            transfer = max(0.0, ld.ready - ld.start)
            exposed = min(transfer, max(0.0, ld.ready - max(first, ld.start)))
            mt.load_hidden_s += transfer - exposed
            mt.load_exposed_s += exposed

    # ================================================================ locking
    def lock(self, target: "PrefixMatch | TreeNode") -> TreeNode:
        node = target.node if isinstance(target, PrefixMatch) else target
        if node.detached:
            raise ValueError("lock: node is no longer in the tree (match again)")
        n = node
        while n.parent is not None:
            n.lock_ref += 1
            if n.lock_ref == 1 and n.state is DEVICE:
                self._evictable -= len(n.device_pages)
            n = n.parent
        return node

    def unlock(self, node: TreeNode) -> None:
        n = node
        while n.parent is not None:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock: node {n.id} is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                if n.state is DEVICE:
                    self._evictable += len(n.device_pages)
                self._reindex(n)
            n = n.parent

    # ================================================================ allocation
    def allocate(self, n_pages: int) -> list[int] | None:
        """Device pages for new KV, evicting per policy; ``None`` if impossible right now."""
        return self._alloc_device(n_pages, "alloc")

    def free(self, pages: Sequence[int]) -> None:
        """Return pages the engine allocated and will not insert."""
        self.device.free(pages)

    def _alloc_device(self, k: int, reason: str, above: float | None = None) -> list[int] | None:
        if k <= 0:
            return []
        dev = self.device
        if dev.num_free < k and self.policy.evicts:
            if above is None and dev.num_free + self._evictable < k:
                return None  # hopeless: do not evict for nothing
            self._evict_device(k - dev.num_free, reason, above)
        return dev.alloc(k)

    def _alloc_host(self, k: int, for_priority: float) -> list[int] | None:
        if self.host.num_free < k:
            self._evict_host(k - self.host.num_free, for_priority)
        return self.host.alloc(k)

    # ================================================================ insert / tag
    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> TreeNode:
        tree, ps = self.tree, self.page_size
        tokens = tree.aligned(tokens)
        n_pages = len(tokens) // ps
        if len(device_pages) < n_pages:
            raise ValueError(f"insert: {n_pages} pages of tokens but {len(device_pages)} page ids")
        self._clock += 1
        clock = self._clock
        node, i, pi = tree.root, 0, 0
        dup: list[int] = []
        while i < len(tokens):
            child = node.children.get(tree.child_key(tokens, i))
            if child is None:
                new = tree.add_child(node, tokens[i:], DEVICE)
                new.device_pages = list(device_pages[pi:n_pages])
                new.last_access = clock
                node.n_device_children += 1
                self._evictable += len(new.device_pages)
                self._reindex(new)
                node = new
                break
            m = tree._common_len(child.key, tokens, i)
            if m < len(child.key):
                child = tree.split(child, m)
            mp = m // ps
            given = device_pages[pi:pi + mp]
            if child.state is HOST:
                # Fresh KV for an evicted run: adopt it, keep the host copy.
                child.device_pages = list(given)
                child.set_state(DEVICE)
                self._host_tags.difference_update(self.index.tags_at(child))
                node.n_device_children += 1
                if child.lock_ref == 0:
                    self._evictable += mp
            else:
                own = child.device_pages
                dup.extend(p for p, q in zip(given, own) if p != q)
            child.last_access = clock
            self._reindex(child)
            node, i, pi = child, i + m, pi + mp
        if dup:
            self.device.free(dup)
        return node

    def tag_fixed_prefix(self, tokens: Sequence[int], fixed_len_tokens: int, workflow: str,
                         agent: str, app: str | None = None) -> TreeNode | None:
        """Tag the node where ``agent``'s fixed prefix ends (split there, page-aligned down).

        Returns the node, or ``None`` when that prefix is not (fully) cached; call it after
        ``insert``. A tag moves when the agent's fixed prefix changes.
        """
        wf = workflow_key(workflow, app)
        tag = (wf, agent)
        b = max(0, min(int(fixed_len_tokens), len(tokens))) // self.page_size * self.page_size
        prefix = tuple(tokens[:b])
        rec = self._records.get(tag)
        if rec is not None and rec.node is not None and not rec.node.detached and rec.tokens == prefix:
            return rec.node
        if rec is None:
            rec = self._records[tag] = AgentPrefix(tag, prefix, None)
            self._tag_seq.setdefault(tag, next(self._seq))
            self._wf_tags.setdefault(wf, set()).add(tag)
        elif rec.tokens != prefix:
            self.index.remove_tag(tag)
            self._host_tags.discard(tag)
            rec.node = None
        rec.tokens = prefix
        self._refresh_tag(tag)
        if b == 0:
            return None
        if app:
            self._remember_app_prefix(app, agent, prefix)
        path, m = self.tree.match(prefix, split=True)
        if m < b:
            return None
        node = path[-1]
        rec.node = node
        self.index.set_tag(tag, node, INF)
        if node.state is HOST:
            self._host_tags.add(tag)
        else:
            self._host_tags.discard(tag)
        self._refresh_tag(tag)
        if self.client_cap_pages is not None:
            self._apply_client_cap(self.hints.client_of(wf))
        return node

    def fixed_prefix_len(self, workflow: str, agent: str, app: str | None = None) -> int:
        """Tokens of ``agent``'s tagged fixed prefix in ``workflow`` (0 when none is known)."""
        rec = self._records.get((workflow_key(workflow, app), agent))
        return len(rec.tokens) if rec is not None else 0

    def infer_fixed_prefix(self, workflow: str, agent: str, tokens: Sequence[int], *,
                           app: str | None = None, tag: bool = True) -> int:
        """No declared boundary: the fixed prefix is what this agent's recent requests share.

        Records ``tokens`` in the agent's history (last ``infer_window`` requests) and returns
        the page-aligned longest prefix common to all of them (0 until two are seen). With
        ``tag`` the boundary is tagged (call after ``insert``).
        """
        lcp = infer_boundary(self._history, (workflow_key(workflow, app), agent), tokens,
                             self.infer_window)
        b = lcp // self.page_size * self.page_size
        if tag and b > 0:
            self.tag_fixed_prefix(tokens, b, workflow, agent, app=app)
        return b

    # ================================================================ hints
    def update_hints(self, workflow: str, ste: dict, *, agent: str | None = None,
                     step: int | None = None, app: str | None = None,
                     client: str | None = None, now: float | None = None,
                     plan: bool = True) -> list:
        """Merge a hint (``{agent: steps | None}``); returns the tags whose prefetch started.

        ``agent`` is the agent sending the request: STE 0 unless the hint says otherwise.
        With ``app``, an agent with a finite STE that has no tag in this workflow yet is tagged
        at the fixed prefix the app's other workflows showed, so a new instance protects and
        prefetches it before the agent first runs there.
        """
        now = self.backend.now() if now is None else now
        wf = workflow_key(workflow, app)
        if agent is not None and agent not in ste:
            ste = {**ste, agent: 0}
        changed, revived = self.hints.update(wf, ste, now=now, step=step,
                                             client=client or app or None, agent=agent)
        tags = self._wf_tags.get(wf, ())
        if revived:
            for tag in tags:
                self._refresh_tag(tag)
        else:
            # Hot path (a hint per request): the workflow is live, so the effective STE is
            # the raw one unless a client cap demoted the tag.
            records, demoted, near, look = self._records, self._demoted, self._near, self.lookahead
            set_ste = self.index.set_ste
            for a, v in changed.items():
                tag = (wf, a)
                if tag in records:
                    if tag in demoted:
                        v = INF
                    set_ste(tag, v)
                    if v <= look:
                        near.add(tag)
                    else:
                        near.discard(tag)
        if app and self._app_prefix:
            self._bind_app_prefixes(workflow, app, wf, changed)
        if self.client_cap_pages is not None and (changed or revived):
            self._apply_client_cap(self.hints.client_of(wf))
        if plan and self.policy.prefetch:
            return self._prefetch(now)
        return []

    def _remember_app_prefix(self, app: str, agent: str, prefix: tuple) -> None:
        key = (app, agent)
        self._app_prefix[key] = prefix
        self._app_prefix.move_to_end(key)
        while len(self._app_prefix) > self.max_app_prefixes:
            self._app_prefix.popitem(last=False)

    def _bind_app_prefixes(self, workflow: str, app: str, wf: str, changed: dict) -> None:
        """Tag, in this workflow, the agents with a finite STE whose fixed prefix the app has
        shown before (in another workflow instance) but which have no tag here yet."""
        records = self._records
        for a, v in changed.items():
            if v == INF or (wf, a) in records:
                continue
            prefix = self._app_prefix.get((app, a))
            if prefix:
                self.tag_fixed_prefix(prefix, len(prefix), workflow, a, app=app)

    def release_workflow(self, workflow: str, app: str | None = None) -> None:
        """The workflow ended: forget its hints and tags (its cache becomes ordinary LRU prey)."""
        wf = workflow_key(workflow, app)
        w = self.hints.release(wf)
        for tag in self._wf_tags.pop(wf, ()):
            ld = self._prefetch_by_tag.pop(tag, None)
            if ld is not None and not ld.used and not ld.wasted:
                ld.wasted = True  # fetched for an agent that will not run any more
                self.metrics.prefetch_wasted += 1
            self.index.remove_tag(tag)
            self._records.pop(tag, None)
            self._tag_seq.pop(tag, None)
            self._near.discard(tag)
            self._host_tags.discard(tag)
            self._pending.discard(tag)
            self._demoted.discard(tag)
            self._history.pop(tag, None)
        if w is not None and self.client_cap_pages is not None:
            self._apply_client_cap(w.client)

    def _effective_ste(self, tag: Tag) -> float:
        if tag in self._demoted:
            return INF
        return self.hints.ste(tag[0], tag[1])

    def _refresh_tag(self, tag: Tag) -> None:
        v = self._effective_ste(tag)
        self.index.set_ste(tag, v)
        if v <= self.lookahead:
            self._near.add(tag)
        else:
            self._near.discard(tag)

    def _apply_client_cap(self, client: str) -> None:
        """Fairness: a client's tags protect at most ``client_cap_pages`` pages; the least
        urgent tags beyond the cap count as +inf."""
        cap = self.client_cap_pages
        tags = []
        for wf, w in self.hints.workflows.items():
            if w.client != client:
                continue
            for tag in self._wf_tags.get(wf, ()):
                raw = self.hints.ste(wf, tag[1])
                if raw < INF:
                    tags.append((raw, tag))
        tags.sort(key=lambda x: x[0])
        used = 0
        for raw, tag in tags:
            used += len(self._records[tag].tokens) // self.page_size
            over = used > cap
            if over != (tag in self._demoted):
                if over:
                    self._demoted.add(tag)
                else:
                    self._demoted.discard(tag)
                self._refresh_tag(tag)

    # ================================================================ time
    def tick(self, now: float | None = None) -> TickReport:
        """Finish loads whose ready time passed, expire quiet workflows, plan prefetches."""
        now = self.backend.now() if now is None else now
        report = TickReport(now)
        report.loads_finished = self._poll_loads(now)
        expired = self.hints.expire(now)
        for wf in expired:
            for tag in self._wf_tags.get(wf, ()):
                self._refresh_tag(tag)
        report.expired_workflows = expired
        if self.policy.prefetch:
            report.prefetches_started = self._prefetch(now)
        return report

    # ================================================================ loads
    def load_on_demand(self, match: PrefixMatch, *, recompute_s: float | None = None) -> float | None:
        """Load the host-only part of ``match``'s path. Returns the time (backend clock) the
        whole matched prefix is readable, or ``None`` (recompute the host part) if device space
        could not be found or, with a recompute estimate, when ``should_load`` says recomputing
        is cheaper. The estimate is ``recompute_s`` (the engine's, for this request: e.g. with
        the part of a load its own prefill hides) or else the manager's ``recompute_cost`` /
        ``recompute_s_per_token``; with neither, a host hit is always loaded."""
        now = self.backend.now()
        self._poll_loads(now)
        node = match.node
        if node.detached:
            raise ValueError("load_on_demand: node left the tree (match again)")
        path = node.path()
        ready = now
        host_nodes = []
        for n in path:
            if n.state is HOST:
                host_nodes.append(n)
            elif n.state is LOADING and n.load is not None:
                ready = max(ready, n.load.ready)
        if not host_nodes or not self.policy.host_tier:
            return ready
        k = sum(len(n.host_pages) for n in host_nodes)
        if (recompute_s is not None or self.recompute_cost is not None
                or self.recompute_s_per_token is not None):
            if recompute_s is None:
                ctx = 0
                for n in path:
                    if n is host_nodes[0]:
                        break
                    ctx += len(n.key)
                recompute_s = self.recompute_s(k * self.page_size, ctx)
            if not self.should_load(k, recompute_s, now):
                self.metrics.loads_declined += 1
                self.metrics.declined_pages += k
                return None  # recomputing the host part is cheaper than waiting for it
        self.lock(node)
        try:
            ld = self._start_load(host_nodes, "demand", "load", None, now)
        finally:
            self.unlock(node)
        if ld is None:
            return None
        self.metrics.demand_loads += 1
        self.metrics.demand_load_pages += ld.pages
        self.metrics.load_exposed_s += max(0.0, ld.ready - now)
        return max(ready, ld.ready)

    def _start_load(self, host_nodes: list[TreeNode], kind: str, reason: str,
                    above: float | None, now: float, tag: Tag | None = None) -> Load | None:
        k = sum(len(n.host_pages) for n in host_nodes)
        dp = self._alloc_device(k, reason, above)
        if dp is None:
            return None
        hp_all: list[int] = []
        i = 0
        for n in host_nodes:
            m = len(n.host_pages)
            n.device_pages = dp[i:i + m]
            i += m
            n.set_state(LOADING)
            if n in self.index._node_tags:
                self._host_tags.difference_update(self.index.tags_at(n))
            n.parent.n_device_children += 1
            hp_all.extend(n.host_pages)
        ready = self.backend.start_load(hp_all, dp)
        ld = Load(list(host_nodes), k, now, ready, kind, tag)
        for n in host_nodes:
            n.load = ld
        heapq.heappush(self._loads, (ready, next(self._seq), ld))
        if kind == "prefetch":
            self._inflight_prefetch += 1
        self._link_free_at = max(self._link_free_at, ready)
        if ready <= now:
            self._poll_loads(now)
        return ld

    def _poll_loads(self, now: float) -> int:
        loads, done = self._loads, 0
        while loads and loads[0][0] <= now:
            _, _, ld = heapq.heappop(loads)
            for n in ld.nodes:
                if n.state is LOADING and not n.detached:
                    n.set_state(DEVICE)
                    if n.lock_ref == 0:
                        self._evictable += len(n.device_pages)
                    self._reindex(n)
            ld.done = True
            done += 1
            if ld.kind == "prefetch":
                self._inflight_prefetch -= 1
            if ld.pages and ld.ready > ld.start:
                spp = (ld.ready - ld.start) / ld.pages
                old = self._measured_spp
                self._measured_spp = spp if old is None else 0.7 * old + 0.3 * spp
        return done

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    @property
    def next_load_at(self) -> float | None:
        """When the earliest in-flight load lands (backend clock), or ``None``: how long an
        idle scheduler may sleep before the next ``tick`` can make progress."""
        return self._loads[0][0] if self._loads else None

    # ================================================================ prefetch
    def _prefetch(self, now: float) -> list:
        self._poll_loads(now)
        # Planned on every tick (= every decode step): when nothing the plan depends on changed
        # since a plan that started nothing, it would start nothing again (deadlines and the
        # link's backlog shrink together as time passes), so skip the candidate walk.
        sig = (self._state_ver, len(self._near), len(self._host_tags), self._inflight_prefetch,
               self.device.num_free, self._evictable, self.lookahead)
        if sig == self._idle_plan:
            return []
        cands = []
        records, index, hints = self._records, self.index, self.hints
        near, host_tags = self._near, self._host_tags
        # sorted by first tagging: set order follows str hashes (PYTHONHASHSEED), and the
        # planner keeps input order among equally urgent candidates
        for tag in sorted(near & host_tags if len(near) < len(host_tags) else host_tags & near,
                          key=self._tag_seq.__getitem__):
            node = records[tag].node
            if node is None or node.state is not HOST or node.detached:
                continue  # defensive: the set says host-only
            pages, n = 0, node
            while n.state is HOST:
                pages += len(n.host_pages)
                n = n.parent
            wf = tag[0]
            rec_s = None
            if self.recompute_cost is not None or self.recompute_s_per_token is not None:
                rec_s = self.recompute_s(pages * self.page_size,
                                         len(records[tag].tokens) - pages * self.page_size)
            cands.append(PrefetchCandidate(tag, index.ste(tag), pages,
                                           hints.step_seconds(wf, self.default_step_s), node,
                                           hints.step_elapsed(wf, now), rec_s))
        previously = self._pending
        if not cands and not previously:
            return []
        self.planner.lookahead = self.lookahead
        self.planner.secs_per_page = self._configured_spp or self._measured_spp or 0.0
        plan = self.planner.plan(cands, link_busy_s=max(0.0, self._link_free_at - now))
        self.metrics.prefetch_recompute_skips += len(self.planner.last_skipped)
        planned = {p.candidate.tag for p in plan}
        for tag in previously - planned:
            rec = records.get(tag)
            if rec is not None and rec.node is not None and rec.node.state is HOST:
                self.metrics.prefetch_stale += 1  # a newer hint made this plan moot
        started, pending = [], set()
        reserve: int | None = None       # evaluated lazily: only when a prefetch needs room
        for p in plan:
            c = p.candidate
            node = c.node
            if node.detached or node.state is not HOST:
                continue  # covered by a load started for a sibling agent
            if self._inflight_prefetch >= self.max_inflight_loads:
                pending.add(c.tag)
                continue
            host_nodes, n = [], node
            while n.state is HOST:
                host_nodes.append(n)
                n = n.parent
            host_nodes.reverse()
            k = sum(len(x.host_pages) for x in host_nodes)
            if self.policy.evicts:
                # Budget: free + evictable-above-STE pages beyond what queued / admitted work
                # will allocate; else the next allocation would evict this prefetch (thrash).
                free = self.device.num_free
                if reserve is None:
                    reserve = self.reserved_pages
                if free - reserve < k and (free + self._evictable - reserve < k
                                           or free + self._evictable_above(c.ste) - reserve < k):
                    pending.add(c.tag)
                    self.metrics.prefetch_budget_skips += 1
                    # Partial prefetch: the room there is now, for the head of the prefix (a
                    # prefix of a prefix is valid KV); the rest is planned again next tick or
                    # loaded on demand. Hides part of the load instead of none of it.
                    room = free - reserve + min(self._evictable, self._evictable_above(c.ste))
                    part = (self._prefetch_head(c.tag, host_nodes, room)
                            if self.min_partial_prefetch_pages
                            and room >= self.min_partial_prefetch_pages else None)
                    if part is None:
                        continue
                    host_nodes, k = part
                    node = host_nodes[-1]
                    self.metrics.prefetch_partial += 1
            self.lock(node)
            try:
                ld = self._start_load(host_nodes, "prefetch", "prefetch", c.ste, now, c.tag)
            finally:
                self.unlock(node)
            if ld is None:
                pending.add(c.tag)
                continue
            self._clock += 1  # just fetched: newest among equal priorities (LRU tie-break)
            for x in host_nodes:
                x.last_access = self._clock
                self._reindex(x)  # (a no-op while LOADING; an instant load landed already)
            self._prefetch_by_tag[c.tag] = ld
            started.append(c.tag)
            self.metrics.prefetch_issued += 1
            self.metrics.prefetch_pages += ld.pages
        self.metrics.prefetch_deferred += len(pending - previously)
        self._pending = pending
        self._idle_plan = None if started else sig
        return started

    def _prefetch_head(self, tag: Tag, host_nodes: list[TreeNode], room: int):
        """Split the host-only part of ``tag``'s path after ``room`` pages; returns (the host
        nodes of the head, their pages), or ``None`` when no whole page fits."""
        ps = self.page_size
        tokens = self._records[tag].tokens
        host_tokens = sum(len(n.key) for n in host_nodes)
        start = len(tokens) - host_tokens
        cut = start + min(room, host_tokens // ps - 1) * ps
        if cut <= start:
            return None
        path, m = self.tree.match(tokens[:cut], split=True)
        if m < cut:
            return None
        nodes, n = [], path[-1]
        while n.state is HOST:
            nodes.append(n)
            n = n.parent
        if not nodes:
            return None
        nodes.reverse()
        return nodes, sum(len(x.host_pages) for x in nodes)

    # ================================================================ eviction
    def _dev_candidate(self, n: TreeNode) -> bool:
        return (n.state is DEVICE and n.lock_ref == 0 and n.n_device_children == 0
                and not n.detached)

    def _host_candidate(self, n: TreeNode) -> bool:
        if n.detached or n.host_pages is None:
            return False
        if n.state is HOST:
            return n.lock_ref == 0 and not n.children
        return n.state is DEVICE

    def _reindex(self, n: TreeNode) -> None:
        """(Re)enter ``n`` in the eviction heaps it is a candidate for, with its current key.
        Old entries die lazily: each carries the version it was pushed with."""
        self._state_ver += 1
        if n.parent is None:
            return
        dev = self._dev_candidate(n)
        host = self._host_candidate(n)
        if not (dev or host):
            return
        key = self.policy.eviction_key(self.index.priority(n), n.last_access)
        if dev:
            n.dev_ver += 1
            heapq.heappush(self._dev_heap, (key, n.id, n.dev_ver, n))
        if host:
            n.host_ver += 1
            heapq.heappush(self._host_heap, (key, n.id, n.host_ver, n))
        limit = 2 * self.tree.num_nodes + 4096
        if len(self._dev_heap) > limit:
            self._dev_heap = [e for e in self._dev_heap
                              if e[2] == e[3].dev_ver and self._dev_candidate(e[3])]
            heapq.heapify(self._dev_heap)
        if len(self._host_heap) > limit:
            self._host_heap = [e for e in self._host_heap
                               if e[2] == e[3].host_ver and self._host_candidate(e[3])]
            heapq.heapify(self._host_heap)

    def _on_priority_change(self, node: TreeNode, old: float, new: float) -> None:
        self._state_ver += 1
        # Only candidates need a new heap entry; most tagged nodes have device children.
        if self.policy.uses_priority and (node.n_device_children == 0 or node.host_pages is not None):
            self._reindex(node)

    def _on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        self.index.on_split(upper, lower)
        if upper.state is LOADING and upper.load is not None:
            upper.load.nodes.append(upper)
        self._reindex(upper)

    def _pop(self, heap: list, dev: bool) -> TreeNode | None:
        check = self._dev_candidate if dev else self._host_candidate
        while heap:
            _, _, ver, n = heapq.heappop(heap)
            if ver == (n.dev_ver if dev else n.host_ver) and check(n):
                return n
        return None

    def _evict_device(self, need: int, reason: str, above: float | None = None) -> int:
        """Free >= ``need`` device pages (best effort). With ``above``, only nodes whose
        priority is strictly larger than ``above`` may go (prefetch: no thrash)."""
        freed = 0
        index = self.index
        self._evict_floor = above  # read by tests' on_evict observers (M4)
        while freed < need:
            n = self._pop(self._dev_heap, True)
            if n is None:
                break
            prio = index.priority(n)
            if above is not None and prio <= above:
                self._reindex(n)
                break
            rest = need - freed
            if self.partial_eviction and len(n.device_pages) > rest:
                # Evict only the tail that is needed; the head stays a usable prefix.
                self.tree.split(n, (len(n.device_pages) - rest) * self.page_size)
            freed += self._evict_device_node(n, prio, reason)
        self._evict_floor = None
        return freed

    def _evict_device_node(self, n: TreeNode, prio: float, reason: str) -> int:
        if self.on_evict is not None:
            self.on_evict(n, "device", prio, reason)
        pages = n.device_pages
        k = len(pages)
        pol = self.policy
        if n.host_pages is None and pol.host_tier and pol.should_backup(prio, self.index.tags_below(n)):
            hp = self._alloc_host(k, prio)
            if hp is not None and not n.detached:
                n.set_state(OFFLOADING)
                n.host_pages = hp
                self.backend.backup_to_host(pages, hp)
                self.metrics.backup_pages += k
            elif hp is not None:
                self.host.free(hp)
        parent = n.parent
        self._evictable -= k
        n.device_pages = None
        parent.n_device_children -= 1
        self.device.free(pages)
        self.metrics.evicted("device:" + reason, k)
        ld = n.load
        if ld is not None and ld.kind == "prefetch" and not ld.used and not ld.wasted:
            ld.wasted = True
            self.metrics.prefetch_wasted += 1
            if self._prefetch_by_tag.get(ld.tag) is ld:
                del self._prefetch_by_tag[ld.tag]
        if n.host_pages is not None:
            n.set_state(HOST)
            if n in self.index._node_tags:
                self._host_tags.update(self.index.tags_at(n))
            self._reindex(n)
        else:
            self.metrics.dropped_pages += k
            self._remove_subtree(n)
        self._reindex(parent)
        return k

    def _evict_host(self, need: int, for_priority: float) -> int:
        freed = 0
        pol, index = self.policy, self.index
        while freed < need:
            n = self._pop(self._host_heap, False)
            if n is None:
                break
            prio = index.priority(n)
            if not pol.host_victim_allowed(prio, for_priority):
                self._reindex(n)
                break
            if self.on_evict is not None:
                self.on_evict(n, "host", prio, "backup")
            hp = n.host_pages
            n.host_pages = None
            self.host.free(hp)
            freed += len(hp)
            self.metrics.evicted("host:backup", len(hp))
            if n.state is HOST:
                parent = n.parent
                self._remove_subtree(n)
                self._reindex(parent)
        return freed

    def _remove_subtree(self, root: TreeNode) -> None:
        """Drop ``root`` and everything below it (all host-only or copy-less) from the tree."""
        order, stack = [], [root]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children first: parent links stay valid for the index
            for tag in list(self.index.tags_at(n)):
                rec = self._records.get(tag)
                if rec is not None:
                    rec.node = None
                self._host_tags.discard(tag)
            self.index.drop_node(n)
            if n.host_pages is not None:
                self.host.free(n.host_pages)
                n.host_pages = None
            if n.device_pages is not None:  # cannot happen for a candidate; defensive
                raise AssertionError(f"removing node {n.id} that still holds device pages")
            self.tree.remove_leaf(n)

    # ================================================================ introspection
    def residency(self, node: TreeNode | None) -> str:
        """``device`` / ``loading`` / ``host`` / ``none`` for the path ending at ``node``."""
        if node is None or node.detached:
            return "none"
        worst = "device"
        n = node
        while n.parent is not None:
            if n.state is HOST:
                return "host"
            if n.state is LOADING:
                worst = "loading"
            n = n.parent
        return worst

    def snapshot(self) -> dict:
        def num(x):
            return None if x == INF else x
        agents = []
        for tag, rec in sorted(self._records.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            wf, agent = tag
            node = rec.node
            agents.append({
                "workflow": wf, "agent": agent, "tokens": len(rec.tokens),
                "residency": self.residency(node),
                "ste": num(self.index.ste(tag)) if node is not None else num(self._effective_ste(tag)),
                "priority": num(self.index.priority(node)) if node is not None else None,
                "demoted": tag in self._demoted,
            })
        tree_dev = tree_host = 0
        for n in self.tree.iter_nodes():
            tree_dev += len(n.device_pages) if n.device_pages is not None else 0
            tree_host += len(n.host_pages) if n.host_pages is not None else 0
        return {
            "policy": self.policy.name,
            "page_size": self.page_size,
            "nodes": self.tree.num_nodes,
            "pools": {
                "device": {"capacity": self.device.capacity, "used": self.device.num_used,
                           "free": self.device.num_free, "tree": tree_dev,
                           "evictable": self._evictable},
                "host": {"capacity": self.host.capacity, "used": self.host.num_used,
                         "free": self.host.num_free, "tree": tree_host},
            },
            "loads_in_flight": len(self._loads),
            "workflows": {wf: {"expired": w.expired, "step": w.step, "step_s": w.step_s,
                               "client": w.client, "trusted": w.trusted, "trust": round(w.trust, 3),
                               "predictions": w.scored, "mispredicted": w.missed}
                          for wf, w in self.hints.workflows.items()},
            "agents": agents,
            "metrics": self.metrics.as_dict(),
        }

    def check_invariants(self, *, priorities: bool = True) -> None:
        """Assert every structural invariant (tests; O(nodes), O(nodes x depth) with priorities)."""
        prio = self.index.priority
        for ste in (0, 1, 2, INF):  # the memoised prefetch budget equals a fresh count
            fresh = sum(len(n.device_pages) for n in self.tree.iter_nodes()
                        if n.state is DEVICE and n.lock_ref == 0 and prio(n) > ste)
            assert self._evictable_above(ste) == fresh, (ste, fresh)
        dev_seen: set[int] = set()
        host_seen: set[int] = set()
        evictable = 0
        for n in self.tree.iter_nodes():
            assert not n.detached, n
            assert len(n.key) % self.page_size == 0 and len(n.key) > 0, n
            pages = len(n.key) // self.page_size
            assert n.device_pages is not None or n.host_pages is not None, f"T2 {n}"
            assert n.lock_ref >= 0
            assert n.parent.lock_ref >= n.lock_ref or n.parent is self.tree.root, f"T3 {n}"
            if n.state in DEVICE_HOLDING:
                assert n.device_pages is not None and len(n.device_pages) == pages, n
                assert n.parent.parent is None or n.parent.device_pages is not None, f"T1 {n}"
            else:
                assert n.device_pages is None, n
            if n.state is HOST:
                assert n.host_pages is not None, n
            if n.state is LOADING:
                assert n.load is not None and not n.load.done and n in n.load.nodes, n
            if n.host_pages is not None:
                assert len(n.host_pages) == pages
                assert self.policy.host_tier, "host copy under a device-only policy"
                for p in n.host_pages:
                    assert self.host.is_allocated(p) and p not in host_seen, p
                    host_seen.add(p)
            if n.device_pages is not None:
                for p in n.device_pages:
                    assert self.device.is_allocated(p) and p not in dev_seen, p
                    dev_seen.add(p)
            assert n.n_device_children == sum(
                1 for c in n.children.values() if c.device_pages is not None), f"T4 {n}"
            if n.state is DEVICE and n.lock_ref == 0:
                evictable += pages
            if priorities:
                want = self.index.brute_force_priority(n, lambda x: x.children.values())
                assert self.index.priority(n) == want, (n, self.index.priority(n), want)
        assert self.tree.root.n_device_children == sum(
            1 for c in self.tree.root.children.values() if c.device_pages is not None)
        assert evictable == self._evictable, (evictable, self._evictable)
        if self.policy.evicts:
            assert self.device.num_used <= self.device.capacity
        assert self.host.num_used == len(host_seen), "host page leak"
        for tag, rec in self._records.items():
            if rec.node is not None:
                assert not rec.node.detached and self.index.node_of(tag) is rec.node, tag
            on_host = rec.node is not None and rec.node.state is HOST
            assert on_host == (tag in self._host_tags), ("host-tag set out of sync", tag)
            assert (self._effective_ste(tag) <= self.lookahead) == (tag in self._near), tag
        assert self._inflight_prefetch == sum(1 for _, _, ld in self._loads if ld.kind == "prefetch")

