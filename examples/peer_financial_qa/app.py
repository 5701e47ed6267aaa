"""The PEER financial-QA workflow as a LangGraph ``StateGraph``.

    planner ──Send×(3..5)──▶ executor ──▶ expresser ──▶ reviewer ──PASS / rounds used──▶ END
       ▲                     (parallel)       ▲             │
       └──────── FAIL, jump="planning" ───────┼─────────────┤
                                              └── FAIL, jump="expressing" (default)

* **Plan**: the planner returns a JSON list of 3-5 sub-questions (parsed robustly: JSON, else
  question-like lines, else the category's default sub-questions).
* **Execute**: a conditional edge returns one ``Send("executor", {...})`` per sub-question, so
  all executor instances run in the same LangGraph super-step (in parallel). Each picks the
  background snippets that share keywords with its sub-question.
* **Barrier**: a plain edge ``executor → expresser`` plus a reducer on ``findings``. Every
  executor instance writes the edge's trigger channel in the same super-step, and a node runs at
  most once per super-step, so the expresser runs **exactly once per round**, after *all*
  executors finished (a super-step is a barrier), and sees every finding. ``defer=True`` is not
  needed (and would only matter for branches of unequal length).
* **Express / Review**: the reviewer's first line is ``VERDICT: PASS`` or ``VERDICT: FAIL``.
  FAIL goes back to the expresser (agentUniverse's default ``jump_step="expressing"``) or to the
  planner (``jump="planning"``), for at most ``max_rounds`` reviews. A missing verdict counts as
  FAIL while rounds remain and as PASS ("PASS (assumed)") once they are used up.

Every LLM call sends ``[SystemMessage(<fixed prompt>), HumanMessage(<per-call variables>)]``,
so the fixed prompt is the leading, shareable, cacheable prefix of each agent.
"""

from __future__ import annotations

import json
import math
import operator
import re
from typing import Any, Annotated, Iterable, Optional, Sequence, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
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
    findings: Annotated[list, merge_findings]          # [{"index", "sub_question", "snippets", "text"}]
    draft: str
    review: str                                        # the latest reviewer output
    verdicts: Annotated[list[str], operator.add]       # "PASS" | "FAIL" | "UNKNOWN", one per round
    rounds: int                                        # reviews done
    plans: int                                         # planner runs
    final_verdict: str


class ExecutorTask(TypedDict):
    index: int
    question: str
    sub_question: str
    background: list[str]


# -- parsing small-model output ----------------------------------------------------------------

DEFAULT_SUB_QUESTIONS: dict[str, tuple[str, ...]] = {
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


# -- snippet selection --------------------------------------------------------------------------

_STOP = frozenset("""a an and are as at be been by can could did do does for from has have how in
into is it its of on or over than that the their this to was were what when which who why will with
would after before about latest main most much many more next new does doing""".split())
_WORD = re.compile(r"[a-z0-9][a-z0-9.%\-]*")


def _keywords(text: str) -> set[str]:
    words = {w.strip(".-") for w in _WORD.findall(text.lower())}
    out = set()
    for w in words:
        if len(w) < 3 or w in _STOP:
            continue
        out.add(w[:-1] if w.endswith("s") and len(w) > 4 else w)  # crude plural folding
    return out


def pick_snippets(sub_question: str, background: Sequence[str], *, k: int = 3,
                  fallback: int = 2) -> list[tuple[str, str]]:
    """The background snippets most relevant to ``sub_question`` by keyword overlap (at most
    ``k``), labelled ``S1..Sn`` by their position in the question's background.

    Shared keywords are weighted by rarity across the snippets (``log(n/df)``), so a word every
    snippet contains (usually the entity's name) does not make every snippet relevant. When no
    snippet shares a distinguishing word, any overlap counts; when none overlaps at all, the
    first ``fallback`` snippets are used."""
    n = len(background)
    want = _keywords(sub_question)
    kws = [_keywords(s) for s in background]
    df: dict[str, int] = {}
    for kw in kws:
        for w in kw:
            df[w] = df.get(w, 0) + 1
    scored = []
    for i, kw in enumerate(kws):
        shared = want & kw
        scored.append((sum(math.log(n / df[w]) for w in shared), len(shared), i))
    hits = [x for x in scored if x[0] > 1e-9] or [x for x in scored if x[1] > 0]
    top = sorted(hits, key=lambda x: (-x[0], -x[1], x[2]))[:k]
    chosen = sorted(i for _, _, i in top) or list(range(min(fallback, n)))
    return [(f"S{i + 1}", background[i]) for i in chosen]


# -- the graph ----------------------------------------------------------------------------------

def _text(msg: Any) -> str:
    content = getattr(msg, "content", msg)
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content or "")


def _ask(llm: Any, system: str, user: str) -> str:
    return _text(llm.invoke([SystemMessage(content=system), HumanMessage(content=user)])).strip()


def _ordered_findings(state: PeerState) -> list[str]:
    return [f["text"] or "(no findings)" for f in sorted(state.get("findings") or [], key=lambda f: f["index"])]


