"""LangGraph adapter: ``kvflow.instrument(graph)``.

    import kvflow_agents as kvflow
    app = kvflow.instrument(builder, checkpointer=InMemorySaver())   # or a compiled graph
    app.invoke(inputs, {"configurable": {"thread_id": "t1"}})        # a real CompiledStateGraph
    app.kvflow_graph                                                 # its Agent Step Graph

What happens:

* **Structure** — the Agent Step Graph is read from the builder (:mod:`.langgraph_asg`).
* **Returned object** — ``compiled.with_config(callbacks=[handler])``: a real
  ``CompiledStateGraph`` (invoke/ainvoke/stream/astream/get_state, checkpointers and interrupts
  unchanged) carrying ``.kvflow_graph`` and ``.kvflow`` (:class:`LangGraphInstrumentation`).
* **Tracking, one workflow per ``thread_id``** (the root run id without one). Steps follow
  Pregel super-steps *synchronously*: when a super-step begins, every task of its frontier is
  started in the tracker (so parallel siblings all read STE 0, whatever order the executor
  runs them in); when it ends, they all finish (arriving at barriers), exactly when LangGraph
  applies their writes. The frontier is read from the Pregel loop right after it prepares a
  step (``PregelLoop.tick``/``after_tick`` are wrapped once per process; loops of graphs that
  were not instrumented are left alone). Callbacks give the rest: run start/end, which tasks
  completed, interrupts (``GraphCallbackHandler.on_interrupt`` and ``GraphInterrupt`` errors).
  Subgraph nodes are inlined: an inner super-step is a step of the workflow; the first inner
  step shares the container's step.
* **Hints** — a hint provider reads the running node from langchain-core's
  ``var_child_runnable_config`` (``langgraph_checkpoint_ns`` gives the agent path, ``thread_id``
  the workflow), so any ``openai`` client (``ChatOpenAI``, raw SDK) patched by
  :mod:`kvflow_agents.autopatch`, or using :func:`kvflow_agents.http_client`, sends them.
* **Fixed prefix** — by default the leading system/developer messages of each request; mark
  another boundary with a content part ``kvflow.fixed_prefix.marker_part(text)`` (or OpenAI's
  ``prompt_cache_breakpoint``), see :mod:`kvflow_agents.fixed_prefix`.
* **Tool nodes** — ``add_node(..., metadata={"kvflow": {"llm": False}})``, a prebuilt
  ``ToolNode``, or ``instrument(graph, tool_nodes=[...])``: they take a step, send no request.
  A tool node that hands off (``Command(goto=..., graph=Command.PARENT)``, as the handoff tools
  of langgraph-supervisor and langgraph-swarm) finishes its step when it raises the command.
* **Prebuilt multi-agent apps** — ``create_react_agent``, ``create_supervisor`` (workers are
  inlined: ``math_expert/agent``, ``math_expert/tools``) and ``create_swarm`` read as any graph
  (:mod:`.langgraph_asg`: handoff tools are the conditional edges).
* **Learned transitions** — each workflow's tracker is a
  :class:`~kvflow_agents.graph.learned.LearnedTracker`: where an LLM picks the next agent (a
  supervisor's routing, a swarm hand-off, a ReAct agent calling a tool or answering), the hints
  carry the *expected* STE from transition counts learned per app (``app_id``), never below the
  exact one. ``model=`` a :class:`~kvflow_agents.graph.learned.TransitionModel` (default: one
  per process, shared with the AutoGen adapter), ``learn=False`` freezes it, ``transitions=``
  a JSON file (or env ``KVFLOW_TRANSITIONS``) persists it across runs and processes,
  ``recorder=`` a ``TraceRecorder`` keeps the runs (``kvflow bench predict --traces``).
* **Out of band** — a step that runs a tool node (``llm=False``) posts a ``transition``; the end
  of a run (not a pause at an interrupt) releases the workflow with ``end`` (all STE null).
* **Tool gaps** — each tool node's step is timed, per tool called (the names in the last
  ``AIMessage``'s ``tool_calls``; the node as a whole when it cannot tell), as a moving average
  (:class:`ToolTimes`). Once a tool has been timed, the ``transition`` of a step that runs it says
  *when* the agents it returns to run again: ``kvflow_tool_s = {agent: expected seconds}``, for
  each LLM agent one step after the tool node. The server keeps those agents' last turns and
  brings them back in time (``serving/policy/toolgap.py``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables.config import var_child_runnable_config
from langgraph.errors import GraphInterrupt, ParentCommand
from langgraph.graph import StateGraph
from langgraph.graph.state import CompiledStateGraph

from .. import autopatch
from ..context import register_hint_provider
from ..graph import AgentStepGraph, GraphError, WorkflowTracker, next_agents
from ..graph.learned import LearnedTracker, TraceRecorder, TransitionModel, default_model
from ..oob import HintReporter
from ..protocol import MAX_ID_LEN, Hints
from .langgraph_asg import ASGInfo, KVFlowGraphWarning, build_asg, node_is_llm

try:  # LangGraph >= 1.1: public interrupt/resume lifecycle callbacks
    from langgraph.callbacks import GraphCallbackHandler as _HandlerBase
except Exception:  # noqa: BLE001
    _HandlerBase = BaseCallbackHandler  # type: ignore[misc, assignment]

log = logging.getLogger("kvflow_agents")

__all__ = ["instrument", "LangGraphInstrumentation", "build_asg", "KVFlowGraphWarning",
           "node_is_llm", "END_AGENT"]

END_AGENT = "__end__"  # the ``agent`` of an out-of-band "end" post
MAX_WORKFLOWS = 4096  # per instrumented app; least recently used paused threads go first
DEFAULT_GRAPH_NAME = "LangGraph"


class ToolTimes:
    """Measured durations of tool steps: an exponential moving average per tool name (and per
    tool node, for steps whose tools are unknown). Thread-safe."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.by_tool: dict[str, float] = {}
        self.by_node: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, node: str, tools: tuple, seconds: float) -> None:
        with self._lock:
            keys = [(self.by_node, node)] + [(self.by_tool, t) for t in tools]
            for table, key in keys:
                old = table.get(key)
                table[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def expected(self, node: str, tools: tuple) -> Optional[float]:
        """The expected seconds of a step of ``node`` running ``tools`` (in parallel: the
        slowest), or None when none of them was timed yet."""
        with self._lock:
            known = [self.by_tool[t] for t in tools if t in self.by_tool]
            if known:
                return max(known)
            return self.by_node.get(node)


def _tool_names(task_input: Any) -> tuple:
    """The tools a ToolNode task will run: from a ``ToolCallWithContext`` (a ``Send`` per call)
    or the last ``AIMessage``'s ``tool_calls`` in its input state."""
    if isinstance(task_input, dict):
        if task_input.get("__type") == "tool_call_with_context":
            name = (task_input.get("tool_call") or {}).get("name")
            return (name,) if isinstance(name, str) else ()
        msgs = task_input.get("messages")
    elif isinstance(task_input, list):
        msgs = task_input
    else:
        msgs = getattr(task_input, "messages", None)
    for m in reversed(msgs or ()):
        calls = getattr(m, "tool_calls", None)
        if calls:
            return tuple(sorted({c.get("name") for c in calls if isinstance(c.get("name"), str)}))
    return ()


@dataclass
class _LoopState:
    root: bool
    ticks: int = 0  # steps that ran something of ours
    started: list[tuple[str, str]] = field(default_factory=list)  # (agent, task ns)
    base: int = 0  # a subgraph loop: the workflow step of its first super-step


@dataclass
class _Workflow:
    id: str
    tracker: WorkflowTracker
    wire_id: str = ""  # ``id`` as sent (hashed when longer than the protocol allows)
    lock: threading.RLock = field(default_factory=threading.RLock)
    step: int = 0  # global step counter (Pregel super-steps, subgraphs inlined)
    loops: dict[int, _LoopState] = field(default_factory=dict)
    root_ns: str = ""
    task_step: dict[str, int] = field(default_factory=dict)  # task checkpoint ns -> step
    completed: set[str] = field(default_factory=set)  # task ns whose node run ended well
    interrupted: bool = False
    run_id: Optional[UUID] = None
    version: int = 0
    tool_runs: dict[str, tuple[str, tuple, float]] = field(default_factory=dict)  # ns -> (node, tools, t0)
    hints_cache: dict[tuple[str, int], tuple[int, Hints]] = field(default_factory=dict)


def _handlers(callbacks: Any) -> Iterable[Any]:
    if callbacks is None:
        return ()
    if isinstance(callbacks, (list, tuple)):
        return callbacks
    return getattr(callbacks, "handlers", None) or ()


def _find_instrumentation(callbacks: Any) -> Optional["LangGraphInstrumentation"]:
    """The innermost instrumented graph this run belongs to (handlers a graph adds come after
    the ones it inherits)."""
    found = None
    for h in _handlers(callbacks):
        if isinstance(h, _Handler):
            found = h.inst
    return found


def _ns_names(ns: str) -> tuple[list[str], list[str]]:
    """``"sub:<id>|inner:<id>"`` -> (["sub:<id>", "inner:<id>"], ["sub", "inner"])."""
    parts = [p for p in ns.split("|") if p] if ns else []
    return parts, [p.split(":", 1)[0] for p in parts]


class LangGraphInstrumentation:
    """Runtime state of one instrumented graph: its Agent Step Graph and one tracker per
    workflow (thread). Reached as ``app.kvflow``."""

    def __init__(self, info: ASGInfo, app_id: str, hints_url: Optional[str] = None, *,
                 model: Optional[TransitionModel] = None, learn: bool = True,
                 recorder: Optional[TraceRecorder] = None, next_run: bool = False) -> None:
        self.info = info
        self.next_run = next_run  # hints name the next run's entry agents (AgentStepGraph.next_run_ste)
        self.graph: AgentStepGraph = info.graph
        self.app_id = app_id
        self.model = model if model is not None else default_model()
        self.learn = learn
        self.recorder = recorder
        self.reporter = HintReporter(hints_url)
        self.tool_times = ToolTimes()
        self.handler = _Handler(self)
        self._lock = threading.RLock()
        self._workflows: OrderedDict[str, _Workflow] = OrderedDict()
        self._root_of: dict[UUID, UUID] = {}  # chain run -> root run of this graph
        self._node_runs: dict[UUID, tuple[str, str]] = {}  # node run -> (workflow id, task ns)
        self._run_wf: dict[UUID, str] = {}  # root run -> workflow id
        self._resolve_cache: dict[tuple[str, ...], tuple[Optional[str], int, str]] = {}

    # ------------------------------------------------------------------ lookup
    @property
    def warnings(self) -> list[str]:
        return list(self.info.warnings)

    def tracker(self, workflow_id: str) -> Optional[WorkflowTracker]:
        """The tracker of a workflow (a thread id, or ``run-<root run id>``), if known."""
        wf = self._workflows.get(str(workflow_id))
        return wf.tracker if wf is not None else None

    @property
    def workflows(self) -> list[str]:
        with self._lock:
            return list(self._workflows)

    def _workflow(self, wid: str, create: bool = True) -> Optional[_Workflow]:
        with self._lock:
            wf = self._workflows.get(wid)
            if wf is not None:
                self._workflows.move_to_end(wid)
                return wf
            if not create:
                return None
            wire = wid if 0 < len(wid) <= MAX_ID_LEN else "sha1:" + hashlib.sha1(wid.encode()).hexdigest()
            wf = _Workflow(wid, LearnedTracker(self.graph, self.model, app=self.app_id, workflow_id=wid,
                                               learn=self.learn, recorder=self.recorder, min_evidence=1),
                           wire_id=wire)
            self._workflows[wid] = wf
            while len(self._workflows) > MAX_WORKFLOWS:
                self._workflows.popitem(last=False)
            return wf

    def _workflow_id(self, thread_id: Any, run_id: Optional[UUID]) -> Optional[str]:
        if thread_id is not None and thread_id != "":
            return str(thread_id)
        if run_id is None:
            return None
        root = self._root_of.get(run_id, run_id)
        return f"run-{root}"

    def _resolve(self, ns: str, root_ns: str) -> tuple[Optional[str], int, str]:
        """Map a task's checkpoint ns onto the ASG: ``(name, kind, ns_of_name)`` where kind is
        0 = an agent, 1 = a subgraph container, 2 = inside an agent (a subgraph the builder
        does not show, e.g. invoked from a node function): name is that agent."""
        if root_ns and ns.startswith(root_ns + "|"):
            ns = ns[len(root_ns) + 1:]
        parts, names = _ns_names(ns)
        key = tuple(names)
        hit = self._resolve_cache.get(key)
        if hit is None:
            hit = (None, 3, 0)  # type: ignore[assignment]
            full = "/".join(names)
            if full in self.graph:
                hit = (full, 0, len(names))  # type: ignore[assignment]
            elif full in self.info.containers:
                hit = (full, 1, len(names))  # type: ignore[assignment]
            else:
                for k in range(len(names) - 1, 0, -1):
                    prefix = "/".join(names[:k])
                    if prefix in self.graph:
                        hit = (prefix, 2, k)  # type: ignore[assignment]
                        break
            if len(self._resolve_cache) < 4096:
                self._resolve_cache[key] = hit  # type: ignore[assignment]
        name, kind, depth = hit  # type: ignore[misc]
        owner_ns = "|".join(parts[:depth])  # type: ignore[index]
        if root_ns and owner_ns:
            owner_ns = root_ns + "|" + owner_ns
        return name, kind, owner_ns

    # ------------------------------------------------------------------ runs (callbacks)
    def _on_chain_start(self, run_id: UUID, parent_run_id: Optional[UUID], tags: Any,
                        metadata: Optional[dict], name: Optional[str]) -> None:
        root = self._root_of.get(parent_run_id) if parent_run_id is not None else None
        if root is None:  # a run of this graph that nothing of ours encloses: a root run
            self._root_of[run_id] = run_id
            md = metadata or {}
            wid = self._workflow_id(md.get("thread_id"), run_id)
            wf = self._workflow(wid)  # type: ignore[arg-type]
            self._run_wf[run_id] = wid  # type: ignore[assignment]
            with wf.lock:  # type: ignore[union-attr]
                if wf.loops:  # a previous run that never reported its end (an abandoned stream)
                    self._settle(wf)  # type: ignore[arg-type]
                wf.run_id = run_id  # type: ignore[union-attr]
                wf.interrupted = False  # type: ignore[union-attr]
            return
        self._root_of[run_id] = root
        md = metadata or {}
        node = md.get("langgraph_node")
        if node is not None and name == node and tags and any(
                isinstance(t, str) and t.startswith("graph:step:") for t in tags):
            wid = self._workflow_id(md.get("thread_id"), run_id)
            ns = md.get("langgraph_checkpoint_ns") or str(node)
            self._node_runs[run_id] = (wid, ns)  # type: ignore[assignment]
            if not _PATCHED:  # fallback: no step frontier from the loop, track node runs
                self._fallback_start(wid, ns, md)  # type: ignore[arg-type]

    def _on_chain_end(self, run_id: UUID, error: Optional[BaseException]) -> None:
        node = self._node_runs.pop(run_id, None)
        if node is not None:
            wf = self._workflow(node[0], create=False)
            if wf is not None:
                with wf.lock:
                    if error is None:
                        wf.completed.add(node[1])
                    elif isinstance(error, GraphInterrupt):
                        wf.interrupted = True
                    elif isinstance(error, ParentCommand):  # a hand-off: done, its loop is over
                        self._tool_done(wf, node[1])
                        self._finish_handoff(wf, node[1])
                if not _PATCHED:
                    self._fallback_finish(wf, node[1], error)
        root = self._root_of.pop(run_id, None)
        if root is not None and root == run_id:
            self._on_run_end(run_id, error)

    def _on_run_end(self, run_id: UUID, error: Optional[BaseException]) -> None:
        wid = self._run_wf.pop(run_id, None)
        wf = self._workflow(wid, create=False) if wid is not None else None
        if wf is None or wf.run_id != run_id:
            return
        ended = False
        with wf.lock:
            t = wf.tracker
            self._settle(wf)
            wf.run_id = None
            if not (wf.interrupted and (error is None or isinstance(error, GraphInterrupt))):
                t.end()
                ended = True
            step = wf.step
        if ended:
            self.reporter.report(Hints(workflow=wf.wire_id, agent=END_AGENT, step=step,
                                       ste=t.ste(), next=[], app=self.app_id, event="end"),
                                 event="end")
            if self.learn:
                self.model.flush()  # persist what this run taught (when bound to a file)
            if wf.id.startswith("run-"):  # nothing can resume a run without a thread
                with self._lock:
                    self._workflows.pop(wf.id, None)

    @staticmethod
    def _finish_handoff(wf: _Workflow, ns: str) -> None:
        """The task ``ns`` raised ``Command(graph=Command.PARENT)``: it finished (its step ends
        with it; the loop it ran in stops without an ``after_tick``)."""
        for key, ls in list(wf.loops.items()):
            for i, (agent, n) in enumerate(ls.started):
                if n == ns:
                    del ls.started[i]
                    try:
                        wf.tracker.finish(agent)
                    except GraphError:
                        pass
                    wf.task_step.pop(ns, None)
                    wf.version += 1
                    if not ls.started and not ls.root:
                        del wf.loops[key]
                    return

    @staticmethod
    def _settle(wf: _Workflow) -> None:
        """The run is over (or paused): agents whose node completed finish (arriving at
        barriers), the others (interrupted, failed) are dropped without arriving."""
        t = wf.tracker
        for ls in wf.loops.values():
            for agent, ns in ls.started:
                try:
                    if ns in wf.completed:
                        t.finish(agent)
                    else:
                        t.cancel(agent)
                except GraphError:
                    pass
        wf.loops.clear()
        wf.task_step.clear()
        wf.completed.clear()
        wf.tool_runs.clear()  # a tool node that failed or was interrupted (a resume re-registers)
        wf.version += 1

    def _on_interrupt(self, run_id: Optional[UUID]) -> None:
        wid = self._run_wf.get(run_id) if run_id is not None else None
        wf = self._workflow(wid, create=False) if wid is not None else None
        if wf is not None:
            with wf.lock:
                wf.interrupted = True

    # ------------------------------------------------------------------ steps (Pregel loop)
    def _on_tick(self, loop: Any) -> None:
        """A super-step of ``loop`` is about to run ``loop.tasks``: start its whole frontier."""
        manager = getattr(loop, "manager", None)
        conf = (loop.config or {}).get("configurable") or {}
        wid = self._workflow_id(conf.get("thread_id"), getattr(manager, "run_id", None))
        if wid is None:
            return
        wf = self._workflow(wid)
        assert wf is not None
        transition: Optional[str] = None
        with wf.lock:
            ls = wf.loops.get(id(loop))
            loop_ns = conf.get("checkpoint_ns") or ""
            if ls is None:
                ls = wf.loops[id(loop)] = _LoopState(root=not wf.loops)
                if ls.root:
                    wf.root_ns = loop_ns
            frontier = []
            for task in list(loop.tasks.values()):
                if task.writes:  # replayed from a checkpoint: will not run
                    continue
                md = (task.config or {}).get("metadata") or {}
                ns = md.get("langgraph_checkpoint_ns") or task.name
                name, kind, _ = self._resolve(ns, wf.root_ns)
                if kind in (0, 1):  # an agent, or a subgraph container
                    frontier.append((name, kind, ns))
            if not frontier:  # the input step ("__start__"), nothing of ours runs
                return
            if ls.root:
                step = wf.step + 1
            elif not ls.ticks:  # a subgraph's first step: its container's
                step = ls.base = wf.task_step.get(loop_ns, wf.step + 1)
            else:  # its k-th step: container + k - 1, so parallel instances (Send) stay in step
                step = ls.base + ls.ticks
            ls.ticks += 1
            wf.step = max(wf.step, step)
            t = wf.tracker
            tool_s: dict[str, float] = {}
            tasks = {((tk.config or {}).get("metadata") or {}).get("langgraph_checkpoint_ns") or tk.name: tk
                     for tk in loop.tasks.values()}
            for name, kind, ns in frontier:
                wf.task_step[ns] = step
                if kind != 0:
                    continue  # a container: its inner loop is tracked
                try:
                    t.start(name, step=max(step, t.step))
                except GraphError:
                    continue
                ls.started.append((name, ns))
                if not self.graph.is_llm(name):
                    tools = _tool_names(getattr(tasks.get(ns), "input", None))
                    wf.tool_runs[ns] = (name, tools, time.monotonic())
                    self._plan_resume(name, tools, tool_s)
                    if transition is None:
                        transition = name
            wf.version += 1
            if transition is not None:
                hints = self._hints(wf, transition, step)
        if transition is not None:
            update: dict[str, Any] = {"event": "transition"}
            if tool_s:
                update["tool_s"] = tool_s
            self.reporter.report(hints.model_copy(update=update), event="transition")

    def _plan_resume(self, tool_node: str, tools: tuple, out: dict[str, float]) -> None:
        """The LLM agents ``tool_node`` returns to, with the step's expected duration (when its
        tools were timed before)."""
        secs = self.tool_times.expected(tool_node, tools)
        if secs is None:
            return
        for nxt in self.graph.successors(tool_node):
            if nxt in self.graph and self.graph.is_llm(nxt):
                out[nxt] = max(out.get(nxt, 0.0), secs)

    def _tool_done(self, wf: _Workflow, ns: str) -> None:
        """A tool node's task finished: time it (caller holds ``wf.lock``)."""
        run = wf.tool_runs.pop(ns, None)
        if run is not None:
            node, tools, t0 = run
            self.tool_times.observe(node, tools, time.monotonic() - t0)

    def _loop_workflow(self, loop: Any) -> Any:
        """The tracked workflow a Pregel loop belongs to (by thread id, else root run id)."""
        manager = getattr(loop, "manager", None)
        conf = (loop.config or {}).get("configurable") or {}
        wid = self._workflow_id(conf.get("thread_id"), getattr(manager, "run_id", None))
        return self._workflow(wid, create=False) if wid is not None else None

    def _on_after_tick(self, loop: Any) -> None:
        """The super-step ran: its tasks finish (and arrive at barriers) together."""
        wf = self._loop_workflow(loop)
        if wf is None:
            return
        with wf.lock:
            ls = wf.loops.get(id(loop))
            if ls is None:
                return
            for agent, ns in ls.started:
                try:
                    wf.tracker.finish(agent)
                except GraphError:
                    pass
                self._tool_done(wf, ns)
                wf.completed.discard(ns)
                wf.task_step.pop(ns, None)
            ls.started = []
            wf.version += 1

    def _on_loop_exit(self, loop: Any) -> None:
        """``tick()`` said the loop is over (done, out of steps, draining)."""
        wf = self._loop_workflow(loop)
        if wf is None:
            return
        with wf.lock:
            ls = wf.loops.get(id(loop))
            if ls is not None and not ls.started and not ls.root:
                del wf.loops[id(loop)]

    # ------------------------------------------------------------------ fallback (no loop hook)
    def _fallback_start(self, wid: str, ns: str, md: dict) -> None:
        wf = self._workflow(wid)
        assert wf is not None
        with wf.lock:
            name, kind, _ = self._resolve(ns, wf.root_ns)
            if kind != 0:
                return
            if not wf.tracker.running:
                wf.step += 1
            wf.task_step[ns] = wf.step
            try:
                wf.tracker.start(name, step=wf.step)  # type: ignore[arg-type]
            except GraphError:
                return
            wf.loops.setdefault(0, _LoopState(root=True)).started.append((name, ns))  # type: ignore[arg-type]
            wf.version += 1

    def _fallback_finish(self, wf: _Workflow, ns: str, error: Optional[BaseException]) -> None:
        with wf.lock:
            ls = wf.loops.get(0)
            if ls is None:
                return
            for i, (agent, n) in enumerate(ls.started):
                if n == ns:
                    del ls.started[i]
                    if error is None:
                        wf.tracker.finish(agent)
                    else:
                        wf.tracker.cancel(agent)
                    wf.version += 1
                    return

    # ------------------------------------------------------------------ hints
    def _hints(self, wf: _Workflow, agent: str, step: int) -> Hints:
        cached = wf.hints_cache.get((agent, step))
        if cached is not None and cached[0] == wf.version:
            return cached[1]
        ste = wf.tracker.wire_ste()  # expected STE (learned), never below the exact one
        if self.next_run:
            ste = self.graph.next_run_ste(ste)
        nxt = next_agents(ste)
        # Our own values (ids checked when the workflow was created): skip re-validation.
        h = Hints.model_construct(workflow=wf.wire_id, agent=agent, step=step, ste=ste, next=nxt,
                                  app=self.app_id, fixed_messages=None, event=None)
        if len(wf.hints_cache) > 256:
            wf.hints_cache.clear()
        wf.hints_cache[(agent, step)] = (wf.version, h)
        return h

    def hints_for_config(self, config: dict) -> Optional[Hints]:
        """Hints for an LLM request sent from a node running with ``config``."""
        md = config.get("metadata") or {}
        ns = md.get("langgraph_checkpoint_ns")
        if not ns:
            node = md.get("langgraph_node")
            if node is None:
                return None
            ns = str(node)
        cb = config.get("callbacks")
        wid = self._workflow_id(md.get("thread_id"), getattr(cb, "parent_run_id", None))
        if wid is None:
            return None
        wf = self._workflow(wid, create=False)
        if wf is None:
            return None
        with wf.lock:
            name, kind, owner_ns = self._resolve(ns, wf.root_ns)
            if name is None or kind == 1:
                return None
            step = wf.task_step.get(owner_ns, wf.step)
            return self._hints(wf, name, step)


class _Handler(_HandlerBase):  # type: ignore[misc, valid-type]
    """LangChain callbacks of one instrumented graph (``run_inline``: cheap, synchronous)."""

    run_inline = True
    raise_error = False
    # Only chain events matter: LangChain then skips this handler for everything else
    # (no per-token, per-LLM-call or retriever dispatch).
    ignore_llm = True
    ignore_chat_model = True
    ignore_retriever = True
    ignore_agent = True
    ignore_retry = True
    ignore_custom_event = True

    def __init__(self, inst: LangGraphInstrumentation) -> None:
        super().__init__()
        self.inst = inst

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID,
                       parent_run_id: Optional[UUID] = None, tags: Optional[list[str]] = None,
                       metadata: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        try:
            self.inst._on_chain_start(run_id, parent_run_id, tags, metadata, kwargs.get("name"))
        except Exception:  # noqa: BLE001 — never disturb the run
            log.debug("kvflow: on_chain_start failed", exc_info=True)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self.inst._on_chain_end(run_id, None)
        except Exception:  # noqa: BLE001
            log.debug("kvflow: on_chain_end failed", exc_info=True)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            self.inst._on_chain_end(run_id, error)
        except Exception:  # noqa: BLE001
            log.debug("kvflow: on_chain_error failed", exc_info=True)

    def on_interrupt(self, event: Any) -> None:
        try:
            self.inst._on_interrupt(getattr(event, "run_id", None))
        except Exception:  # noqa: BLE001
            log.debug("kvflow: on_interrupt failed", exc_info=True)

    def __deepcopy__(self, memo: dict) -> "_Handler":  # configs get deep-copied: keep identity
        return self

    def __copy__(self) -> "_Handler":
        return self


# ---------------------------------------------------------------------- process-wide hooks
_PATCHED = False
_patch_lock = threading.Lock()


def _loop_instrumentation(loop: Any) -> Optional[LangGraphInstrumentation]:
    manager = getattr(loop, "manager", None)
    if manager is None:
        return _find_instrumentation((getattr(loop, "config", None) or {}).get("callbacks"))
    return _find_instrumentation(manager)


def _patch_pregel_loop() -> bool:
    """Wrap ``PregelLoop.tick`` / ``after_tick`` (once per process) so instrumented graphs see
    each super-step's whole frontier. ``False`` when this LangGraph has no such methods: the
    adapter then tracks node runs from callbacks alone (parallel siblings may see each other
    late)."""
    global _PATCHED
    with _patch_lock:
        if _PATCHED:
            return True
        try:
            from langgraph.pregel._loop import PregelLoop
        except Exception:  # noqa: BLE001
            return False
        tick = getattr(PregelLoop, "tick", None)
        after_tick = getattr(PregelLoop, "after_tick", None)
        if tick is None or after_tick is None:
            return False
        if getattr(tick, "_kvflow_original", None) is not None:
            _PATCHED = True
            return True

        def kvflow_tick(self: Any) -> bool:
            try:
                more = tick(self)
            except GraphInterrupt:  # interrupt_before
                inst = _loop_instrumentation(self)
                if inst is not None:
                    _safe(inst._on_interrupt_loop, self)
                raise
            inst = _loop_instrumentation(self)
            if inst is not None:
                _safe(inst._on_tick if more else inst._on_loop_exit, self)
            return more

        def kvflow_after_tick(self: Any) -> None:
            inst = _loop_instrumentation(self)
            if inst is not None:
                _safe(inst._on_after_tick, self)
            try:
                return after_tick(self)
            except GraphInterrupt:  # interrupt_after
                if inst is not None:
                    _safe(inst._on_interrupt_loop, self)
                raise

        kvflow_tick._kvflow_original = tick  # type: ignore[attr-defined]
        kvflow_after_tick._kvflow_original = after_tick  # type: ignore[attr-defined]
        PregelLoop.tick = kvflow_tick  # type: ignore[method-assign]
        PregelLoop.after_tick = kvflow_after_tick  # type: ignore[method-assign]
        _PATCHED = True
        return True


def _unpatch_pregel_loop() -> None:
    """Undo :func:`_patch_pregel_loop` (tests of the callback-only fallback)."""
    global _PATCHED
    with _patch_lock:
        try:
            from langgraph.pregel._loop import PregelLoop
        except Exception:  # noqa: BLE001
            return
        for name in ("tick", "after_tick"):
            original = getattr(getattr(PregelLoop, name), "_kvflow_original", None)
            if original is not None:
                setattr(PregelLoop, name, original)
        _PATCHED = False


def _safe(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 — tracking must never fail the user's run
        log.debug("kvflow: LangGraph step tracking failed", exc_info=True)


def _interrupt_loop(self: LangGraphInstrumentation, loop: Any) -> None:
    conf = (loop.config or {}).get("configurable") or {}
    wid = self._workflow_id(conf.get("thread_id"), getattr(getattr(loop, "manager", None), "run_id", None))
    wf = self._workflow(wid, create=False) if wid is not None else None
    if wf is not None:
        with wf.lock:
            wf.interrupted = True


LangGraphInstrumentation._on_interrupt_loop = _interrupt_loop  # type: ignore[attr-defined]


def _langgraph_hints() -> Optional[Hints]:
    """The hint provider: the node running in this context, if it belongs to an instrumented
    graph."""
    config = var_child_runnable_config.get()
    if not config:
        return None
    md = config.get("metadata")
    if not md or "langgraph_node" not in md:
        return None
    inst = _find_instrumentation(config.get("callbacks"))
    if inst is None:
        return None
    return inst.hints_for_config(config)


# ---------------------------------------------------------------------- public
def _default_app_id(compiled: Any, graph: AgentStepGraph) -> str:
    name = getattr(compiled, "name", None)
    if isinstance(name, str) and name and name != DEFAULT_GRAPH_NAME:
        return name
    digest = hashlib.sha1(graph.to_json().encode()).hexdigest()[:10]
    return f"langgraph-{digest}"


def instrument(graph: Any, *, app_id: Optional[str] = None, hints_url: Optional[str] = None,
               tool_nodes: Iterable[str] = (), warn: bool = True, model: Optional[TransitionModel] = None,
               learn: bool = True, transitions: Any = None, recorder: Optional[TraceRecorder] = None,
               next_run: bool = False, **compile_kwargs: Any) -> Any:
    """Instrument a LangGraph ``StateGraph`` (compiled here with ``compile_kwargs``) or a
    compiled ``StateGraph``. Returns a compiled graph with ``.kvflow_graph`` (the Agent Step
    Graph) and ``.kvflow`` (:class:`LangGraphInstrumentation`).

    ``app_id``: sent as ``kvflow_app`` (default: the graph's ``name``, else a hash of its
    structure). ``hints_url``: the server for out-of-band hints (default: where the LLM
    requests go). ``tool_nodes``: node names (``"sub/inner"`` for subgraph nodes) that send no
    LLM request, besides those marked ``metadata={"kvflow": {"llm": False}}`` and prebuilt
    ``ToolNode``\\ s. ``warn=False`` silences :class:`KVFlowGraphWarning`.
    ``model`` / ``learn`` / ``transitions`` / ``recorder``: learned transitions (module doc).
    ``next_run=True``: the app is invoked again after a run ends (a stream of questions, the
    next chat turn), so hints give its entry agents the STE of the next run's first step
    (:meth:`AgentStepGraph.next_run_ste`) and the server can bring their prefix back while the
    current run's last agent runs.
    """
    existing = getattr(graph, "kvflow", None)
    if isinstance(existing, LangGraphInstrumentation):
        if compile_kwargs:
            raise TypeError("kvflow.instrument(): this graph is already instrumented and compiled")
        return graph
    if isinstance(graph, StateGraph):
        compiled = graph.compile(**compile_kwargs)
    elif isinstance(graph, CompiledStateGraph):
        if compile_kwargs:
            raise TypeError(f"kvflow.instrument(): compile options {sorted(compile_kwargs)} need a "
                            "StateGraph; this graph is already compiled")
        compiled = graph
    elif type(graph).__name__ == "Pregel" or getattr(graph, "builder", None) is None and hasattr(graph, "stream_mode"):
        raise TypeError("kvflow.instrument(): this LangGraph object has no StateGraph builder (the "
                        "functional API @entrypoint is not supported yet); pass a StateGraph or a "
                        "compiled StateGraph, or attach hints with `with kvflow.hints(...)`")
    else:
        raise TypeError(f"kvflow.instrument(): expected a LangGraph StateGraph or compiled "
                        f"StateGraph, got {type(graph).__module__}.{type(graph).__qualname__}")
    info = build_asg(compiled, app_id or getattr(compiled, "name", None) or "workflow",
                     tool_nodes=tool_nodes, warn=warn)
    model = model if model is not None else default_model()
    if transitions is not None:
        model.bind_file(transitions)
    inst = LangGraphInstrumentation(info, app_id or _default_app_id(compiled, info.graph), hints_url,
                                    model=model, learn=learn, recorder=recorder, next_run=next_run)
    out = compiled.with_config(callbacks=[inst.handler])
    out.kvflow_graph = info.graph
    out.kvflow = inst
    autopatch.enable()
    _patch_pregel_loop()
    register_hint_provider(_langgraph_hints)
    return out
