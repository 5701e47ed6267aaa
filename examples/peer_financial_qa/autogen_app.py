"""The PEER financial-QA workflow as an AutoGen ``GraphFlow`` (autogen-agentchat 0.7).

Same fixed prompts (``prompts.py``), data (``data.py``) and parsers (``app.py``) as the LangGraph
version; only the orchestration differs::

    planner ──▶ executor_1 ─┐
       │    ──▶ executor_2 ─┼─(all)─▶ expresser ──▶ reviewer ──PASS / rounds used──▶ final
       │    ──▶ executor_k ─┘            ▲             │
       ▲                                 └─ FAIL ──────┤        (jump="expressing", default)
       └──────────────── FAIL ─────────────────────────┘        (jump="planning")

* **Fixed fan-out.** GraphFlow nodes are fixed, so the fan-out is ``k`` executor agents
  (``executor_1..executor_k``; k = 3 by default, 3-5 allowed). ``executor_i`` answers
  sub-question *i* of the planner's plan: the plan is parsed with :func:`app.parse_plan`
  bounded to exactly ``k`` items (extra items are dropped; a short plan is padded with the
  category's default sub-questions, then with the other categories' defaults when ``k`` > 3).
  All ``k`` executors are activated by the planner's one message, so they run in the same
  GraphFlow turn (in parallel), like LangGraph's ``Send`` super-step.
* **Barrier.** ``executor_i → expresser`` edges share one activation group (``"findings"``,
  ``activation_condition="all"``): the expresser runs once, after every executor.
* **Review loop.** ``reviewer → expresser`` (default) or ``reviewer → planner``
  (``jump="planning"``) and ``reviewer → final`` are callable conditions on the reviewer's
  message: retry on FAIL/UNKNOWN while fewer than ``max_rounds`` reviews were done, else exit
  to ``final``. The retry edge into the expresser has its own activation group (``"retry"``,
  ``"any"``), so it does not wait for the executors again. ``final`` is a small non-LLM agent
  (GraphFlow needs a leaf): it emits the last draft.

Request layout. Every agent is a stock ``AssistantAgent`` with ``system_message=`` its fixed
prompt and one shared ``OpenAIChatCompletionClient``. In a GraphFlow every agent *receives the
whole shared thread* (the task and every other agent's message). To send exactly what the
LangGraph version sends — ``[system: <fixed prompt>, user: <per-call variables>]`` — each agent
gets a :class:`PeerModelContext` (AutoGen's ``model_context=`` extension point): it still
receives the thread, folds it into the PEER state (:func:`fold_thread`) and renders the same
per-call user message with the ``prompts.*_user`` builders. The thread stays AutoGen's; only
what each agent sends to the model is shaped. The task message is a JSON document with the
question's id, category, text and background snippets (:func:`task_message`); a plain-text task
is taken as the question itself (category ``macro``, no snippets).

Usage: ``build_team(client, jump=..., max_rounds=..., executors=3)`` returns an uninstrumented
``GraphFlow`` (``kvflow.instrument(team, app_id=...)`` it), and ``await run_question(team, q)``
runs one question. :class:`AutoGenPeer` is a synchronous façade (a client and a team per
question, per-call usage) used by ``run.py --framework autogen``; :class:`AutoGenPeerApp` has the
shape of ``kvflow_agents.bench.peer.PeerApp`` for ``kvflow bench peer --framework autogen``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Iterable, Optional, Sequence

from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
from autogen_agentchat.base import Response
from autogen_agentchat.messages import BaseAgentEvent, BaseChatMessage, TextMessage
from autogen_agentchat.teams import DiGraphBuilder, GraphFlow
from autogen_core import CancellationToken
from autogen_core.model_context import ChatCompletionContext
from autogen_core.models import LLMMessage, ModelInfo, UserMessage

from kvflow_agents.bench.peer import PeerApp

from . import prompts
from .app import DEFAULT_SUB_QUESTIONS, default_sub_questions, parse_plan, parse_review
from .corpus import default_corpus, format_results

__all__ = ["build_team", "run_question", "make_client", "instrument_team", "task_message", "parse_task",
           "fold_thread", "plan_for_executors", "executor_names", "PeerThread", "PeerModelContext",
           "FinalAgent", "CallLog", "AutoGenPeer", "AutoGenPeerApp", "run_peer_autogen",
           "MODEL_INFO", "APP_ID", "EXECUTORS"]

APP_ID = "peer-autogen"
EXECUTORS = (3, 5)            # allowed fixed fan-out (min, max)
DEFAULT_EXECUTORS = 3
RETRY_GROUP = "retry"         # activation group of the review-loop edge into the expresser
FINDINGS_GROUP = "findings"   # activation group of the executors' edges into the expresser

# Non-OpenAI model names need model_info; no tools, plain text output. multiple_system_messages=True:
# otherwise OpenAIChatCompletionClient "merges" the system messages and rstrip()s the result, so the
# fixed prompt would lose its trailing newline and no longer be byte-identical to the LangGraph one.
MODEL_INFO = ModelInfo(vision=False, function_calling=False, json_output=False, family="unknown",
                       structured_output=False, multiple_system_messages=True)

_EXECUTOR = re.compile(r"^executor_(\d+)$")


def executor_names(k: int) -> list[str]:
    return [f"executor_{i}" for i in range(1, k + 1)]


def role_of(agent: Optional[str]) -> str:
    """``executor_3`` -> ``executor``; other names unchanged (``None`` -> ``"?"``)."""
    if not agent:
        return "?"
    return "executor" if _EXECUTOR.match(agent) else agent


# -- the task message ------------------------------------------------------------------------------

def _field(q: Any, key: str) -> Any:
    return q[key] if isinstance(q, dict) else getattr(q, key)


def task_message(q: Any) -> str:
    """The GraphFlow task for one question (a :class:`data.Question` or a dict with its fields):
    a JSON document every agent's model context reads the question from."""
    return json.dumps({"peer_question": {"id": _field(q, "id"), "category": _field(q, "category"),
                                         "question": _field(q, "question"),
                                         "background": list(_field(q, "background"))}},
                      ensure_ascii=False)


