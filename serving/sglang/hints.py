"""Hints in the SGLang plugin: what :class:`~.cache.KVFlowRadixCache` does with the hints a
request carries and the out-of-band ones (a mixin, like :mod:`.loads`).

- Intake (``kvflow_on_request``, from the hook on ``Scheduler._add_request_to_queue``): the
  request's ``custom_params`` are parsed (malformed hints are counted and ignored, never fail
  the request), its tag ``(workflow key, agent)`` is remembered until its prompt is cached
  (``ReqHints``; tagging is in ``tagging.py``), its agent is held from prefetch while it waits
  (its own request decides: demand load or recompute), and the STEs are merged into the policy
  core's book unless the hint is stale (an earlier step than its workflow's latest). A request
  SGLang queues again (retraction, preemption, grammar wait) renews its tag only.
- Admission order (``kvflow_admission_key``, ``kvflow_order_queue``): the policy core's
  workflow order (``serving/policy/admission.py``) on the rank-agreed clock; a queue with no
  hinted request is left as SGLang sorted it.
- Out-of-band hints, workflow ends and time (``kvflow_apply_hints``,
  ``kvflow_release_workflow``, ``kvflow_expire``): the same book; a tool hint opens the waiting
  agents' tool gaps (``serving/policy/toolgap.py``).

State lives on the cache (``KVFlowRadixCache._kv_reset_state``): ``_req_hints``, ``kv_book``,
``kv_gaps``, ``kv_admission``, ``kv_prefetcher``, ``kv_stats``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from kvflow_agents.protocol import HintError, Hints
from kvflow_agents.serving.policy import workflow_key

from .messages import FIXED_TOKENS_KEY

logger = logging.getLogger(__name__)


@dataclass
class ReqHints:
    """What the cache remembers about a request's hints until it is cached."""
    tag: tuple                      # (workflow key, agent)
    workflow: str
    agent: str
    app: Optional[str]
    fixed_tokens: Optional[int]     # declared boundary in tokens (None: infer)
    tagged: bool = False            # done for this request (later checkpoints skip the work)
    held: bool = True               # its agent is not prefetched while it waits (the core's rule)


class KVFlowHints:
    """Hint intake, admission order and the hint book's upkeep; mixed into
    :class:`~.cache.KVFlowRadixCache` (module doc)."""

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
        old = self._req_hints.get(req.rid)
        if old is not None:
            self._unhold(old)
        info = self._req_hints[req.rid] = ReqHints((wf, hints.agent), hints.workflow, hints.agent,
                                                   hints.app, fixed)
        self.kv_prefetcher.hold(info.tag)  # its own request decides (demand load / recompute)
        # SGLang queues a request again after a retraction, a preemption or a grammar wait,
        # through the same _add_request_to_queue: its hints were taken the first time and the
        # workflow may have moved on since. Only its tag bookkeeping above is renewed.
        if getattr(req, "kvflow_hints_taken", False):
            self.kv_stats["requeued"] += 1
            return hints
        try:
            req.kvflow_hints_taken = True
        except AttributeError:  # a request object that takes no attributes: step check only
            pass
        self.kv_gaps.arrived(hints.workflow, hints.agent, hints.app, self._kv_now(),
                             getattr(req, "origin_input_ids", None))
        if self._stale(hints):
            self.kv_stats["stale_hints"] += 1
            return hints
        self.kvflow_apply_hints(hints)
        return hints

    def kvflow_admission_key(self, req, hints: Optional[Hints]) -> tuple:
        """The request's admission key (:mod:`~kvflow_agents.serving.policy.admission`), set
        once when it is first queued (a re-queued request keeps its place), on the rank-agreed
        clock so every rank sorts the queue alike. ``req.kvflow_admission_key``; the hook after
        SGLang's ``calc_priority`` sorts by it."""
        key = getattr(req, "kvflow_admission_key", None)
        if key is None:
            wf = (self.kv_hints.workflows.get(workflow_key(hints.workflow, hints.app))
                  if hints is not None else None)
            key = self.kv_admission.key(self._kv_now(), wf)
            try:
                req.kvflow_admission_key = key
                req.kvflow_hinted = hints is not None
            except AttributeError:
                pass
        return key

    def kvflow_order_queue(self, waiting_queue: list, priority_sign: Optional[int] = None) -> bool:
        """Stable-sort SGLang's waiting queue by workflow (``admission == "workflow"``): the
        oldest workflow's call first, then the engine's own order. Left alone when no waiting
        request carries hints (a server without hints schedules as stock SGLang).
        ``priority_sign``: SGLang's priority scheduling is on; a request's priority still
        comes first. Returns whether it sorted."""
        if not self.kv_admission.by_workflow or len(waiting_queue) < 2:
            return False
        if not any(getattr(r, "kvflow_hinted", False) for r in waiting_queue):
            return False
        def key(r):
            # a request that reached the queue another way than the intake hook: keyed now
            # (its arrival for this order), so hinted newcomers never starve it
            k = getattr(r, "kvflow_admission_key", None) or self.kvflow_admission_key(r, None)
            if priority_sign is None:
                return k
            return ((getattr(r, "priority", None) or 0) * priority_sign, k)

        waiting_queue.sort(key=key)
        self.kv_stats["queue_sorts"] += 1
        return True

    def kvflow_workflow(self, req):
        """The workflow key of ``req``'s hints (None: it came without hints)."""
        info = self._req_hints.get(getattr(req, "rid", None))
        return info.tag[0] if info is not None else None

    def _stale(self, hints: Hints) -> bool:
        """A request's hint from an earlier step than its workflow's latest: superseded."""
        w = self.kv_hints.workflows.get(workflow_key(hints.workflow, hints.app))
        return w is not None and w.step is not None and not w.expired and hints.step < w.step

    def _unhold(self, info: ReqHints) -> None:
        if info.held:
            info.held = False
            self.kv_prefetcher.unhold(info.tag)

    def kvflow_apply_hints(self, hints: Hints, *, now: Optional[float] = None) -> None:
        """Merge one hint (from a request or the out-of-band endpoint): the policy core's."""
        now = self._kv_now() if now is None else now
        self.kv_stats["hints"] += 1
        if hints.event == "end":
            self.kvflow_release_workflow(hints.workflow, hints.app)
            return
        if hints.tool_s:  # a tool step started: its waiting agents' last turns get resume tags
            self.kv_gaps.waiting(hints.workflow, hints.app, dict(hints.tool_s), now)
        self.kv_book.update(hints.workflow, dict(hints.ste), agent=hints.agent, step=hints.step,
                            app=hints.app, now=now)

    def kvflow_release_workflow(self, workflow: str, app: Optional[str] = None, *,
                                dormant: bool = False) -> None:
        dropped = self.kv_book.release(workflow, app, dormant=dormant)
        self.kv_gaps.release(workflow, app)
        for tag in dropped:
            self.kv_loads.abandon(tag)
        self.kv_prefetcher.forget(dropped)

    def kvflow_expire(self, now: Optional[float] = None) -> list:
        """Time moved on (before eviction decisions and at each scheduler step): leases
        expire, and open tool gaps move along their plan (hold -> near -> expired)."""
        now = self._kv_now() if now is None else now
        expired = self.kv_book.expire(now)
        for wf in self.kv_book.hints.drain_removed():  # forgotten or over the registry's bounds
            self.kvflow_release_workflow(wf, dormant=True)
        if self.kv_gaps.gaps:
            self.kv_gaps.tick(now)
        return expired
