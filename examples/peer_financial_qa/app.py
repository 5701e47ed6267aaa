"""The PEER financial-QA workflow as a LangGraph ``StateGraph``.

    planner ──Send×(3..5)──▶ executor ──────────────────▶ expresser ──▶ reviewer ──PASS / rounds used──▶ END
       ▲                     (a subgraph per sub-question:       ▲             │
       │                      agent ─search_corpus─▶ tools ─▶ agent)           │
       └──────── FAIL, jump="planning" ────────────────┼──────────────────────┤
                                                        └── FAIL, jump="expressing" (default)

* **Plan**: the planner returns ``{"sub_questions": [3-5 questions]}`` (``response_format``
  JSON schema, so the server's grammar holds even a 135M model to it; a malformed or truncated
  reply falls back to the category's default sub-questions).
* **Execute**: ``Send("executor", {...})`` per sub-question; each executor is a tool-using agent
  (a subgraph ``agent -> tools -> agent`` with a LangGraph ``ToolNode``): its first turn must
  call ``search_corpus`` (BM25 over the research notes, :mod:`.corpus`), its second writes
  ``{"facts": [...], "gaps": ...}`` from the passages. The tool call is a real tool gap
  between two turns of the same agent, and the second turn extends the first one's prompt.
* **Barrier**: a plain edge ``executor → expresser`` plus a reducer on ``findings``: the
  expresser runs once per round, after every executor finished (a super-step is a barrier).
* **Express / Review**: the expresser writes ``{"answer", "key_points", "risks"}``; the
  reviewer ``{"score", "verdict", "suggestion"}`` (PEER's score, with agentUniverse's pass mark
  of 60). FAIL goes back to the expresser (agentUniverse's default ``jump_step="expressing"``)
  or to the planner (``jump="planning"``), for at most ``max_rounds`` reviews.

Every LLM call starts with ``SystemMessage(<fixed prompt>)``, so the fixed prompt (and, for the
executor, its tool list) is the leading, shareable, cacheable prefix of each agent.
"""

from __future__ import annotations

import json
import operator
import re
from typing import Any, Annotated, Iterable, NamedTuple, Optional, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send

from . import prompts

# -- state ------------------------------------------------------------------------------------

RESET = "__reset__"  # a findings update starting with this clears the list (a new plan)


def merge_findings(left: Optional[list], right: Any) -> list:
    """Reducer for ``findings``: executors append; the planner resets with ``[RESET]``."""
    left = list(left or [])
    right = list(right) if isinstance(right, (list, tuple)) else [right]
    if right and right[0] == RESET:
        return list(right[1:])
    return left + right


class PeerState(TypedDict, total=False):
    qid: str
    category: str
    question: str
    background: list[str]
    sub_questions: list[str]
    plan_source: str                                   # "json" | "lines" | "default" (+ "+default")
    findings: Annotated[list, merge_findings]          # [{"index", "sub_question", "query", "sources", "text"}]
    answer: dict                                       # the expresser's {"answer", "key_points", "risks"}
    draft: str                                         # that answer, rendered as text
    review: str                                        # the latest reviewer suggestion
    verdicts: Annotated[list[str], operator.add]       # "PASS" | "FAIL" | "UNKNOWN", one per round
    scores: Annotated[list, operator.add]              # the reviewer's score per round (None: unparsed)
    rounds: int                                        # reviews done
    plans: int                                         # planner runs
    final_verdict: str


class ExecutorState(TypedDict, total=False):
    """One executor's subgraph (the ``Send`` payload, then its own conversation)."""

    index: int
    question: str
    sub_question: str
    messages: Annotated[list, add_messages]
    findings: Annotated[list, merge_findings]


class ExecutorOutput(TypedDict, total=False):
    findings: Annotated[list, merge_findings]


# -- structured outputs (the server's grammar holds the model to these) -----------------------

_CHARS = r"A-Za-z0-9 ,.;:%'()/&+\-"   # prose: no quotes, braces or markup


# xgrammar 0.2.7 (what SGLang 0.5.23 ships) fails to compile a repeat bounded above 128
# ("per_rule_fsm_hashes ... Check failed"): keep every bound at or under it, so the same
# schemas work on kvflow serve and on SGLang.
_MAX_REPEAT = 128