def parse_task(text: str) -> Optional[dict[str, Any]]:
    """The question dict of a :func:`task_message`, or ``None``."""
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        return None
    q = doc.get("peer_question") if isinstance(doc, dict) else None
    if not isinstance(q, dict) or not isinstance(q.get("question"), str):
        return None
    return {"id": str(q.get("id") or ""), "category": str(q.get("category") or "macro"),
            "question": q["question"], "background": [str(s) for s in q.get("background") or []]}


# -- the PEER state, folded from the shared thread -------------------------------------------------

def plan_for_executors(text: str, category: str, question: str, k: int) -> tuple[list[str], str]:
    """Exactly ``k`` sub-questions: :func:`app.parse_plan` bounded to ``(k, k)`` (extra items are
    dropped, a short plan is padded with the category's defaults), then — only when ``k`` exceeds
    the 3 category defaults — padded with the other categories' defaults."""
    subs, source = parse_plan(text, category, question, (k, k))
    if len(subs) < k:
        seen = {s.lower() for s in subs}
        for cat in DEFAULT_SUB_QUESTIONS:
            for d in default_sub_questions(cat, question):
                if len(subs) < k and d.lower() not in seen:
                    subs.append(d)
                    seen.add(d.lower())
        if "default" not in source:
            source += "+default"
    return subs, source


@dataclass
class PeerThread:
    """The PEER state of one run, as :func:`fold_thread` reads it from the shared thread."""

    qid: str = ""
    category: str = "macro"
    question: str = ""
    background: list[str] = field(default_factory=list)
    plans: int = 0                                   # planner messages
    sub_questions: list[str] = field(default_factory=list)
    plan_source: str = ""
    findings: dict[int, str] = field(default_factory=dict)   # executor index (0-based) -> text
    draft: str = ""
    drafts: int = 0
    review: str = ""
    verdicts: list[str] = field(default_factory=list)
    rounds: int = 0

    def ordered_findings(self) -> list[str]:
        return [self.findings[i] or "(no findings)" for i in sorted(self.findings)]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(getattr(p, "text", "") or "") for p in content)
    return str(content or "")


