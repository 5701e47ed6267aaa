"""AutoGen agentchat adapter: ``kvflow.instrument(team)``.

    import kvflow_agents as kvflow
    team = kvflow.instrument(GraphFlow(...))        # or RoundRobinGroupChat / SelectorGroupChat /
    await team.run(task="...")                      # Swarm / a DiGraphBuilder

Structure
    :func:`~kvflow_agents.adapters.autogen_compile.compile_team` turns the team (nested teams
    included, with ``team/agent`` names) into an :class:`AgentStepGraph`.

Transitions
    The team's agent runtime is instrumented by wrapping its ``publish_message`` (one wrapper per
    runtime; teams sharing a runtime are told apart by the team id in the topic type). That is
    where the group chat manager asks agents to speak and where their answers come back, in
    the publisher's own task, before anything is delivered:

    * ``GroupChatStart`` on the team's group topic — a run begins;
    * ``GroupChatRequestPublish`` on topic ``"<agent>_<team_id>"`` — ``agent`` starts. The
      manager asks every speaker of a turn before any of them runs, so the agents of one
      GraphFlow turn share a step (as LangGraph's super-step);
    * ``GroupChatAgentResponse`` / ``GroupChatTeamResponse`` on the group topic — it finished;
    * ``GroupChatTermination`` on the output topic — the run is over (an out-of-band ``end``
      hint releases the workflow on the server).

    Transitions feed a :class:`~kvflow_agents.graph.learned.LearnedTracker`, which also counts
    the run-time choices (selector picks, hand-offs, edge conditions) per app.

Hints: who is asking
    AutoGen runs each agent's message handler under ``MessageHandlerContext``, whose
    ``agent_id()`` is ``AgentId(type=f"{agent}_{team_id}")`` while a participant handles a
    message (the group chat manager's own id while a selector chooses). A hint provider
    registered with :func:`kvflow_agents.register_hint_provider` reads it on every LLM request,
    so one shared ``OpenAIChatCompletionClient`` serves every agent, and a client created the
    ordinary way (``base_url=``) carries hints through :mod:`kvflow_agents.autopatch`.

    * ``kvflow_workflow``: the root team's ``_team_id`` (a uuid per team object; a team's runs
      continue one conversation, so they share the workflow; each run starts from ``START``
      and ends with an ``end`` hint);
    * ``kvflow_app``: the app name (``app_id=``, default the root team's name); learned
      transition counts are kept per app;
    * ``kvflow_ste``: the *expected* STE from learned transition probabilities, rounded,
      never below the exact STE, null where the exact STE is infinite
      (:mod:`kvflow_agents.graph.learned`); equal to the exact STE where nothing is chosen at
      run time (RoundRobin, unconditional GraphFlow edges);
    * ``kvflow_next``: the agents with the smallest STE > 0;
    * ``kvflow_fixed_messages``: the leading system messages (the client's default) for
      participants; ``0`` for the selector, whose one system message embeds the conversation.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Optional

from kvflow_agents.context import register_hint_provider
from kvflow_agents.graph import INF, START, AgentStepGraph, next_agents
from kvflow_agents.graph import learned as _learned
from kvflow_agents.graph.learned import (
    LearnedTracker,
    TraceRecorder,
    TransitionModel,
    ste_between_steps,
    wire_ste,
)
from kvflow_agents.protocol import Hints

from .autogen_compile import TeamSpec, compile_digraph, compile_team, is_team, team_kind

log = logging.getLogger("kvflow_agents")

__all__ = ["instrument", "AutoGenInstrumentation", "instrumentation", "compile_team",
           "compile_digraph", "default_model", "current_agent"]

_OWN_KWARGS = ("app_id", "model", "learn", "recorder", "hints_url", "autopatch", "next_run")

def default_model() -> TransitionModel:
    """The transition model instrumentations share unless given ``model=`` (one per process,
    shared with the LangGraph adapter; persisted in ``$KVFLOW_TRANSITIONS`` when set)."""
    return _learned.default_model()


class _Scope:
    """One team (root or nested) of one instrumentation; looked up by team id."""

    def __init__(self, inst: "AutoGenInstrumentation", spec: TeamSpec) -> None:
        self.inst = inst
        self.spec = spec


_scopes: "weakref.WeakValueDictionary[str, _Scope]" = weakref.WeakValueDictionary()
_scopes_lock = threading.Lock()


def current_agent() -> tuple[Optional[str], Optional[str]]:
    """``(agent, team_id)`` of the AutoGen message handler running now, or ``(None, None)``."""
    try:
        from autogen_core import MessageHandlerContext

        agent_type = MessageHandlerContext.agent_id().type
    except (RuntimeError, ImportError, LookupError):
        return None, None
    name, sep, team_id = agent_type.rpartition("_")
    if not sep:
        return None, None
    return name, team_id


class AutoGenInstrumentation:
    """The kvflow state of one instrumented AutoGen team (and its nested teams)."""

    def __init__(self, team: Any, *, app_id: Optional[str] = None, model: Optional[TransitionModel] = None,
                 learn: bool = True, recorder: Optional[TraceRecorder] = None,
                 hints_url: Optional[str] = None, next_run: bool = False) -> None:
        self.team = team
        self.next_run = next_run  # hints name the next run's entry agents (AgentStepGraph.next_run_ste)
        self.graph, self.spec = compile_team(team, name=app_id)
        self.app = app_id or self.graph.name
        self.model = model if model is not None else default_model()
        self.recorder = recorder
        self.tracker = LearnedTracker(self.graph, self.model, app=self.app, workflow_id=self.workflow_id,
                                      learn=learn, recorder=recorder)
        self._lock = threading.RLock()
        self._run_active = False
        self.sent: list[Hints] = []  # the last hints handed out (bounded), for debugging
        from kvflow_agents.oob import HintReporter

        self.reporter = HintReporter(hints_url)
        self._specs = self.spec.all_specs()
        self._routers = [s for s in self._specs if s.router]
        self._scopes = [_Scope(self, s) for s in self._specs]
        with _scopes_lock:
            for sc in self._scopes:
                _scopes[sc.spec.team_id] = sc
        for s in self._specs:
            _patch_runtime(s.team._runtime)

    @property
    def workflow_id(self) -> str:
        return str(self.team._team_id)

    # ------------------------------------------------------------------ transitions
    def _on_publish(self, spec: TeamSpec, local: str, message: Any) -> None:
        kind = type(message).__name__
        with self._lock:
            if kind == "GroupChatStart":
                if local == "group_topic" and spec is self.spec:
                    if not self.tracker.ended and self.tracker.running:
                        self.tracker.end()  # a stale run (reset without termination)
                    self._run_active = True
            elif kind == "GroupChatRequestPublish":
                if local in spec.children:
                    return  # a nested team starts: its own agents will be asked
                full = spec.participants.get(local)
                if full is None:
                    return
                self._run_active = True
                self.tracker.start(full)
                if not self.graph.is_llm(full):
                    self._report(full, "transition")
            elif kind in ("GroupChatAgentResponse", "GroupChatTeamResponse"):
                if local != "group_topic":
                    return
                name = getattr(message, "name", None)
                if name in spec.children:
                    return  # its agents finished one by one
                full = spec.participants.get(name) if isinstance(name, str) else None
                if full is not None and full in self.tracker.running:
                    self.tracker.finish(full)
            elif kind == "GroupChatTermination":
                if local == "output_topic" and spec is self.spec:
                    last = self.tracker.steps[-1][-1] if self.tracker.steps else self.app
                    self.tracker.end()
                    if self.tracker.learn:
                        self.model.flush()  # persisted when bound to a file
                    self._run_active = False
                    self._report(last, "end")

    def _report(self, agent: str, event: str) -> None:
        try:
            h = self._hints(agent)
            if event == "end":
                h = h.model_copy(update={"ste": {a: INF for a in h.ste}, "next": []})
            self.reporter.report(h, event)
        except Exception:  # noqa: BLE001 — advisory
            log.debug("kvflow: out-of-band report failed", exc_info=True)

    # ------------------------------------------------------------------ STE
    def ste(self, agent: Optional[str] = None) -> tuple[dict[str, float], dict[str, float]]:
        """``(exact, wire)`` STE maps as seen by ``agent`` (a selector sees itself at 0)."""
        with self._lock:
            tr = self.tracker
            running = tr.running
            started = bool(tr.steps) and not tr.ended
            if not self._run_active and not started:
                exact = {a: INF for a in self.graph.agents}
                wire = dict(exact)
            elif not started:  # the run began, nobody has spoken yet
                exact = self.graph.steps_to_execution({START}, validate=False)
                wire = self.model.wire_ste(self.graph, {START}, app=self.app, exact=exact)
            elif running:
                exact, wire = tr.ste(), tr.wire_ste()
            else:  # between two steps: a selector is choosing
                exact, expected = ste_between_steps(self.graph, self.model, tr.steps[-1], tr.arrived,
                                                    app=self.app, after=tr.step_contexts())
                wire = wire_ste(exact, expected)
            active = self._run_active or started
            for s in self._routers:
                r = s.router
                if r == agent:
                    v = 0.0
                elif not active:
                    v = INF
                else:
                    members = s.members()
                    if any(m in running for m in members):
                        v = 1.0
                    else:
                        m = min((wire.get(x, INF) for x in members), default=INF)
                        v = INF if m == INF else max(1.0, m - 1)
                exact[r] = wire[r] = v
            return exact, wire

    def _hints(self, agent: str) -> Hints:
        _exact, wire = self.ste(agent)
        if self.next_run:
            wire = self.graph.next_run_ste(wire)
        router = any(s.router == agent for s in self._routers)
        return Hints(workflow=self.workflow_id, agent=agent, step=self.tracker.step, ste=wire,
                     next=next_agents(wire), app=self.app, fixed_messages=0 if router else None)

    def hints_for(self, spec: TeamSpec, local: str) -> Optional[Hints]:
        if local == spec.manager_name and spec.router:
            agent = spec.router
        else:
            agent = spec.participants.get(local)
            if agent is None or local in spec.children:
                return None
        h = self._hints(agent)
        self.sent.append(h)
        if len(self.sent) > 1024:
            del self.sent[:512]
        return h

    def __repr__(self) -> str:
        return (f"AutoGenInstrumentation(app={self.app!r}, workflow={self.workflow_id!r}, "
                f"agents={self.graph.agents})")


# ---------------------------------------------------------------------------- runtime hook
def _route(message: Any, topic_id: Any) -> None:
    topic = getattr(topic_id, "type", None)
    if not isinstance(topic, str):
        return
    local, sep, team_id = topic.rpartition("_")
    if not sep:
        return
    scope = _scopes.get(team_id)
    if scope is not None:
        scope.inst._on_publish(scope.spec, local, message)


def _patch_runtime(runtime: Any) -> None:
    if runtime is None or getattr(runtime, "_kvflow_patched", False):
        return
    original = runtime.publish_message

    async def publish_message(message: Any, topic_id: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _route(message, topic_id)
        except Exception:  # noqa: BLE001 — tracking is advisory; never break the team
            log.debug("kvflow: could not track an AutoGen transition", exc_info=True)
        return await original(message, topic_id, *args, **kwargs)

    publish_message.__wrapped__ = original  # type: ignore[attr-defined]
    runtime.publish_message = publish_message
    runtime._kvflow_patched = True


def _provider() -> Optional[Hints]:
    local, team_id = current_agent()
    if team_id is None:
        return None
    scope = _scopes.get(team_id)
    if scope is None:
        return None
    return scope.inst.hints_for(scope.spec, local)


# ---------------------------------------------------------------------------- entry point
def instrumentation(team: Any) -> Optional[AutoGenInstrumentation]:
    """The instrumentation of ``team`` (``None`` if it was not instrumented)."""
    inst = getattr(team, "kvflow", None)
    return inst if isinstance(inst, AutoGenInstrumentation) else None


def instrument(app: Any, **kwargs: Any) -> Any:
    """Instrument an AutoGen team in place and return it (with ``.kvflow``, the
    :class:`AutoGenInstrumentation`, and ``.kvflow_graph``, its Agent Step Graph).

    ``app``: a ``GraphFlow``, ``RoundRobinGroupChat``, ``SelectorGroupChat``, ``Swarm`` (or any
    ``BaseGroupChat``), or a ``DiGraphBuilder`` — then a ``GraphFlow`` is built from it (other
    keyword arguments go to ``GraphFlow``) and returned instrumented.

    Keywords: ``app_id=`` the app name sent as ``kvflow_app`` (learned transitions are per app; default the team's
    name), ``model=`` a :class:`TransitionModel` (default one shared process-wide),
    ``learn=False`` to freeze it, ``recorder=`` a :class:`TraceRecorder` for the runs,
    ``next_run=True`` when the team is run again after a run ends (hints then give its entry
    agents the next run's STE, :meth:`~kvflow_agents.graph.AgentStepGraph.next_run_ste`),
    ``hints_url=`` where out-of-band hints go (default: the server the LLM requests use),
    ``autopatch=False`` to leave the ``openai`` SDK alone (then pass
    ``http_client=kvflow.async_http_client()`` to the model client).
    """
    own = {k: kwargs.pop(k) for k in list(kwargs) if k in _OWN_KWARGS}
    if "DiGraphBuilder" in [c.__name__ for c in type(app).__mro__]:
        from autogen_agentchat.teams import GraphFlow

        app = GraphFlow(participants=app.get_participants(), graph=app.build(), **kwargs)
    elif kwargs:
        raise TypeError(f"unexpected keyword arguments for kvflow.instrument(team): {sorted(kwargs)}")
    if not is_team(app) or team_kind(app) is None:
        raise TypeError(f"kvflow.instrument() cannot instrument {type(app).__qualname__}: pass an AutoGen "
                        "team (GraphFlow, RoundRobinGroupChat, SelectorGroupChat, Swarm) or a DiGraphBuilder")
    existing = instrumentation(app)
    if existing is not None:
        return app
    if own.pop("autopatch", True):
        from kvflow_agents import autopatch

        autopatch.enable()
    inst = AutoGenInstrumentation(app, **own)
    app.kvflow = inst                # as the LangGraph adapter: .kvflow and .kvflow_graph
    app.kvflow_graph = inst.graph
    register_hint_provider(_provider)
    return app


def graph_of(team: Any) -> AgentStepGraph:
    """The Agent Step Graph of a team (instrumented or not)."""
    inst = instrumentation(team)
    return inst.graph if inst is not None else compile_team(team)[0]