def _text(lo: int, hi: int, extra: str = "") -> dict:
    """A sentence of ``lo+1..hi+1`` characters starting with a capital or digit."""
    return {"type": "string", "pattern": f"^[A-Z0-9][{_CHARS}{extra}]{{{lo},{min(hi, _MAX_REPEAT)}}}$"}


_QUESTION = {"type": "string", "pattern": f"^[A-Z][{_CHARS}]{{15,{_MAX_REPEAT}}}\\?$"}


def _cited(lo: int, hi: int) -> dict:
    """A sentence that starts with the [id] of the passage it rests on: the model copies an id
    from its context and then, as the passage follows that id there, the passage's own words
    (what a small model does well, instead of drifting or echoing its instructions)."""
    return {"type": "string", "pattern": f"^\\[[A-Za-z0-9/#._\\-]{{3,48}}\\] [A-Z0-9][{_CHARS}]{{{lo},{min(hi, _MAX_REPEAT)}}}$"}


_FACT = _cited(10, 260)


PLAN_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["sub_questions"],
               "properties": {"sub_questions": {"type": "array", "minItems": 3, "maxItems": 5,
                                                "items": _QUESTION}}}
FINDINGS_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["facts", "gaps"],
                   "properties": {"facts": {"type": "array", "minItems": 1, "maxItems": 3,
                                            "items": _FACT},
                                  "gaps": _text(3, 160)}}
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "key_points", "risks"],
                 "properties": {"answer": _cited(20, 300),
                                "key_points": {"type": "array", "minItems": 2, "maxItems": 3, "items": _cited(10, 220)},
                                "risks": {"type": "array", "minItems": 1, "maxItems": 2, "items": _cited(10, 180)}}}
REVIEW_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["score", "verdict", "suggestion"],
                 "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 100},
                                "verdict": {"type": "string", "enum": ["PASS", "FAIL"]},
                                "suggestion": _text(10, 200)}}
PASS_MARK = 60  # agentUniverse's PEER eval_threshold


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# Output budgets per call (tokens): enough for the schema's longest valid reply.
MAX_TOKENS = {"planner": 240, "search": 64, "findings": 240, "expresser": 360, "reviewer": 96}


# -- parsing small-model output ----------------------------------------------------------------

DEFAULT_SUB_QUESTIONS: dict[str, tuple[str, ...]] = {
    "general": ("What are the key facts and latest figures about: {q}",
                "What explains or drives: {q}",
                "What risks or open questions remain about: {q}"),
    "macro": ("What are the latest data and recent changes relevant to: {q}",
              "What are the main drivers and causes behind: {q}",
              "What risks and policy responses could change the outlook for: {q}"),
    "markets": ("What moved in the market, and by how much, regarding: {q}",
                "What catalysts, flows or valuation factors explain: {q}",
                "What could reverse or extend the market move in: {q}"),
    "company_analysis": ("What are the company's recent revenue, margin and cash-flow trends for: {q}",
                         "What segments, products or management actions drive: {q}",
                         "What balance-sheet, competitive or regulatory risks affect: {q}"),
    "policy": ("What exactly changed, and when does it take effect, regarding: {q}",
               "What is the stated objective and who is affected by: {q}",
               "What are the expected economic and market impacts and risks of: {q}"),
    "reports": ("What is the headline figure versus the prior period and expectations in: {q}",
                "Which sub-components or details of the report are most informative for: {q}",
                "What does the report imply for the next release or decision regarding: {q}"),
}


def default_sub_questions(category: str, question: str) -> list[str]:
    templates = DEFAULT_SUB_QUESTIONS.get(category, DEFAULT_SUB_QUESTIONS["macro"])
    q = question.strip().rstrip("?").strip()
    return [t.format(q=q) + "?" for t in templates]


_FENCE = re.compile(r"```(?:json)?", re.I)
_BULLET = re.compile(r"^\s*(?:[-*•]+|\(?\d{1,2}[.):]|\"|')\s*")