def fold_thread(messages: Iterable[tuple[str, str]], executors: int = DEFAULT_EXECUTORS) -> PeerThread:
    """Fold ``(source, text)`` messages of a GraphFlow thread into the PEER state. A new task
    (source ``user``) starts a new state; a plan resets the findings (as the LangGraph app's
    ``RESET``); each review adds a verdict and a round."""
    st = PeerThread()
    for source, raw in messages:
        text = (raw or "").strip()
        if source == "user":
            task = parse_task(text)
            if task is None and text:
                task = {"id": "", "category": "macro", "question": text, "background": []}
            if task is not None:
                st = PeerThread(qid=task["id"], category=task["category"], question=task["question"],
                                background=task["background"])
        elif source == "planner":
            st.plans += 1
            st.sub_questions, st.plan_source = plan_for_executors(text, st.category, st.question, executors)
            st.findings = {}
        elif (m := _EXECUTOR.match(source)) is not None:
            st.findings[int(m.group(1)) - 1] = text
        elif source == "expresser":
            st.draft = text
            st.drafts += 1
        elif source == "reviewer":
            st.review = text
            st.verdicts.append(parse_review(text).verdict)
            st.rounds += 1
    return st


SEARCH_K = 3


def executor_message(sub_question: str, question: str) -> str:
    """The executor's per-call message: its task plus the search result for it. The AutoGen
    executors search in their model context (BM25 on the sub-question, the same corpus as the
    LangGraph version's ``search_corpus`` tool), so each request keeps the ``[system, user]``
    layout."""
    results = format_results(default_corpus().search(sub_question, SEARCH_K))
    return prompts.executor_user(sub_question, question) + "\n\nsearch_corpus results:\n" + results


class PeerModelContext(ChatCompletionContext):
    """The model context of one PEER agent: it stores the shared thread the agent receives (as
    AutoGen's unbounded context does) but hands the model one user message — the same per-call
    message the LangGraph version builds — after the agent's fixed system message."""

    def __init__(self, role: str, *, index: Optional[int] = None, executors: int = DEFAULT_EXECUTORS) -> None:
        super().__init__()
        if role not in ("planner", "executor", "expresser", "reviewer"):
            raise ValueError(f"unknown PEER role {role!r}")
        if role == "executor" and (index is None or not 0 <= index < executors):
            raise ValueError(f"executor index must be in 0..{executors - 1}, not {index!r}")
        self.role = role
        self.index = index
        self.executors = executors

    def thread(self) -> PeerThread:
        return fold_thread(((str(getattr(m, "source", "") or ""), _text(getattr(m, "content", "")))
                            for m in self._messages), self.executors)

    def render(self) -> str:
        """The per-call user message (``prompts.*_user``), as the LangGraph app builds it."""
        st = self.thread()
        if self.role == "planner":
            user = prompts.planner_user(st.question, st.category)
            if st.plans and st.review:  # re-planning after a failed review
                user += "\n\nA previous answer was rejected. Review notes:\n" + st.review
            return user
        if self.role == "executor":
            assert self.index is not None
            subs = st.sub_questions or plan_for_executors("", st.category, st.question, self.executors)[0]
            sub = subs[self.index]
            return executor_message(sub, st.question)
        if self.role == "expresser":
            revise = bool(st.verdicts) and st.verdicts[-1] != "PASS"
            return prompts.expresser_user(st.question, st.ordered_findings(),
                                          previous_draft=st.draft if revise else None,
                                          review_notes=st.review if revise else None)
        return prompts.reviewer_user(st.question, st.ordered_findings(), st.draft)

    async def get_messages(self) -> list[LLMMessage]:
        return [UserMessage(content=self.render(), source="user")]


class FinalAgent(BaseChatAgent):
    """The leaf of the graph (no LLM): answers with the last draft."""

    def __init__(self, name: str = "final", executors: int = DEFAULT_EXECUTORS) -> None:
        super().__init__(name, description="Emits the expresser's last draft as the final answer.")
        self._executors = executors
        self._seen: list[tuple[str, str]] = []

    @property
    def produced_message_types(self) -> Sequence[type[BaseChatMessage]]:
        return (TextMessage,)

    async def on_messages(self, messages: Sequence[BaseChatMessage],
                          cancellation_token: CancellationToken) -> Response:
        self._seen += [(m.source, m.to_model_text()) for m in messages]
        st = fold_thread(self._seen, self._executors)
        return Response(chat_message=TextMessage(content=st.draft or "(no answer)", source=self.name))

    async def on_messages_stream(self, messages: Sequence[BaseChatMessage], cancellation_token: CancellationToken
                                 ) -> AsyncGenerator[BaseAgentEvent | BaseChatMessage | Response, None]:
        yield await self.on_messages(messages, cancellation_token)

    async def on_reset(self, cancellation_token: CancellationToken) -> None:
        self._seen = []


