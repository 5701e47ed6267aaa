"""Admission order: which waiting request an engine tries first when the batch or the device
pool cannot take every waiting request at once.

=========  ==========================================================================
name       waiting requests are tried in the order of
=========  ==========================================================================
fcfs       their own arrival (SGLang's and vLLM's default)
workflow   their *workflow's* first arrival, then their own: the oldest workflow's next call
           goes first (requests without hints count as one-call workflows)
=========  ==========================================================================

Why ``workflow`` (kvflow's default): a workflow is a chain of calls, and its latency is the sum
of its calls' queueing. When more workflows run than the device pool can hold, request-FCFS
sends every finished call's successor to the back of the queue, so all workflows advance in
lockstep and each takes about as long as the whole backlog; ordering by workflow lets the oldest
ones run back to back and finish. Each admission still fills the batch from every waiting
request (work-conserving), so the batch stays as full as under FCFS while there are enough
workflows to fill it (serving/sim/RESULTS.md, "Workflow-ordered admission": 1.25-3.4x lower mean
round latency than hicache at 32-128 memory-bound workflows; a closed set of 32 ends 1.24x
later, because its last workflows run alone). Program-level ordering of agent calls is the idea
of Autellix (Luo et al. 2025).

Starvation bound: a workflow's priority is its first arrival but never more than
``max_age_s`` before the request's own arrival, so a request waits behind newer arrivals for at
most ``max_age_s`` (a client that reuses one workflow id forever gets FCFS shifted by that much).

Cost: one key per request at arrival, O(1) (the workflow's first arrival is kept by the hint
registry with the rest of its state).

Skip scope (status-aware engines: who may run ahead of a waiting request whose prefix is still
loading, :func:`may_overtake`):

=========  ==========================================================================
name       a ready request may be admitted ahead of a loading one when
=========  ==========================================================================
all        always (the paper's skip: SGLang's prefill builder moves on to the next request)
workflow   it belongs to the loading request's workflow, or either of the two has no hints
=========  ==========================================================================

Why ``workflow`` (kvflow's default): a skip that lets *another* workflow's calls in hands them
the batch slots and device pages the loading call needs when its load lands, and that call's
workflow (an AND join: its stage ends with its slowest call) waits for them. Within one
workflow the calls behind it are its own siblings, which the skip lets start. A held request
keeps its place untouched (not polled: a poll can start its demand load, which then shares the
FIFO link with the skipped call's; in the simulator at 0.5 GB/s that halves the gain), and the
scan goes on (a request without hints may still go): hints
opt a client into workflow scheduling; traffic without them is skipped past as the paper's
status-aware scheduling does. Measured (``kvflow_agents/bench/RESULTS.md`` §6.30): never
slower than ``all``; 0.81x its latency in the simulator's 16-workflow cycle at 0.5 GB/s,
0.93x and 1.00x in two runs of a memory-bound fan-out on the embedded engine (where no skip at
all is ~7 % faster than ``all``), level where no call waits on a load; with one workflow at a
time (PEER) the two are the same rule.
"""

from __future__ import annotations

import itertools

ADMISSION_ORDERS = ("fcfs", "workflow")
SKIP_SCOPES = ("all", "workflow")


def check_admission(order: str) -> str:
    """``order`` if it names an admission order, else ValueError (the one place that says so)."""
    if order not in ADMISSION_ORDERS:
        raise ValueError(f"unknown admission order {order!r}; choose from {list(ADMISSION_ORDERS)}")
    return order


def check_skip_scope(scope: str) -> str:
    """``scope`` if it names a skip scope, else ValueError (the one place that says so)."""
    if scope not in SKIP_SCOPES:
        raise ValueError(f"unknown skip scope {scope!r}; choose from {list(SKIP_SCOPES)}")
    return scope


def may_overtake(scope: str, loading_workflow, workflow) -> bool:
    """Whether a ready request of ``workflow`` may be admitted ahead of a waiting one of
    ``loading_workflow`` whose prefix is still loading (None: no hints). See the module
    docstring's skip-scope table."""
    return scope == "all" or loading_workflow is None or workflow is None or workflow == loading_workflow


class AdmissionOrder:
    """Keys requests for admission: the engine tries the smallest key first. One per manager;
    requests with equal arrival times keep their arrival sequence."""

    def __init__(self, order: str = "fcfs", *, max_age_s: float = 600.0) -> None:
        check_admission(order)
        if not max_age_s >= 0:
            raise ValueError("max_age_s must be >= 0")
        self.order = order
        self.max_age_s = max_age_s
        self._seq = itertools.count()

    @property
    def by_workflow(self) -> bool:
        return self.order == "workflow"

    def key(self, arrival: float, workflow=None) -> tuple:
        """The admission key of a request arriving at ``arrival`` (engine clock). ``workflow``:
        its :class:`~.hints.WorkflowHints` (None: no hints), whose ``since`` (its first
        request's (arrival, sequence)) is set here on its first request."""
        seq = next(self._seq)
        if workflow is None or self.order == "fcfs":
            return (arrival, seq, seq)
        if workflow.since is None:
            workflow.since = (arrival, seq)
        t, wseq = workflow.since
        return (max(t, arrival - self.max_age_s), wseq, seq)
