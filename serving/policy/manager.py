"""``KVCacheManager``: the facade the embedded engine, the simulator and tests drive.

It wires the parts of the policy core together and forwards to them:

- :class:`~.store.TieredStore` (``store``): radix tree, device + host page pools, locks,
  insert, node states, eviction with write-through (:mod:`.eviction`), loads' node side;
- :class:`~.loads.LoadTracker` (``loads``): loads in flight, the link clock, load-vs-recompute;
- :class:`~.tags.TagBook` (``tags``): fixed-prefix tags, hints (leases), effective STE, the
  priority index, client caps, app-prefix memory, boundary inference;
- :class:`~.prefetch.Prefetcher` (``prefetcher``): candidates -> budget -> planner -> start;
- :class:`~.toolgap.ToolGaps` (``gaps``): resume tags for agents waiting on a tool
  (``kvflow_tool_s`` hints), timed by the tool's expected duration, and for agents whose
  prompts extend their last turn (turn gaps, at the agent's own STE);
- :mod:`.inspection`: ``snapshot()``, ``check_invariants()``.

Engines talk to it through per-request sessions (:mod:`.session`): ``arrive`` -> ``poll`` ->
``admit`` -> ``commit`` -> ``finish`` (waiting sessions tried in ``admission_key`` order,
:mod:`.admission`), plus ``apply_hints`` (out-of-band hints) and ``tick``
once per scheduler step. The lower-level calls stay public for tests and tools:
``match`` / ``status`` / ``peek`` / ``load_on_demand`` / ``lock`` / ``unlock`` / ``allocate`` /
``free`` / ``insert`` / ``tag_fixed_prefix`` / ``infer_fixed_prefix`` / ``update_hints`` /
``release_workflow`` (see the parts' docstrings).

Prefetch budget (M5): the reserve is what waiting sessions will still allocate or reserve (the
first ``reserve_window`` of them in admission order; all by default) and, with lazy decode, the
next page of each running session still growing, unless ``set_reserved_pages`` (or
``reserve_pages=``) gives an int or a callable. A prefetch for STE ``s`` starts only if its pages
fit in free + evictable-above-``s`` - reserve. Load versus recompute (off unless the engine gives
an estimate: ``recompute_s_per_token``, ``recompute_cost(n, ctx)``, or ``observe_prefill``):
a demand load is declined when the load tracker's estimate (link queue + transfer + one
admission delay, from ``observe_step``, while requests run) exceeds recomputing, counted once
for this request and once for each request a recompute would stall (``recompute_stalls()``:
the engine's running requests); the planner drops a late prefetch when its agent would wait
longer.

Hidden / exposed load time and wasted prefetches are counted in ``metrics`` (:mod:`.loads`).
Not thread-safe: call it from the scheduler thread only. Under ``oracle`` the device pool grows
past ``device_pages``; ``lru`` and ``oracle`` keep no host copies.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .admission import AdmissionOrder
from .backend import KVTransferBackend, NullTransferBackend
from .hints import workflow_key
from .inspection import check_invariants, snapshot
from .loads import Load, LoadTracker
from .metrics import CacheMetrics
from .policies import CachePolicy, get_policy
from .prefetch import Prefetcher
from .session import RequestSession
from .store import PrefixMatch, PrefixStatus, TieredStore
from .tags import AgentPrefix, TagBook
from .toolgap import ToolGaps
from .tree import TreeNode

__all__ = ["KVCacheManager", "TickReport", "PrefixMatch", "PrefixStatus", "Load", "AgentPrefix"]


@dataclass
class TickReport:
    now: float
    loads_finished: int = 0
    prefetches_started: list = field(default_factory=list)
    expired_workflows: list = field(default_factory=list)


class KVCacheManager:
    """The policy core's facade (module doc)."""

    def __init__(self, policy: "str | CachePolicy" = "kvflow", *, page_size: int = 16,
                 device_pages: int, host_pages: int = 0,
                 backend: KVTransferBackend | None = None, lookahead: float = 1,
                 max_inflight_loads: int = 4, lease_s: float = 60.0,
                 client_cap_pages: int | None = None, bytes_per_page: int | None = None,
                 link_bytes_per_s: float | None = None, default_step_s: float = 1.0,
                 infer_window: int = 3, partial_eviction: bool = True,
                 reserve_pages: "int | Callable[[], int] | None" = None,
                 reserve_window: int | None = None,
                 recompute_s_per_token: float | None = None,
                 recompute_cost: Callable[[int, int], float] | None = None,
                 recompute_stalls: Callable[[], int] | None = None,
                 min_partial_prefetch_pages: int = 4, admission: str | None = None,
                 admission_max_age_s: float = 600.0, lazy_decode: bool = False,
                 decode_reserve: float = 1.0, reuse_align: int = 1, turn_gaps: bool = True,
                 busy_lookahead: float | None = None,
                 fill_link_cap: float | None = 0.75) -> None:
        self.policy = get_policy(policy)
        # a request reuses a cached prefix only in whole multiples of this many tokens (an
        # engine's batch-invariant mode: prefill chunks at fixed positions); sessions use it
        # both at admission and in the prefetch reserve, so the two agree on what a request takes
        if reuse_align < 1:
            raise ValueError("reuse_align must be >= 1")
        self.reuse_align = reuse_align
        # sessions allocate decode pages as they reach them (session.grow), not at admission
        self.lazy_decode = lazy_decode
        # lazy decode: the fraction of a request's decode pages admission reserves (1: all of
        # max_tokens; less: optimistic, growth past it may retract a session; session.py)
        if not 0 < decode_reserve <= 1:
            raise ValueError(f"decode_reserve must be in (0, 1], got {decode_reserve!r}")
        self.decode_reserve = decode_reserve if lazy_decode else 1.0
        # the order engines admit waiting sessions in (``session.admission_key``); None: the policy's
        self.admission = AdmissionOrder(admission or self.policy.admission, max_age_s=admission_max_age_s)
        self.page_size = page_size
        self.device_pages = device_pages   # the configured pool (a growable one grows past it)
        self.backend = backend if backend is not None else NullTransferBackend()
        self.metrics = CacheMetrics()
        bpp = bytes_per_page if bytes_per_page is not None else getattr(self.backend, "bytes_per_page", 0)
        bw = link_bytes_per_s if link_bytes_per_s is not None else getattr(self.backend, "link_bytes_per_s", None)
        self.loads = LoadTracker(self.metrics, secs_per_page=(bpp / bw) if bpp and bw else None,
                                 recompute_s_per_token=recompute_s_per_token,
                                 recompute_cost=recompute_cost,
                                 recompute_stalls=recompute_stalls)
        self.tags = TagBook(page_size=page_size, parent_of=lambda n: n.parent, lookahead=lookahead,
                            lease_s=lease_s, client_cap_pages=client_cap_pages,
                            infer_window=infer_window)
        self.store = TieredStore(self.policy, page_size=page_size, device_pages=device_pages,
                                 host_pages=host_pages, backend=self.backend, book=self.tags,
                                 loads=self.loads, metrics=self.metrics,
                                 partial_eviction=partial_eviction)
        self.reserve_window = reserve_window
        self.prefetcher = Prefetcher(self.tags, self.loads, self.metrics, self.store,
                                     page_size=page_size, max_inflight=max_inflight_loads,
                                     default_step_s=default_step_s,
                                     reserve=self._session_reserve if reserve_pages is None else reserve_pages,
                                     min_partial_pages=min_partial_prefetch_pages,
                                     busy_lookahead=busy_lookahead,
                                     fill_link_cap=fill_link_cap)
        self._waiting: dict[int, RequestSession] = {}   # arrival order
        self._running: dict[int, RequestSession] = {}
        self.gaps = ToolGaps(self.tags, load_s=self._host_load_s, turn_gaps=turn_gaps)

    # ================================================================ sessions
    def arrive(self, tokens: Sequence[int], hints: Any = None, *, fixed_len: int | None = None,
               kv_tokens: int | None = None, client: str | None = None) -> RequestSession:
        """A request arrived: merge its hints (prefetches are planned at the next ``tick``, so
        its own demand load goes on the link first) and open its session. ``client``: who sent
        it (a tenant), for per-client caps; default the hints' app, else their workflow."""
        s = RequestSession(self, tokens, hints, fixed_len=fixed_len, kv_tokens=kv_tokens)
        now = self.backend.now()
        wf = None
        if hints is not None:
            self.gaps.arrived(hints.workflow, hints.agent, getattr(hints, "app", None), now, tokens)
            self.apply_hints(hints, sender=True, plan=False, client=client)
            s.tag = (workflow_key(hints.workflow, getattr(hints, "app", None)), hints.agent)
            self.prefetcher.hold(s.tag)  # its own request decides how its prefix comes back
            wf = self.tags.hints.workflows.get(s.tag[0])
        s.admission_key = self.admission.key(now, wf)
        self._waiting[id(s)] = s
        return s

    def apply_hints(self, hints: Any, *, sender: bool = False, plan: bool = True,
                    client: str | None = None) -> list:
        """Merge one hints object (``workflow``, ``agent``, ``ste``, ``step``, ``app``,
        ``event``; e.g. :class:`kvflow_agents.protocol.Hints`). ``event == "end"`` releases the
        workflow. ``sender``: it came with a request of ``agent`` (STE 0 unless it says
        otherwise). Returns the tags whose prefetch started (with ``plan``)."""
        if getattr(hints, "event", None) == "end":
            self.release_workflow(hints.workflow, app=getattr(hints, "app", None))
            return []
        tool_s = getattr(hints, "tool_s", None)
        if tool_s:  # a tool step started: its waiting agents' last turns get resume tags
            self.gaps.waiting(hints.workflow, getattr(hints, "app", None), dict(tool_s), self.backend.now())
        return self.update_hints(hints.workflow, dict(hints.ste), agent=hints.agent if sender else None,
                                 step=getattr(hints, "step", None), app=getattr(hints, "app", None),
                                 client=client, plan=plan)

    @property
    def waiting_sessions(self) -> list[RequestSession]:
        return list(self._waiting.values())

    @property
    def admitted_sessions(self) -> list[RequestSession]:
        return list(self._running.values())

    @property
    def decode_reserved(self) -> int:
        """Pages running sessions were admitted for but have not allocated yet (lazy decode)."""
        return sum(s.decode_reserved for s in self._running.values())

    def room_for(self, n_pages: int) -> bool:
        """Whether a session may take ``n_pages`` (allocated now or reserved) and leave every
        running session's reserve coverable by free + evictable pages (session.py, S1)."""
        store = self.store
        if not store.policy.evicts:  # a growable pool (the oracles)
            if not store.policy.admission_pool_bound:
                return True
            # oracle-pool: cached pages are free; what requests hold must fit the configured pool
            held = store.device.num_used - store.evictable
            return self.device_pages - held - self.decode_reserved >= n_pages
        return store.device.num_free + store.evictable - self.decode_reserved >= n_pages

    def unpin_waiting(self, keep: RequestSession | None = None) -> None:
        for s in self._waiting.values():
            if s is not keep:
                s.unpin()

    def unpin_if_stuck(self, keep: RequestSession) -> bool:
        """Deadlock breaker: when ``keep`` finds no device room while no request runs and no
        load is in flight, only the other waiting sessions' pins hold the room, and nothing
        would release them (an engine that makes them wait behind ``keep``); unpin them.
        True if it did (the caller tries again)."""
        if self._running or self.store.loads.in_flight:
            return False
        self.unpin_waiting(keep=keep)
        return True

    def _admitted(self, s: RequestSession) -> None:
        if self._waiting.pop(id(s), None) is not None and s.tag is not None:
            self.prefetcher.unhold(s.tag)
        self._running[id(s)] = s

    def _retracted(self, s: RequestSession) -> None:
        self._running.pop(id(s), None)
        self._waiting[id(s)] = s
        if s.tag is not None:
            self.prefetcher.hold(s.tag)
        self.metrics.retractions += 1

    def _finished(self, s: RequestSession) -> None:
        if self._waiting.pop(id(s), None) is not None and s.tag is not None:
            self.prefetcher.unhold(s.tag)
        self._running.pop(id(s), None)
        h = s.hints
        if h is not None and s.written:  # what its resumed turn would start with
            siblings = any(o.tag == s.tag for o in self._running.values()) or any(
                o.tag == s.tag for o in self._waiting.values())
            self.gaps.finished(h.workflow, h.agent, getattr(h, "app", None), s.written,
                               now=self.backend.now(), siblings=siblings)

    def _host_load_s(self, node: Any) -> float:
        """Link time to bring ``node``'s host-only path back (0 when it is on device)."""
        pages = self.store.host_pages(node) if node is not None else 0
        return self.estimate_load_s(pages) if pages else 0.0

    def _session_reserve(self) -> int:
        """Pages the first ``reserve_window`` waiting sessions (in admission order) will take,
        plus (lazy decode) one per running session still growing: its next page, which a
        prefetch in flight would otherwise make it wait for (session.grow)."""
        waiting, window = self._waiting.values(), self.reserve_window
        growing = sum(1 for s in self._running.values() if s.growing) if self.lazy_decode else 0
        if window is not None and len(waiting) > window:
            order = (heapq.nsmallest(window, waiting, key=lambda s: s.admission_key)
                     if self.admission.by_workflow else itertools.islice(waiting, window))
            return growing + sum(s.reserve_pages() for s in order)
        return growing + sum(s.reserve_pages() for s in waiting)

    # ================================================================ time
    def tick(self, now: float | None = None, *, prefetch: bool = True) -> TickReport:
        """Once per scheduler step: land due loads, expire quiet workflows, plan prefetches
        (``prefetch=False``: the engine calls :meth:`prefetch` itself later in the step)."""
        now = self.backend.now() if now is None else now
        report = TickReport(now)
        report.loads_finished = self.store.poll_loads(now)
        report.expired_workflows = self.tags.expire(now)
        for wf in self.tags.hints.drain_removed():  # forgotten or over the registry's bounds
            self.release_workflow(wf, dormant=True)
        self.gaps.tick(now)
        if prefetch:
            report.prefetches_started = self.prefetch(now)
        return report

    def observe_step(self, seconds: float) -> None:
        """A busy scheduler step took ``seconds``: the admission delay a load is charged."""
        self.loads.observe_step(seconds)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        """Prefill speed: the recompute estimate when none is configured."""
        self.loads.observe_prefill(n_tokens, seconds)

    def prefetch(self, now: float | None = None) -> list:
        """Plan and start prefetches now (none under a policy that does not prefetch); returns
        the tags whose prefetch started."""
        now = self.backend.now() if now is None else now
        if not self.policy.prefetch:
            return []
        self.store.poll_loads(now)
        return self.prefetcher.run(now)

    # ================================================================ hints and tags
    def update_hints(self, workflow: str, ste: dict, *, agent: str | None = None,
                     step: int | None = None, app: str | None = None,
                     client: str | None = None, now: float | None = None,
                     plan: bool = True) -> list:
        """Merge a hint (``{agent: steps | None}``); returns the tags whose prefetch started."""
        now = self.backend.now() if now is None else now
        self.tags.update(workflow, ste, agent=agent, step=step, app=app, client=client, now=now)
        return self.prefetch(now) if plan else []

    def set_client_cap(self, pages: int | None) -> None:
        """Change the per-client cap (None: none) and re-apply it to every client."""
        self.tags.set_client_cap(pages)

    def release_workflow(self, workflow: str, app: str | None = None, *, dormant: bool = False) -> None:
        """The workflow ended: forget its hints and tags (its cache becomes ordinary LRU prey).
        ``dormant``: forgotten while quiet, not ended (``TagBook.release``)."""
        dropped = self.tags.release(workflow, app, dormant=dormant)
        self.gaps.release(workflow, app)
        for tag in dropped:
            self.loads.abandon(tag)
        self.prefetcher.forget(dropped)

    def tag_fixed_prefix(self, tokens: Sequence[int], fixed_len_tokens: int, workflow: str,
                         agent: str, app: str | None = None) -> TreeNode | None:
        return self.tags.tag_fixed_prefix(tokens, fixed_len_tokens, workflow, agent, app)

    def infer_fixed_prefix(self, workflow: str, agent: str, tokens: Sequence[int], *,
                           app: str | None = None) -> int:
        """No declared boundary: record ``tokens`` in the agent's history and tag (after
        ``insert``) the page-aligned prefix its recent prompts share; returns its length."""
        b = self.tags.infer_boundary(workflow, agent, tokens, app)
        if b > 0:
            self.tags.tag_fixed_prefix(tokens, b, workflow, agent, app=app)
        return b

    def fixed_prefix_len(self, workflow: str, agent: str, app: str | None = None) -> int:
        return self.tags.fixed_prefix_len(workflow, agent, app)

    def agent_node(self, workflow: str, agent: str, app: str | None = None) -> TreeNode | None:
        return self.tags.agent_node(workflow, agent, app)

    def agent_residency(self, workflow: str, agent: str, app: str | None = None) -> str:
        return self.store.residency(self.tags.agent_node(workflow, agent, app))

    # ================================================================ store (forwarded)
    def match(self, tokens: Sequence[int], *, record: bool = True) -> PrefixMatch:
        return self.store.match(tokens, record=record)

    def status(self, tokens: Sequence[int], *, record: bool = False) -> PrefixStatus:
        return self.store.status(tokens, record=record)

    def peek(self, tokens: Sequence[int]) -> PrefixMatch:
        return self.store.peek(tokens)

    def load_on_demand(self, match: PrefixMatch, *, recompute_s: float | None = None) -> float | None:
        return self.store.load_on_demand(match, recompute_s=recompute_s)

    def lock(self, target: "PrefixMatch | TreeNode") -> TreeNode:
        return self.store.lock(target)

    def unlock(self, node: TreeNode) -> None:
        self.store.unlock(node)

    def allocate(self, n_pages: int) -> list[int] | None:
        return self.store.allocate(n_pages)

    def free(self, pages: Sequence[int]) -> None:
        self.store.free(pages)

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> TreeNode:
        return self.store.insert(tokens, device_pages)

    def flush(self) -> tuple[int, int]:
        """Drop every unlocked cached prefix (device, then host): ``(device, host)`` pages."""
        return self.store.flush()

    def discard_all(self) -> tuple[int, int]:
        """Forget every unlocked prefix, copying none of it to host: the engine's KV bytes can
        no longer be trusted (a copy failed). Loads in flight land first (their bytes were
        copied; the emulated link's time no longer matters), so they go too."""
        self.store.poll_loads(float("inf"))
        return self.store.flush(write_through=False)

    def residency(self, node: TreeNode | None) -> str:
        return self.store.residency(node)

    @property
    def tree(self):
        return self.store.tree

    @property
    def device(self):
        return self.store.device

    @property
    def host(self):
        return self.store.host

    @property
    def index(self):
        return self.tags.index

    @property
    def hints(self):
        return self.tags.hints

    @property
    def planner(self):
        return self.prefetcher.planner

    @property
    def on_evict(self):
        return self.store.on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        self.store.on_evict = fn

    @property
    def free_device_pages(self) -> int:
        return self.store.device.num_free

    @property
    def evictable_device_pages(self) -> int:
        """Pages in unlocked device-resident nodes (an upper bound on what eviction can free)."""
        return self.store.evictable

    @property
    def lookahead(self) -> float:
        return self.tags.lookahead

    @lookahead.setter
    def lookahead(self, value: float) -> None:
        self.tags.set_lookahead(value)

    # ================================================================ budget, loads
    def set_reserved_pages(self, pages: "int | Callable[[], int]") -> None:
        """Override the reserve (an int, or a callable evaluated only when a prefetch needs
        room); by default it is what the waiting sessions will still allocate."""
        self.prefetcher.reserve = pages

    @property
    def reserved_pages(self) -> int:
        return self.prefetcher.reserved_pages

    def prefetch_room(self, ste: float) -> int:
        """Device pages a prefetch for an agent of STE ``ste`` may take now."""
        return self.prefetcher.room(ste)

    @property
    def secs_per_page(self) -> float:
        return self.loads.secs_per_page

    def estimate_load_s(self, n_pages: int, now: float | None = None) -> float:
        return self.loads.estimate_load_s(n_pages, self.backend.now() if now is None else now)

    def recompute_s(self, n_tokens: int, ctx_tokens: int = 0) -> float | None:
        return self.loads.recompute_s(n_tokens, ctx_tokens)

    def should_load(self, n_pages: int, recompute_s: float | None = None,
                    now: float | None = None) -> bool:
        return self.loads.should_load(n_pages, recompute_s, self.backend.now() if now is None else now)

    @property
    def loads_in_flight(self) -> int:
        return self.loads.in_flight

    @property
    def next_load_at(self) -> float | None:
        """When the earliest in-flight load lands (backend clock), or None: how long an idle
        scheduler may sleep before the next ``tick`` can make progress."""
        return self.loads.next_ready

    @property
    def next_event_at(self) -> float | None:
        """The earliest of :attr:`next_load_at` and the next tool-gap plan change (a resume tag
        turning near, or expiring): when an idle scheduler should ``tick`` next."""
        times = [t for t in (self.loads.next_ready, self.gaps.next_change_at()) if t is not None]
        return min(times) if times else None

    # ================================================================ inspection
    def snapshot(self) -> dict:
        return snapshot(self)

    def check_invariants(self, *, priorities: bool = True) -> None:
        check_invariants(self, priorities=priorities)