# -- the team ---------------------------------------------------------------------------------------

def final_verdict(st: PeerThread, max_rounds: int) -> str:
    """As the LangGraph reviewer node: ``PASS``, ``FAIL (rounds used up)``,
    ``PASS (assumed: no verdict)``, or ``""`` while the run is not finished."""
    if not st.verdicts:
        return ""
    if st.verdicts[-1] == "PASS":
        return "PASS"
    if st.rounds >= max_rounds:
        return "FAIL (rounds used up)" if st.verdicts[-1] == "FAIL" else "PASS (assumed: no verdict)"
    return ""


def check_options(*, jump: str, max_rounds: int, executors: int) -> None:
    if jump not in ("expressing", "planning"):
        raise ValueError(f"jump must be 'expressing' or 'planning', not {jump!r}")
    if max_rounds < 1:
        raise ValueError("max_rounds must be >= 1")
    lo, hi = EXECUTORS
    if not isinstance(executors, int) or not lo <= executors <= hi:
        raise ValueError(f"executors must be an int in {lo}..{hi}, not {executors!r}")


def build_team(client: Any, *, jump: str = "expressing", max_rounds: int = 2,
               executors: int = DEFAULT_EXECUTORS, name: str = "PeerGraphFlow") -> GraphFlow:
    """PEER as an (uninstrumented) ``GraphFlow``; pass it to ``kvflow.instrument(team, app_id=...)``.

    ``client``: a ``ChatCompletionClient`` (``make_client(...)``) shared by the four roles.
    ``jump``: where a failed review goes: ``"expressing"`` (default) or ``"planning"``.
    ``max_rounds``: the most reviews per question. ``executors``: the fixed fan-out ``k`` (3-5).
    """
    check_options(jump=jump, max_rounds=max_rounds, executors=executors)
    k = executors

    def assistant(agent_name: str, context: PeerModelContext) -> AssistantAgent:
        return AssistantAgent(agent_name, model_client=client, system_message=prompts.SYSTEM_PROMPTS[context.role],
                              model_context=context, description=f"PEER {context.role}")

    review_ctx = PeerModelContext("reviewer", executors=k)
    planner = assistant("planner", PeerModelContext("planner", executors=k))
    workers = [assistant(n, PeerModelContext("executor", index=i, executors=k))
               for i, n in enumerate(executor_names(k))]
    expresser = assistant("expresser", PeerModelContext("expresser", executors=k))
    reviewer = assistant("reviewer", review_ctx)
    final = FinalAgent("final", executors=k)

    def exit_review(msg: BaseChatMessage) -> bool:
        # The reviewer's own reply is in its context when the manager checks the edges.
        st = review_ctx.thread()
        verdict = parse_review(msg.to_model_text()).verdict
        return verdict == "PASS" or st.rounds >= max_rounds

    def retry(msg: BaseChatMessage) -> bool:
        return not exit_review(msg)

    b = DiGraphBuilder()
    for a in (planner, *workers, expresser, reviewer, final):
        b.add_node(a)
    for w in workers:
        b.add_edge(planner, w)
        b.add_edge(w, expresser, activation_group=FINDINGS_GROUP, activation_condition="all")
    b.add_edge(expresser, reviewer)
    if jump == "planning":
        b.add_edge(reviewer, planner, condition=retry)
    else:
        b.add_edge(reviewer, expresser, condition=retry, activation_group=RETRY_GROUP,
                   activation_condition="any")
    b.add_edge(reviewer, final, condition=exit_review)
    b.set_entry_point(planner)
    # A turn is one agent's reply: at most (1 + k + 2) per round with re-planning, + final.
    team = GraphFlow(participants=b.get_participants(), graph=b.build(), name=name,
                     max_turns=max_rounds * (k + 3) + 2)
    team.peer_options = {"jump": jump, "max_rounds": max_rounds, "executors": k}  # read by run_question
    return team


def instrument_team(team: GraphFlow, *, instrument: bool = True, app_id: str = APP_ID,
                    next_run: bool = False, **kwargs: Any) -> tuple[GraphFlow, bool]:
    """``kvflow.instrument(team, app_id=...)`` when the AutoGen adapter is installed and
    ``instrument`` is true. Returns ``(team, instrumented)``. ``next_run=True`` when questions
    come one after another: the hints name the next question's planner while the reviewer runs."""
    if not instrument:
        return team, False
    try:
        import kvflow_agents.adapters.autogen  # noqa: F401  — is the adapter there?
    except ImportError:
        return team, False
    import kvflow_agents as kvflow

    return kvflow.instrument(team, app_id=app_id, next_run=next_run, **kwargs), True