def _clean_item(s: str) -> str:
    s = _BULLET.sub("", str(s)).strip().strip('",\'').strip()
    return re.sub(r"\s+", " ", s)


def parse_plan(text: str, category: str, question: str,
               bounds: tuple[int, int] = (3, 5)) -> tuple[list[str], str]:
    """``(sub_questions, source)`` from the planner's output; always ``lo..hi`` items."""
    lo, hi = bounds
    items: list[str] = []
    source = "default"
    body = _FENCE.sub("", text or "")
    start, end = body.find("["), body.rfind("]")
    if start != -1 and end > start:
        try:
            doc = json.loads(body[start:end + 1])
            if isinstance(doc, list):
                items = [_clean_item(x if isinstance(x, str) else json.dumps(x)) for x in doc]
                source = "json"
        except ValueError:
            pass
    if not items:
        try:
            doc = json.loads(body.strip())
            if isinstance(doc, dict):
                for key in ("sub_questions", "framework", "questions"):
                    if isinstance(doc.get(key), list):
                        items = [_clean_item(x) for x in doc[key] if isinstance(x, str)]
                        source = "json"
                        break
        except ValueError:
            pass
    if not items:
        lines = [_clean_item(ln) for ln in body.splitlines()]
        items = [ln for ln in lines if ln.endswith("?")]
        source = "lines"
    seen: set[str] = set()
    uniq = []
    for it in items:
        key = it.lower()
        if len(it) >= 10 and key not in seen and key != question.strip().lower():
            seen.add(key)
            uniq.append(it)
    if not uniq:
        source = "default"
    if len(uniq) < lo:
        for d in default_sub_questions(category, question):
            if len(uniq) >= lo:
                break
            if d.lower() not in seen:
                uniq.append(d)
        if source != "default":
            source += "+default"
    return uniq[:hi], source


_VERDICT = re.compile(r"verdict\s*[:=\-]?\s*\**\s*(pass|fail)", re.I)


def parse_verdict(text: str) -> str:
    """``"PASS"``, ``"FAIL"`` or ``"UNKNOWN"`` from the reviewer's output."""
    text = text or ""
    m = _VERDICT.search(text)
    if m:
        return m.group(1).upper()
    head = "\n".join(text.strip().splitlines()[:2]).upper()
    has_pass, has_fail = bool(re.search(r"\bPASS(ED)?\b", head)), bool(re.search(r"\bFAIL(ED|S)?\b", head))
    if has_pass != has_fail:
        return "PASS" if has_pass else "FAIL"
    m = re.search(r'"is_useful"\s*:\s*(true|false)', text, re.I)  # agentUniverse's JSON form
    if m:
        return "PASS" if m.group(1).lower() == "true" else "FAIL"
    return "UNKNOWN"


def parse_json_object(text: str) -> Optional[dict]:
    """The JSON object in ``text`` (fences and surrounding prose tolerated), or ``None``."""
    body = _FENCE.sub("", text or "")
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        doc = json.loads(body[start:end + 1])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class Review(NamedTuple):
    verdict: str                  # "PASS" | "FAIL" | "UNKNOWN"
    score: Optional[int]
    suggestion: str
    structured: bool              # parsed from the JSON object (else from text)