def build_graph(llm: Any, *, jump: str = "expressing", max_rounds: int = 2,
                executors: tuple[int, int] = (3, 5)) -> StateGraph:
    """The PEER workflow as an uncompiled ``StateGraph`` (compile it, or ``kvflow.instrument`` it).

    ``llm``: a LangChain chat model (``ChatOpenAI(...)``) used by all four agents.
    ``jump``: where a failed review goes: ``"expressing"`` (default) or ``"planning"``.
    ``max_rounds``: the most reviews per question. ``executors``: the (min, max) fan-out.
    """
    if jump not in ("expressing", "planning"):
        raise ValueError(f"jump must be 'expressing' or 'planning', not {jump!r}")
    if max_rounds < 1:
        raise ValueError("max_rounds must be >= 1")
    lo, hi = executors
    if not 1 <= lo <= hi:
        raise ValueError(f"executors must be (min, max) with 1 <= min <= max, not {executors!r}")

    def planner(state: PeerState) -> dict[str, Any]:
        user = prompts.planner_user(state["question"], state.get("category", "macro"))
        if state.get("plans") and state.get("review"):  # re-planning after a failed review
            user += "\n\nA previous answer was rejected. Review notes:\n" + state["review"].strip()
        out = _ask(llm, prompts.PLANNER_SYSTEM, user)
        subs, source = parse_plan(out, state.get("category", "macro"), state["question"], (lo, hi))
        return {"sub_questions": subs, "plan_source": source, "findings": [RESET],
                "plans": state.get("plans", 0) + 1}

    def fan_out(state: PeerState) -> list[Send]:
        return [Send("executor", {"index": i, "question": state["question"], "sub_question": sq,
                                  "background": list(state.get("background") or [])})
                for i, sq in enumerate(state["sub_questions"])]

    def executor(task: ExecutorTask) -> dict[str, Any]:
        snippets = pick_snippets(task["sub_question"], task.get("background") or [])
        out = _ask(llm, prompts.EXECUTOR_SYSTEM, prompts.executor_user(task["sub_question"], snippets))
        return {"findings": [{"index": task["index"], "sub_question": task["sub_question"],
                              "snippets": [lbl for lbl, _ in snippets], "text": out}]}

    def expresser(state: PeerState) -> dict[str, Any]:
        revise = bool(state.get("verdicts")) and state["verdicts"][-1] != "PASS"
        user = prompts.expresser_user(
            state["question"], _ordered_findings(state),
            previous_draft=state.get("draft") if revise else None,
            review_notes=state.get("review") if revise else None)
        return {"draft": _ask(llm, prompts.EXPRESSER_SYSTEM, user)}

    def reviewer(state: PeerState) -> dict[str, Any]:
        out = _ask(llm, prompts.REVIEWER_SYSTEM,
                   prompts.reviewer_user(state["question"], _ordered_findings(state), state.get("draft", "")))
        verdict = parse_verdict(out)
        rounds = state.get("rounds", 0) + 1
        if verdict == "PASS":
            final = "PASS"
        elif rounds >= max_rounds:
            final = "FAIL (rounds used up)" if verdict == "FAIL" else "PASS (assumed: no verdict)"
        else:
            final = ""
        return {"review": out, "verdicts": [verdict], "rounds": rounds, "final_verdict": final}

    retry_target = "planner" if jump == "planning" else "expresser"

    def after_review(state: PeerState) -> str:
        if state["verdicts"][-1] == "PASS" or state.get("rounds", 0) >= max_rounds:
            return END
        return retry_target

    builder = StateGraph(PeerState)
    builder.add_node("planner", planner)
    builder.add_node("executor", executor, input_schema=ExecutorTask)
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
            "background": list(get("background")), "findings": [RESET], "verdicts": [],
            "rounds": 0, "plans": 0}


def compile_app(builder: StateGraph, *, instrument: bool = True, **instrument_kwargs: Any) -> Any:
    """Instrument with ``kvflow.instrument`` (when the LangGraph adapter is installed and
    ``instrument`` is true) and compile. Returns ``(app, instrumented: bool)``."""
    app: Any = builder
    instrumented = False
    if instrument:
        try:
            import kvflow_agents.adapters.langgraph  # noqa: F401  — is the adapter there?
        except ImportError:
            pass
        else:
            import kvflow_agents as kvflow

            app = kvflow.instrument(builder, **instrument_kwargs)
            instrumented = True
    if hasattr(app, "compile") and not hasattr(app, "invoke"):
        app = app.compile()
    return app, instrumented


def make_llm(*, base_url: str, model: str, api_key: str = "kvflow", max_tokens: int = 256,
             temperature: float = 0.0, seed: Optional[int] = None, timeout: float = 600.0,
             callbacks: Optional[Iterable[Any]] = None) -> Any:
    """A ``ChatOpenAI`` created the ordinary way (kvflow's autopatch attaches hints to it)."""
    from langchain_openai import ChatOpenAI

    kwargs: dict[str, Any] = dict(base_url=base_url, model=model, api_key=api_key,
                                  max_tokens=max_tokens, temperature=temperature,
                                  timeout=timeout, max_retries=1)
    if seed is not None:
        kwargs["seed"] = seed
    if callbacks:
        kwargs["callbacks"] = list(callbacks)
    return ChatOpenAI(**kwargs)