async def run_question(team: GraphFlow, question: Any) -> dict[str, Any]:
    """Run one question (a :class:`data.Question`, a dict with its fields, or a plain string) on
    a team from :func:`build_team`, from a fresh state (``team.reset()`` first).

    Returns ``answer``, ``verdicts``, ``rounds`` and ``final_verdict``, plus the fields the
    LangGraph result has (``sub_questions``, ``plan_source``, ``plans``, ``findings``,
    ``draft``, ``review``) and ``stop_reason``/``messages`` from AutoGen's ``TaskResult``."""
    opts = getattr(team, "peer_options", None) or {}
    k = int(opts.get("executors", DEFAULT_EXECUTORS))
    max_rounds = int(opts.get("max_rounds", 2))
    await team.reset()
    task = question if isinstance(question, str) else task_message(question)
    result = await team.run(task=task)
    chat = [m for m in result.messages if isinstance(m, BaseChatMessage)]
    st = fold_thread(((m.source, m.to_model_text()) for m in chat), k)
    findings = []
    for i, sq in enumerate(st.sub_questions):
        if i in st.findings:
            findings.append({"index": i, "sub_question": sq, "text": st.findings[i],
                             "sources": [p.id for p, _ in default_corpus().search(sq, SEARCH_K)]})
    return {"id": st.qid, "question": st.question, "category": st.category,
            "answer": st.draft, "draft": st.draft, "review": st.review,
            "verdicts": list(st.verdicts), "rounds": st.rounds,
            "final_verdict": final_verdict(st, max_rounds),
            "sub_questions": list(st.sub_questions), "plan_source": st.plan_source, "plans": st.plans,
            "findings": findings, "stop_reason": result.stop_reason,
            "messages": [(m.source, m.to_model_text()) for m in chat]}


# -- the model client and per-call usage ------------------------------------------------------------

class CallLog:
    """Per-call records from the HTTP client's event hooks: the agent (AutoGen's message-handler
    context), the wall time and the response's ``usage`` as the server sent it (including
    ``prompt_tokens_details.cached_tokens`` and ``usage.kvflow``, which AutoGen's ``CreateResult``
    drops)."""

    def __init__(self, on_call: Optional[Callable[[dict[str, Any]], Any]] = None) -> None:
        self.on_call = on_call
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def http_client(self, timeout: float = 600.0) -> Any:
        """An ``openai.DefaultAsyncHttpxClient`` (the SDK's own defaults) with the hooks."""
        import openai

        return openai.DefaultAsyncHttpxClient(timeout=timeout,
                                              event_hooks={"request": [self._on_request],
                                                           "response": [self._on_response]})

    @staticmethod
    def _is_llm(request: Any) -> bool:
        return request.method == "POST" and request.url.path.rstrip("/").endswith("/completions")

    async def _on_request(self, request: Any) -> None:
        if not self._is_llm(request):
            return
        from kvflow_agents.adapters.autogen import current_agent

        request.extensions["peer_call"] = (current_agent()[0] or "?", time.perf_counter())

    async def _on_response(self, response: Any) -> None:
        call = response.request.extensions.get("peer_call")
        if call is None:
            return
        agent, t0 = call
        usage, error = None, None
        try:
            await response.aread()
            if response.status_code == 200:
                doc = response.json()
                usage = doc.get("usage") if isinstance(doc, dict) else None
            else:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
        except Exception as e:  # noqa: BLE001 — accounting never fails the call
            error = f"{type(e).__name__}: {e}"
        rec = {"agent": agent, "start": t0, "latency_s": time.perf_counter() - t0,
               "usage": usage if isinstance(usage, dict) else None, "error": error,
               "hints": response.headers.get("x-kvflow-hints")}
        with self._lock:
            self.records.append(rec)
        if self.on_call is not None:
            self.on_call(rec)

    def snapshot(self, *, by_role: bool = True) -> dict[str, Any]:
        """``{agent: usage.AgentUsage}`` (executors merged into ``executor`` when ``by_role``),
        for ``run.py``'s usage tables."""
        from .usage import AgentUsage, _flatten, _int

        out: dict[str, AgentUsage] = {}
        with self._lock:
            recs = list(self.records)
        for r in recs:
            if r["error"]:
                continue
            u = r["usage"] or {}
            a = out.setdefault(role_of(r["agent"]) if by_role else r["agent"], AgentUsage())
            det = u.get("prompt_tokens_details") or {}
            cached = _int(det.get("cached_tokens") if isinstance(det, dict) else 0)
            a.calls += 1
            a.prompt_tokens += _int(u.get("prompt_tokens"))
            a.completion_tokens += _int(u.get("completion_tokens"))
            a.cached_tokens += cached
            a.calls_with_hit += int(cached > 0)
            a.seconds += r["latency_s"]
            for key, v in _flatten(u.get("kvflow")).items():
                a.kvflow[key] = a.kvflow.get(key, 0.0) + v
        return out