def parse_review(text: str) -> Review:
    """The reviewer's ``{"score", "verdict", "suggestion"}``; plain text falls back to
    :func:`parse_verdict`. A verdict missing from the JSON follows the score (pass mark 60)."""
    doc = parse_json_object(text)
    if doc is not None and ("verdict" in doc or "score" in doc):
        score = doc.get("score")
        score = int(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else None
        verdict = str(doc.get("verdict") or "").upper()
        if verdict not in ("PASS", "FAIL"):
            verdict = "UNKNOWN" if score is None else ("PASS" if score >= PASS_MARK else "FAIL")
        return Review(verdict, score, str(doc.get("suggestion") or ""), True)
    verdict, score = parse_verdict(text), None
    m = _SCORE.search(text or "")  # a reply cut by max_tokens still has its score
    if m:
        score = min(100, int(m.group(1)))
        if verdict == "UNKNOWN":
            verdict = "PASS" if score >= PASS_MARK else "FAIL"
    return Review(verdict, score, (text or "").strip(), False)


_SCORE = re.compile(r'"score"\s*:\s*(\d{1,3})')


_LEAD_LABEL = re.compile(r"^\[([^\]]+)\]\s*(.*)$", re.S)


def _source_last(text: str) -> str:
    """``"[id] sentence"`` -> ``"sentence [id]"`` (the user reads the claim first)."""
    m = _LEAD_LABEL.match(text.strip())
    return f"{m.group(2).strip()} [{m.group(1)}]" if m else text.strip()


def render_answer(doc: Optional[dict], raw: str = "") -> str:
    """The expresser's JSON answer as the text a user reads, each source after its sentence
    (the raw reply when unparsed)."""
    if not doc or not isinstance(doc.get("answer"), str):
        return (raw or "").strip()
    lines = [f"Answer: {_source_last(doc['answer'])}"]
    points = [p for p in doc.get("key_points") or [] if isinstance(p, str)]
    if points:
        lines += ["Key points:"] + [f"- {_source_last(p)}" for p in points]
    risks = [r for r in doc.get("risks") or [] if isinstance(r, str)]
    if risks:
        lines += ["Risks and what to watch:"] + [f"- {_source_last(r)}" for r in risks]
    return "\n".join(lines)


def parse_findings(text: str) -> str:
    """The executor's ``{"facts", "gaps"}`` as bullet lines (the raw reply when unparsed)."""
    doc = parse_json_object(text)
    if not doc or not isinstance(doc.get("facts"), list):
        return (text or "").strip()
    lines = [f"- {f.strip()}" for f in doc["facts"] if isinstance(f, str) and f.strip()]
    if isinstance(doc.get("gaps"), str) and doc["gaps"].strip():
        lines.append(f"Gaps: {doc['gaps'].strip()}")
    return "\n".join(lines)


_SOURCE = re.compile(r"^\[([^\]]+)\]", re.M)


def sources_of(tool_result: str) -> list[str]:
    """Passage ids in a ``search_corpus`` result (its ``[id] text`` lines)."""
    return _SOURCE.findall(tool_result or "")


# -- the graph ----------------------------------------------------------------------------------

def _text_of(msg: Any) -> str:
    content = getattr(msg, "content", msg)
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content or "")


def _invoke(llm: Any, messages: list) -> Any:
    """``llm.invoke(messages)``; a structured reply cut by ``max_tokens`` comes back as the text it
    had (langchain-openai raises ``LengthFinishReasonError`` for those; our parsers fall back)."""
    try:
        return llm.invoke(messages)
    except Exception as e:  # noqa: BLE001 — only the length case is handled
        completion = getattr(e, "completion", None)
        if type(e).__name__ != "LengthFinishReasonError" or completion is None:
            raise
        return AIMessage(content=completion.choices[0].message.content or "")


def _ask(llm: Any, system: str, user: str) -> str:
    return _text_of(_invoke(llm, [SystemMessage(content=system), HumanMessage(content=user)])).strip()


def _ordered_findings(state: PeerState) -> list[str]:
    return [f["text"] or "(no findings)" for f in sorted(state.get("findings") or [], key=lambda f: f["index"])]