def make_client(*, base_url: str, model: str, api_key: str = "kvflow", max_tokens: int = 256,
                temperature: float = 0.0, seed: Optional[int] = None, http_client: Any = None,
                timeout: float = 600.0, model_info: Optional[ModelInfo] = None) -> Any:
    """One ``OpenAIChatCompletionClient`` created the ordinary way (``base_url=``), shared by all
    agents; kvflow's autopatch attaches the hints. ``include_name_in_message=False`` keeps the
    request bodies the same as the LangGraph version's (no ``name`` on the user message)."""
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    kwargs: dict[str, Any] = dict(model=model, base_url=base_url, api_key=api_key,
                                  model_info=model_info or MODEL_INFO, max_tokens=max_tokens,
                                  temperature=temperature, timeout=timeout, max_retries=1,
                                  include_name_in_message=False)
    if seed is not None:
        kwargs["seed"] = seed
    if http_client is not None:
        kwargs["http_client"] = http_client
    return OpenAIChatCompletionClient(**kwargs)


# -- a synchronous façade (run.py) and the bench shape ----------------------------------------------

class AutoGenPeer:
    """Synchronous façade: ``invoke(question)`` runs one question with ``asyncio.run`` on a fresh
    client and a fresh instrumented team (so each question is its own workflow, as the LangGraph
    version's per-invoke runs, and nothing outlives the call); per-call usage accumulates in
    ``.usage`` (a :class:`CallLog`).

        peer = AutoGenPeer(base_url=..., model=...)
        result = peer.invoke(question)        # the run_question() dict
        peer.usage.snapshot()

    Not for use inside a running event loop (await :func:`run_question` there).
    """

    def __init__(self, *, base_url: str, model: str, api_key: str = "kvflow", max_tokens: int = 256,
                 temperature: float = 0.0, seed: Optional[int] = None, jump: str = "expressing",
                 max_rounds: int = 2, executors: int = DEFAULT_EXECUTORS, instrument: bool = True,
                 app_id: str = APP_ID, timeout: float = 600.0, next_run: bool = False,
                 on_call: Optional[Callable[[dict[str, Any]], Any]] = None) -> None:
        self.next_run = next_run
        self.team_options = {"jump": jump, "max_rounds": max_rounds, "executors": executors}
        check_options(**self.team_options)
        self.client_options = {"base_url": base_url, "model": model, "api_key": api_key,
                               "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                               "timeout": timeout}
        self.instrument = instrument
        self.app_id = app_id
        self.base_url = base_url
        self.timeout = timeout
        self.usage = CallLog(on_call)
        self.instrumented = instrument and _adapter_available()
        self.team: Optional[GraphFlow] = None  # the last question's team

    def new_team(self, client: Any) -> GraphFlow:
        team = build_team(client, **self.team_options)
        team, self.instrumented = instrument_team(team, instrument=self.instrument, app_id=self.app_id,
                                                  next_run=self.next_run)
        return team

    async def ainvoke(self, question: Any) -> dict[str, Any]:
        client = make_client(http_client=self.usage.http_client(self.timeout), **self.client_options)
        try:
            self.team = self.new_team(client)
            return await run_question(self.team, question)
        finally:
            await client.close()

    def invoke(self, question: Any) -> dict[str, Any]:
        return asyncio.run(self.ainvoke(question))

    def close(self) -> None:
        """Nothing to release (each invoke closes its client); kept for symmetry."""


def _adapter_available() -> bool:
    try:
        import kvflow_agents.adapters.autogen  # noqa: F401
    except ImportError:
        return False
    return True


class AutoGenPeerApp(PeerApp):
    """The AutoGen PEER app with the interface of ``kvflow_agents.bench.peer.PeerApp``:
    ``AutoGenPeerApp(base_url, model, opts, api_key, on_call=None)``, ``.ask(q, wf_index, label,
    measured) -> seconds``, ``.capture.calls`` (``CallRecord`` per LLM call, ``agent`` = the role:
    ``executor_i`` is filed as ``executor``), ``.result`` (``WorkloadResult``), ``.answers``,
    ``.instrumented``, ``.base_url``. ``opts`` is a ``PeerOptions`` (``jump``, ``max_rounds``,
    ``max_tokens``, ``seed``; ``executors`` when it has one, else 3). Timing and recording are
    ``PeerApp.ask``'s; only how a question runs differs."""

    class _Capture:
        def __init__(self) -> None:
            self.calls: list[Any] = []
            self.workflow = 0
            self.round = 0
            self.measured = False
            self.lock = threading.Lock()

    def __init__(self, base_url: str, model: str, opts: Any, api_key: Optional[str],
                 on_call: Optional[Callable[[Any], None]] = None) -> None:
        from kvflow_agents.bench.workload import WorkloadResult

        self.capture = self._Capture()
        self._on_call = on_call
        self.peer = AutoGenPeer(base_url=base_url, model=model, api_key=api_key or "kvflow",
                                max_tokens=opts.max_tokens, temperature=0.0, seed=getattr(opts, "seed", None),
                                jump=opts.jump, max_rounds=opts.max_rounds,
                                executors=int(getattr(opts, "executors", None) or DEFAULT_EXECUTORS),
                                next_run=getattr(opts, "next_run", False), on_call=self._record)
        self.instrumented = self.peer.instrumented
        self.base_url = base_url
        self.result = WorkloadResult()
        self.answers: list[dict] = []

    def _record(self, rec: dict[str, Any]) -> None:
        from kvflow_agents.bench.workload import CallRecord, _usage_fields

        cap = self.capture
        with cap.lock:
            cr = CallRecord(cap.workflow, cap.round, role_of(rec["agent"]), 0, cap.measured, rec["start"], 0.0,
                            rec["latency_s"], ok=rec["error"] is None, error=rec["error"], hints=rec["hints"])
            _usage_fields(cr, rec["usage"])
            cr.ttft_s = cr.server_ttft_s if cr.server_ttft_s is not None else cr.latency_s
            cap.calls.append(cr)
        if self._on_call is not None:
            self._on_call(cr)

    def _invoke(self, q: Any, wf_index: int, label: str) -> dict:
        return self.peer.invoke(q)

    def close(self) -> None:
        self.peer.close()  # nothing held between questions; safe to skip


async def run_peer_autogen(base_url: str, model: str, questions: Sequence[Any], *, jump: str = "expressing",
                           max_rounds: int = 2, max_tokens: int = 48, executors: int = DEFAULT_EXECUTORS,
                           api_key: str = "kvflow", seed: Optional[int] = None, instrument: bool = True,
                           app_id: str = APP_ID) -> list[dict[str, Any]]:
    """Run ``questions`` one after another (a fresh instrumented team each, one shared client).
    Per question: ``{id, latency_s, rounds, verdicts, final_verdict, executors, error}``."""
    usage = CallLog()
    client = make_client(base_url=base_url, model=model, api_key=api_key, max_tokens=max_tokens, seed=seed,
                         http_client=usage.http_client())
    out = []
    try:
        for q in questions:
            team, _ = instrument_team(build_team(client, jump=jump, max_rounds=max_rounds, executors=executors),
                                      instrument=instrument, app_id=app_id)
            n0 = len(usage.records)
            t0 = time.perf_counter()
            try:
                r, err = await run_question(team, q), None
            except Exception as e:  # noqa: BLE001
                r, err = {}, f"{type(e).__name__}: {e}"
            out.append({"id": _field(q, "id"), "latency_s": time.perf_counter() - t0,
                        "rounds": r.get("rounds", 0), "verdicts": r.get("verdicts", []),
                        "final_verdict": r.get("final_verdict"), "executors": executors,
                        "calls": len(usage.records) - n0, "error": err})
    finally:
        await client.close()
    return out