def build_executor(llm: Any, search: Any) -> Any:
    """One executor: ``agent`` (a forced ``search_corpus`` call) -> ``tools`` (a ``ToolNode``) ->
    ``agent`` (``{"facts", "gaps"}``) -> END. Compiled; used as the ``executor`` node."""
    from langgraph.prebuilt import ToolNode, tools_condition

    # The same (strict) tool list on both turns: the agent's prefix stays cacheable. strict: with
    # response_format, langchain-openai parses the reply and accepts only strict tools.
    call = llm.bind_tools([search], tool_choice={"type": "function", "function": {"name": search.name}},
                          strict=True, max_tokens=MAX_TOKENS["search"])
    write = llm.bind_tools([search], tool_choice="none", strict=True).bind(  # (not bind_tools: it
        max_tokens=MAX_TOKENS["findings"], response_format=response_format("findings", FINDINGS_SCHEMA))  # would rewrite response_format

    def agent(state: ExecutorState) -> dict[str, Any]:
        msgs = list(state.get("messages") or [])
        if not msgs:
            msgs = [SystemMessage(content=prompts.EXECUTOR_SYSTEM),
                    HumanMessage(content=prompts.executor_user(state["sub_question"], state.get("question")))]
            return {"messages": [*msgs, _invoke(call, msgs)]}
        results = [m for m in msgs if isinstance(m, ToolMessage)]
        calls = [c for m in msgs if isinstance(m, AIMessage) for c in m.tool_calls]
        reply = _invoke(write, msgs)
        text = _text_of(reply).strip()
        return {"messages": [reply], "findings": [{
            "index": state["index"], "sub_question": state["sub_question"],
            "query": calls[0]["args"].get("query", "") if calls else "",
            "sources": [sid for r in results for sid in sources_of(str(r.content))],
            "text": parse_findings(text)}]}

    def after_agent(state: ExecutorState) -> str:
        if any(isinstance(m, ToolMessage) for m in state.get("messages") or []):
            return END  # the findings are written
        return tools_condition(state)  # "tools" when the model called the search tool

    g = StateGraph(ExecutorState, output_schema=ExecutorOutput)  # only the findings go back
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([search]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", after_agent, ["tools", END])
    g.add_edge("tools", "agent")
    return g.compile(name="executor")


def build_graph(llm: Any, *, jump: str = "expressing", max_rounds: int = 2,
                executors: tuple[int, int] = (3, 5), corpus: Any = None, search_delay_s: float = 0.0) -> StateGraph:
    """The PEER workflow as an uncompiled ``StateGraph`` (compile it, or ``kvflow.instrument`` it).

    ``llm``: a LangChain chat model (``ChatOpenAI(...)``) used by all four agents.
    ``jump``: where a failed review goes: ``"expressing"`` (default) or ``"planning"``.
    ``max_rounds``: the most reviews per question. ``executors``: the (min, max) fan-out.
    ``corpus``: a :class:`.corpus.Corpus` the executors search (default: the shipped snippets);
    ``search_delay_s``: latency added to each search (a remote search backend's).
    """
    from .corpus import default_corpus, search_tool

    if jump not in ("expressing", "planning"):
        raise ValueError(f"jump must be 'expressing' or 'planning', not {jump!r}")
    if max_rounds < 1:
        raise ValueError("max_rounds must be >= 1")
    lo, hi = executors
    if not 1 <= lo <= hi:
        raise ValueError(f"executors must be (min, max) with 1 <= min <= max, not {executors!r}")
    search = search_tool(corpus if corpus is not None else default_corpus(), delay_s=search_delay_s)
    planner_llm = llm.bind(max_tokens=MAX_TOKENS["planner"], response_format=response_format("plan", PLAN_SCHEMA))
    expresser_llm = llm.bind(max_tokens=MAX_TOKENS["expresser"],
                             response_format=response_format("answer", ANSWER_SCHEMA))
    reviewer_llm = llm.bind(max_tokens=MAX_TOKENS["reviewer"], response_format=response_format("review", REVIEW_SCHEMA))

    def planner(state: PeerState) -> dict[str, Any]:
        user = prompts.planner_user(state["question"], state.get("category", "macro"))
        if state.get("plans") and state.get("review"):  # re-planning after a failed review
            user += "\n\nA previous answer was rejected. Review notes:\n" + state["review"].strip()
        out = _ask(planner_llm, prompts.PLANNER_SYSTEM, user)
        subs, source = parse_plan(out, state.get("category", "macro"), state["question"], (lo, hi))
        return {"sub_questions": subs, "plan_source": source, "findings": [RESET],
                "plans": state.get("plans", 0) + 1}

    def fan_out(state: PeerState) -> list[Send]:
        return [Send("executor", {"index": i, "question": state["question"], "sub_question": sq})
                for i, sq in enumerate(state["sub_questions"])]

    def expresser(state: PeerState) -> dict[str, Any]:
        revise = bool(state.get("verdicts")) and state["verdicts"][-1] != "PASS"
        user = prompts.expresser_user(
            state["question"], _ordered_findings(state),
            previous_draft=state.get("draft") if revise else None,
            review_notes=state.get("review") if revise else None)
        raw = _ask(expresser_llm, prompts.EXPRESSER_SYSTEM, user)
        doc = parse_json_object(raw)
        return {"answer": doc or {}, "draft": render_answer(doc, raw)}

    def reviewer(state: PeerState) -> dict[str, Any]:
        out = _ask(reviewer_llm, prompts.REVIEWER_SYSTEM,
                   prompts.reviewer_user(state["question"], _ordered_findings(state), state.get("draft", "")))
        rv = parse_review(out)
        rounds = state.get("rounds", 0) + 1
        if rv.verdict == "PASS":
            final = "PASS"
        elif rounds >= max_rounds:
            final = "FAIL (rounds used up)" if rv.verdict == "FAIL" else "PASS (assumed: no verdict)"
        else:
            final = ""
        return {"review": rv.suggestion, "verdicts": [rv.verdict], "scores": [rv.score], "rounds": rounds,
                "final_verdict": final}

    retry_target = "planner" if jump == "planning" else "expresser"

    def after_review(state: PeerState) -> str:
        if state["verdicts"][-1] == "PASS" or state.get("rounds", 0) >= max_rounds:
            return END
        return retry_target

    builder = StateGraph(PeerState)
    builder.add_node("planner", planner)
    builder.add_node("executor", build_executor(llm, search))
    builder.add_node("expresser", expresser)
    builder.add_node("reviewer", reviewer)
    builder.add_edge(START, "planner")
    builder.add_conditional_edges("planner", fan_out, ["executor"])
    builder.add_edge("executor", "expresser")  # fan-in: one expresser run after all executors
    builder.add_edge("expresser", "reviewer")
    builder.add_conditional_edges("reviewer", after_review, [retry_target, END])
    return builder


def initial_state(q: Any) -> PeerState:
    """The input for one question (a :class:`data.Question` or a dict with the same fields)."""
    get = (lambda k: q[k]) if isinstance(q, dict) else (lambda k: getattr(q, k))
    return {"qid": get("id"), "category": get("category"), "question": get("question"),
            "background": list(get("background")), "findings": [RESET], "verdicts": [], "scores": [],
            "rounds": 0, "plans": 0}


def compile_app(builder: StateGraph, *, instrument: bool = True, next_run: bool = False,
                **instrument_kwargs: Any) -> Any:
    """Instrument with ``kvflow.instrument`` (when the LangGraph adapter is installed and
    ``instrument`` is true) and compile. Returns ``(app, instrumented: bool)``. ``next_run=True``
    when the app answers questions one after another: its hints name the next question's
    planner while the reviewer runs (``kvflow.instrument(..., next_run=True)``)."""
    app: Any = builder
    instrumented = False
    if instrument:
        try:
            import kvflow_agents.adapters.langgraph  # noqa: F401  — is the adapter there?
        except ImportError:
            pass
        else:
            import kvflow_agents as kvflow

            app = kvflow.instrument(builder, next_run=next_run, **instrument_kwargs)
            instrumented = True
    if hasattr(app, "compile") and not hasattr(app, "invoke"):
        app = app.compile()
    return app, instrumented


def make_llm(*, base_url: str, model: str, api_key: str = "kvflow", max_tokens: int = 256,
             temperature: float = 0.0, seed: Optional[int] = None, timeout: float = 600.0,
             callbacks: Optional[Iterable[Any]] = None, frequency_penalty: float = 0.5) -> Any:
    """A ``ChatOpenAI`` created the ordinary way (kvflow's autopatch attaches hints to it).
    ``frequency_penalty`` (OpenAI's): a small model otherwise repeats a phrase until the
    schema's length limit."""
    from langchain_openai import ChatOpenAI

    kwargs: dict[str, Any] = dict(base_url=base_url, model=model, api_key=api_key,
                                  max_tokens=max_tokens, temperature=temperature,
                                  timeout=timeout, max_retries=1, frequency_penalty=frequency_penalty)
    if seed is not None:
        kwargs["seed"] = seed
    if callbacks:
        kwargs["callbacks"] = list(callbacks)
    return ChatOpenAI(**kwargs)
