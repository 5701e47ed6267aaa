"""The PEER financial-QA example (examples/peer_financial_qa): prompt layout, graph shape
(fan-out to tool-using executors, barrier, review loop), structured outputs and their
fallbacks, usage accounting and the CLI — all against a real LangGraph graph and a real
OpenAI-shaped HTTP server (scripted replies). The question files and the corpus:
test_peer_data.py; the embedded-server helper: test_peer_server_helper.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.peer_financial_qa import app as peer  # noqa: E402
from examples.peer_financial_qa import data, prompts  # noqa: E402
from examples.peer_financial_qa.usage import UsageByAgent, extract_usage  # noqa: E402
from kvflow_agents.testing import RecordingOpenAIServer  # noqa: E402

HAS_ADAPTER = importlib.util.find_spec("kvflow_agents.adapters.langgraph") is not None
BY_PROMPT = {v: k for k, v in prompts.SYSTEM_PROMPTS.items()}
QUESTIONS = data.load_questions()
Q1 = next(q for q in QUESTIONS if q.id == "macro-01")
Q2 = next(q for q in QUESTIONS if q.id == "co-01")
N_SUBS = {Q1.question: 3, Q2.question: 4}


def agent_of(body: dict[str, Any]) -> str:
    return BY_PROMPT.get(body["messages"][0]["content"], "?")


def user_text(body: dict[str, Any]) -> str:
    return "\n".join(m["content"] for m in body["messages"][1:]
                     if m.get("role") == "user" and isinstance(m.get("content"), str))


def searched(body: dict[str, Any]) -> bool:
    """An executor request on its second turn (the search result is in it)."""
    return any(m.get("role") == "tool" for m in body["messages"])


def question_of(body: dict[str, Any]) -> str | None:
    text = user_text(body)
    return next((q for q in N_SUBS if q in text), None)


class Script:
    """Scripted replies in the app's structured shapes: the plan (3 or 4 sub-questions), each
    executor's search call then its findings, the answer, the reviewer's verdict per question."""

    def __init__(self, verdicts: dict[str, list[str]] | None = None, default_verdict: str = "PASS") -> None:
        self.verdicts = {k: list(v) for k, v in (verdicts or {}).items()}
        self.default_verdict = default_verdict

    def __call__(self, body: dict[str, Any]) -> Any:
        agent = agent_of(body)
        if agent == "planner":
            q = question_of(body) or ""
            return json.dumps({"sub_questions": [f"Sub-question {i + 1} about {q[:30]} inflation energy margin?"
                                                 for i in range(N_SUBS.get(q, 3))]})
        if agent == "reviewer":
            queue = self.verdicts.get(question_of(body) or "", [])
            v = queue.pop(0) if queue else self.default_verdict
            if v in ("PASS", "FAIL"):
                return json.dumps({"score": 80 if v == "PASS" else 30, "verdict": v, "suggestion": "Scripted note"})
            return v
        if agent == "executor":
            if not searched(body):
                sub = user_text(body).splitlines()[0].removeprefix("Sub-question: ")
                return {"content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "search_corpus", "arguments": json.dumps({"query": sub[:60]})}}]}
            return json.dumps({"facts": ["[macro-01/S2] Energy prices fell 6% in Q3."], "gaps": "None"})
        return json.dumps({"answer": "Scripted draft answer.", "key_points": ["First point.", "Second point."],
                           "risks": ["A risk."]})


def run_questions(srv: RecordingOpenAIServer, questions: list[data.Question], *, jump: str = "expressing",
                  instrument: bool = False, callbacks: list[Any] | None = None, next_run: bool = False
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Run each question through the compiled graph; ``[(final_state, request_bodies)]``."""
    llm = peer.make_llm(base_url=srv.base_url, model="stub", api_key="x", max_tokens=64,
                        callbacks=callbacks)
    app, _ = peer.compile_app(peer.build_graph(llm, jump=jump, max_rounds=2), instrument=instrument,
                              next_run=next_run)
    out = []
    for q in questions:
        before = len(srv.llm_requests())
        result = app.invoke(peer.initial_state(q))
        out.append((result, [r.body for r in srv.llm_requests()[before:]]))
    return out


def sequence(bodies: list[dict[str, Any]]) -> list[str]:
    """Agent sequence with each parallel executor burst collapsed to one ``executor×n`` entry."""
    seq: list[str] = []
    for b in bodies:
        a = agent_of(b)
        if a == "executor" and seq and seq[-1].startswith("executor"):
            n = int(seq[-1].split("×")[1]) + 1
            seq[-1] = f"executor×{n}"
        else:
            seq.append("executor×1" if a == "executor" else a)
    return seq


# -- prompts (the data files and the corpus: test_peer_data.py) ------------------------------

def test_fixed_prompts_are_large_and_static():
    for name, text in prompts.SYSTEM_PROMPTS.items():
        assert 3500 <= len(text) <= 8000, (name, len(text))
        for q in QUESTIONS:  # no per-call variable leaked into a fixed prompt
            assert q.question not in text
    assert '"sub_questions"' in prompts.PLANNER_SYSTEM and '"verdict"' in prompts.REVIEWER_SYSTEM
    assert "search_corpus" in prompts.EXECUTOR_SYSTEM


# -- parsing ------------------------------------------------------------------------------------

def test_parse_plan_fallbacks():
    q = "Is Lumora Foods' profit recovery sustainable?"
    subs, src = peer.parse_plan('```json\n["A first sub-question?", "A second sub-question?", '
                                '"A third sub-question?"]\n```', "company_analysis", q)
    assert src == "json" and len(subs) == 3
    subs, src = peer.parse_plan("Here you go:\n1. What is revenue growth?\n2. What drives margins?\n"
                                "- What are the debt risks?\n3. What about guidance?", "company_analysis", q)
    assert src == "lines" and subs[0] == "What is revenue growth?" and len(subs) == 4
    subs, src = peer.parse_plan("I think the company is good.", "company_analysis", q)
    assert src == "default" and subs == peer.default_sub_questions("company_analysis", q)
    subs, src = peer.parse_plan('["Only one sub-question here?"]', "macro", q)
    assert src == "json+default" and len(subs) == 3 and subs[0] == "Only one sub-question here?"
    subs, _ = peer.parse_plan(json.dumps([f"Sub-question number {i}?" for i in range(9)]), "macro", q)
    assert len(subs) == 5
    subs, src = peer.parse_plan('{"thought": "t", "framework": ["Aaaaaaaaaa 1?", "Bbbbbbbbbb 2?", "Ccccccccc 3?"]}',
                                "macro", q)
    assert src == "json" and len(subs) == 3


@pytest.mark.parametrize("text, verdict", [
    ("VERDICT: PASS\nReasons:\n- fine", "PASS"),
    ("verdict: fail\nReasons: bad", "FAIL"),
    ("**Verdict:** PASS", "PASS"),
    ("FAIL - the draft invents numbers", "FAIL"),
    ('{"suggestion": "ok", "is_useful": true}', "PASS"),
    ("The draft looks reasonable overall.", "UNKNOWN"),
    ("", "UNKNOWN"),
])
def test_parse_verdict(text, verdict):
    assert peer.parse_verdict(text) == verdict


@pytest.mark.parametrize("text, review", [
    ('{"score": 85, "verdict": "PASS", "suggestion": "Fine."}', ("PASS", 85, "Fine.", True)),
    ('{"score": 40, "suggestion": "Add a risk."}', ("FAIL", 40, "Add a risk.", True)),  # verdict from the score
    ('{"score": 75, "verdict": "PA', ("PASS", 75, '{"score": 75, "verdict": "PA', False)),  # cut by max_tokens
    ("VERDICT: FAIL\nfix it", ("FAIL", None, "VERDICT: FAIL\nfix it", False)),
])
def test_parse_review(text, review):
    assert tuple(peer.parse_review(text)) == review


def test_structured_answer_and_findings_render_as_text():
    doc = {"answer": "Energy got cheaper.", "key_points": ["Tariffs were cut."], "risks": ["It is one-off."]}
    assert peer.render_answer(doc) == ("Answer: Energy got cheaper.\nKey points:\n- Tariffs were cut.\n"
                                       "Risks and what to watch:\n- It is one-off.")
    assert peer.render_answer(None, "raw text ") == "raw text"
    assert peer.parse_findings('{"facts": ["[a/S1] X rose."], "gaps": "None"}') == "- [a/S1] X rose.\nGaps: None"
    assert peer.sources_of("[a/S1] x\n[b.md#2] y") == ["a/S1", "b.md#2"]


def test_schemas_are_what_the_server_compiles():
    pytest.importorskip("xgrammar")
    from kvflow_agents.serving.embedded.grammar import GrammarBackend, spec_for_request
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    backend = GrammarBackend(ChatTokenizer.byte_level(), 259)
    for name, schema in [("plan", peer.PLAN_SCHEMA), ("findings", peer.FINDINGS_SCHEMA),
                         ("answer", peer.ANSWER_SCHEMA), ("review", peer.REVIEW_SCHEMA)]:
        m = backend.matcher(backend.compile(spec_for_request(response_format=peer.response_format(name, schema))))
        assert not m.accept_string('{"x": ') or name == "nothing"
    m = backend.matcher(backend.compile(spec_for_request(response_format=peer.response_format("f", peer.FINDINGS_SCHEMA))))
    assert m.accept_string('{"facts": ["[macro-01/S2] Energy prices fell 6% in Q3."], "gaps": "None"}')


# -- the graph against an OpenAI-shaped server ---------------------------------------------------

def _offline_llm():
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="x")


def test_graph_shape_declares_executor_target_and_review_loop():
    from kvflow_agents.adapters.langgraph_asg import build_asg

    b = peer.build_graph(_offline_llm())
    assert set(b.nodes) == {"planner", "executor", "expresser", "reviewer"}
    # the executor is a tool-using subgraph: agent -> ToolNode -> agent
    g = build_asg(b, "peer").graph
    assert {"executor/agent", "executor/tools"} <= set(g.agents) and not g.is_llm("executor/tools")
    ste = g.steps_to_execution({"planner"})
    assert ste["executor/tools"] == 2  # the exact STE is the best case: the agent could answer
    assert ste["expresser"] == 2       # without searching (the learned STE knows it searches)
    assert ("executor", "expresser") in b.edges and ("expresser", "reviewer") in b.edges
    assert set(b.branches["planner"]["fan_out"].ends.values()) == {"executor"}
    assert set(b.branches["reviewer"]["after_review"].ends.values()) == {"expresser", "__end__"}
    bp = peer.build_graph(_offline_llm(), jump="planning")
    assert set(bp.branches["reviewer"]["after_review"].ends.values()) == {"planner", "__end__"}
    with pytest.raises(ValueError):
        peer.build_graph(_offline_llm(), jump="executing")


def test_default_jump_messages_fanout_and_review_loop():
    script = Script(verdicts={Q2.question: ["FAIL", "PASS"]})
    with RecordingOpenAIServer(reply=script) as srv:
        (r1, b1), (r2, b2) = run_questions(srv, [Q1, Q2])

    # every request: [fixed system prompt, user message with the per-call variables]; an
    # executor's second turn adds its own search call and the tool result
    for body in b1 + b2:
        msgs = body["messages"]
        assert agent_of(body) in prompts.SYSTEM_PROMPTS
        roles = [m["role"] for m in msgs[1:]]
        assert msgs[0]["role"] == "system" and roles in (["user"], ["user", "assistant", "tool"])
        assert msgs[0]["content"] in prompts.SYSTEM_PROMPTS.values()  # byte-identical fixed prefix
        for q in (Q1, Q2):
            assert q.question not in msgs[0]["content"]
            assert not any(s in msgs[0]["content"] for s in q.background)
        rf = (body.get("response_format") or {}).get("json_schema", {}).get("name")
        agent = agent_of(body)
        if agent == "executor":
            assert [t["function"]["name"] for t in body["tools"]] == ["search_corpus"]
            if searched(body):  # the passages came from BM25 over the corpus, as the tool's result
                assert body["tool_choice"] == "none" and rf == "findings"
                assert msgs[-1]["content"].startswith("[") and msgs[-1]["content"] != "(no passage matched the query)"
            else:
                assert body["tool_choice"] == {"type": "function", "function": {"name": "search_corpus"}}
        else:
            assert rf == {"planner": "plan", "expresser": "answer", "reviewer": "review"}[agent]
    for body in b1:
        if agent_of(body) != "executor":
            assert Q1.question in user_text(body)
        else:
            assert user_text(body).startswith("Sub-question: Sub-question ")

    # Q1: 3 sub-questions -> 3 executors, each search -> read -> one expresser -> PASS
    assert sequence(b1) == ["planner", "executor×6", "expresser", "reviewer"]
    assert len(r1["sub_questions"]) == 3 and r1["verdicts"] == ["PASS"] and r1["final_verdict"] == "PASS"
    assert r1["scores"] == [80] and r1["draft"].startswith("Answer: Scripted draft answer.")
    assert len(r1["findings"]) == 3 and all(f["text"] == "- [macro-01/S2] Energy prices fell 6% in Q3.\nGaps: None"
                                            and f["sources"] and f["query"] for f in r1["findings"])
    # Q2: 4 executors; FAIL -> back to the expresser (not the planner) -> PASS
    assert sequence(b2) == ["planner", "executor×8", "expresser", "reviewer", "expresser", "reviewer"]
    assert r2["verdicts"] == ["FAIL", "PASS"] and r2["scores"] == [30, 80] and r2["rounds"] == 2 and r2["plans"] == 1
    # the revision carries the previous draft and the review notes, in the user message
    revision = [b for b in b2 if agent_of(b) == "expresser"][1]
    assert "Review notes to address" in user_text(revision) and "Scripted note" in user_text(revision)
    assert "Review notes" not in user_text([b for b in b2 if agent_of(b) == "expresser"][0])


def test_each_agent_sends_its_own_max_tokens_whatever_the_client_default():
    """The app binds each agent's cap (``MAX_TOKENS``) over the client's ``max_tokens`` (64
    here): what goes on the wire is the agent's, so the bench sizes its smallest pool from
    those caps (``largest_completion``), not from ``--max-tokens``."""
    from kvflow_agents.bench.peer import largest_completion

    with RecordingOpenAIServer(reply=Script()) as srv:
        ((_, bodies),) = run_questions(srv, [Q1])
    sent = {}
    for b in bodies:
        cap = b.get("max_completion_tokens", b.get("max_tokens"))
        key = ("search" if not searched(b) else "findings") if agent_of(b) == "executor" else agent_of(b)
        sent.setdefault(key, set()).add(cap)
    assert sent == {k: {v} for k, v in peer.MAX_TOKENS.items()}
    assert largest_completion("langgraph", 64) == max(peer.MAX_TOKENS.values()) > 64
    assert largest_completion("autogen", 64) == 64  # that app's calls use the client's cap


def test_jump_planning_goes_back_to_planner():
    script = Script(verdicts={Q1.question: ["FAIL", "PASS"]})
    with RecordingOpenAIServer(reply=script) as srv:
        [(r, bodies)] = run_questions(srv, [Q1], jump="planning")
    assert sequence(bodies) == ["planner", "executor×6", "expresser", "reviewer",
                                "planner", "executor×6", "expresser", "reviewer"]
    assert r["plans"] == 2 and r["verdicts"] == ["FAIL", "PASS"]
    assert len(r["findings"]) == 3  # the new plan replaced the old findings
    replan = [b for b in bodies if agent_of(b) == "planner"][1]
    assert "Review notes" in user_text(replan)


@pytest.mark.parametrize("jump", ["expressing", "planning"])
@pytest.mark.parametrize("reply, final", [("FAIL", "FAIL (rounds used up)"),
                                          ("I cannot decide.", "PASS (assumed: no verdict)")])
def test_at_most_two_rounds(jump, reply, final):
    with RecordingOpenAIServer(reply=Script(default_verdict=reply)) as srv:
        [(r, bodies)] = run_questions(srv, [Q1], jump=jump)
    assert r["rounds"] == 2 and len(r["verdicts"]) == 2 and r["final_verdict"] == final
    assert sum(agent_of(b) == "reviewer" for b in bodies) == 2
    assert sum(agent_of(b) == "expresser" for b in bodies) == 2
    assert sum(agent_of(b) == "planner" for b in bodies) == (2 if jump == "planning" else 1)


def test_unparsable_plan_falls_back_to_category_defaults():
    script = Script()

    def reply(body: dict[str, Any]) -> Any:  # a planner reply cut short / not JSON
        return "Sure! Let me think about this question carefully." if agent_of(body) == "planner" else script(body)
    with RecordingOpenAIServer(reply=reply) as srv:
        [(r, bodies)] = run_questions(srv, [Q2])
    assert r["plan_source"] == "default"
    assert r["sub_questions"] == peer.default_sub_questions("company_analysis", Q2.question)
    assert sum(agent_of(b) == "executor" for b in bodies) == 6


def test_an_executor_that_does_not_search_leaves_a_gap_not_an_error():
    script = Script()

    def reply(body: dict[str, Any]) -> Any:  # the model ignores the forced call (a truncated reply)
        return "I will search" if agent_of(body) == "executor" else script(body)
    with RecordingOpenAIServer(reply=reply) as srv:
        [(r, bodies)] = run_questions(srv, [Q1])
    assert r["final_verdict"] == "PASS" and r["findings"] == []
    assert sum(agent_of(b) == "executor" for b in bodies) == 3


def test_usage_callback_keys_by_langgraph_node():
    usage = UsageByAgent()
    with RecordingOpenAIServer(reply=Script(verdicts={Q2.question: ["FAIL", "PASS"]})) as srv:
        run_questions(srv, [Q1, Q2], callbacks=[usage])
    snap = usage.snapshot()
    # executor calls are filed under the executor, not its inner nodes
    assert {k: v.calls for k, v in snap.items()} == {"planner": 2, "executor": 14, "expresser": 3, "reviewer": 3}
    assert snap["executor"].prompt_tokens == 14  # the stub reports prompt_tokens=1 per call


def test_extract_usage_reads_cached_tokens_and_kvflow():
    from langchain_core.outputs import ChatGeneration, LLMResult
    from langchain_core.messages import AIMessage

    usage = {"prompt_tokens": 900, "completion_tokens": 20,
             "prompt_tokens_details": {"cached_tokens": 768}, "kvflow": {"hit": True, "prefetched_tokens": 512}}
    res = LLMResult(generations=[[ChatGeneration(message=AIMessage("x"))]], llm_output={"token_usage": usage})
    assert extract_usage(res) == usage
    h = UsageByAgent()
    import uuid
    rid = uuid.uuid4()
    h.on_chat_model_start({}, [[]], run_id=rid, metadata={"langgraph_node": "executor"})
    h.on_llm_end(res, run_id=rid)
    a = h.snapshot()["executor"]
    assert (a.cached_tokens, a.calls_with_hit, a.kvflow) == (768, 1, {"hit": 1.0, "prefetched_tokens": 512.0})


def test_usage_callback_counts_replies_cut_by_max_tokens():
    """A structured reply cut by ``max_tokens`` reaches LangChain as langchain-openai's
    ``LengthFinishReasonError`` (the openai client's), yet the server answered: its usage counts."""
    import uuid

    import openai
    from openai.types.chat import ChatCompletion

    completion = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": '{"sub_questions": ["Wh'}}],
        "usage": {"prompt_tokens": 700, "completion_tokens": 24, "total_tokens": 724,
                  "prompt_tokens_details": {"cached_tokens": 512}}})
    h = UsageByAgent()
    rid, other = uuid.uuid4(), uuid.uuid4()
    h.on_chat_model_start({}, [[]], run_id=rid, metadata={"langgraph_node": "planner"})
    h.on_llm_error(openai.LengthFinishReasonError(completion=completion), run_id=rid)
    h.on_chat_model_start({}, [[]], run_id=other, metadata={"langgraph_node": "planner"})
    h.on_llm_error(RuntimeError("connection reset"), run_id=other)   # no answer: not a call
    a = h.snapshot()["planner"]
    assert (a.calls, a.prompt_tokens, a.completion_tokens, a.cached_tokens) == (1, 700, 24, 512)


@pytest.mark.skipif(not HAS_ADAPTER, reason="kvflow_agents.adapters.langgraph not written yet")
@pytest.mark.parametrize("jump, retry", [("expressing", "expresser"), ("planning", "planner")])
def test_instrumented_requests_carry_kvflow_agent(jump, retry):
    with RecordingOpenAIServer(reply=Script(verdicts={Q1.question: ["FAIL", "PASS"]})) as srv:
        [(r, bodies)] = run_questions(srv, [Q1], jump=jump, instrument=True)
    assert r["final_verdict"] == "PASS"
    cps = [body.get("custom_params") or {} for body in bodies]
    for body, cp in zip(bodies, cps):
        name = "executor/agent" if agent_of(body) == "executor" else agent_of(body)
        assert cp.get("kvflow_agent") == name, cp
        assert cp.get("kvflow_fixed_messages") == 1  # exactly the leading system message
        assert cp["kvflow_ste"][name] == 0
    assert len({cp["kvflow_workflow"] for cp in cps}) == 1  # one workflow per question
    # an executor's first turn: its ToolNode is next
    first = [cp for body, cp in zip(bodies, cps) if agent_of(body) == "executor" and not searched(body)]
    assert len(first) == 3 * r["plans"]
    # (1 by the graph; 0 while a parallel sibling's search runs: they share the agent; more once
    # the learned model has seen the executors answer as often as search)
    assert first[0]["kvflow_ste"]["executor/tools"] == 1
    assert all(0 <= cp["kvflow_ste"]["executor/tools"] <= 3 for cp in first), [cp["kvflow_ste"] for cp in first]
    reading = [cp for body, cp in zip(bodies, cps) if agent_of(body) == "executor" and searched(body)]
    # reading: two steps after the search (its ToolNode took the step between); the expresser is
    # next by the graph, further by the learned STE (so far the agent always went on to search)
    assert reading and all(cp["kvflow_step"] == first[0]["kvflow_step"] + 2 for cp in reading[:3])
    assert all(1 <= cp["kvflow_ste"]["expresser"] < 10 for cp in reading)
    # the review loop is declared: while the reviewer runs, the retry target is close (one step
    # by the graph; the learned STE stretches it once the run has shown how the reviews go)
    rev = [cp for body, cp in zip(bodies, cps) if agent_of(body) == "reviewer"]
    assert rev[0]["kvflow_ste"][retry] == 1 and all(cp["kvflow_ste"][retry] <= 2 for cp in rev)


@pytest.mark.skipif(not HAS_ADAPTER, reason="kvflow_agents.adapters.langgraph not written yet")
def test_next_run_hints_name_the_next_questions_planner():
    """With ``next_run`` (questions one after another) the reviewer's hints put the planner one
    step away (the next question starts there once this one ends); without it the planner,
    which this run never reaches again, is unreachable."""
    def planner_ste(next_run):
        with RecordingOpenAIServer(reply=Script()) as srv:
            [(r, bodies)] = run_questions(srv, [Q1], instrument=True, next_run=next_run)
        assert r["final_verdict"] == "PASS"
        return {agent_of(b): b["custom_params"]["kvflow_ste"]["planner"] for b in bodies}
    on, off = planner_ste(True), planner_ste(False)
    assert on["reviewer"] == 1 and on["expresser"] == 2 and on["planner"] == 0
    assert off["reviewer"] is None and off["expresser"] is None and off["planner"] == 0


def test_uninstrumented_requests_carry_no_hints():
    with RecordingOpenAIServer(reply=Script()) as srv:
        [(_, bodies)] = run_questions(srv, [Q1], instrument=False)
    assert all("custom_params" not in b for b in bodies)


# -- the CLI (the embedded-server helper: test_peer_server_helper.py) ---------------------------

def test_cli_end_to_end_against_stub(capsys):
    from examples.peer_financial_qa.run import main

    with RecordingOpenAIServer(reply=Script(verdicts={Q1.question: ["FAIL", "PASS"]})) as srv:
        rc = main(["--base-url", srv.base_url, "--model", "stub", "--ids", "macro-01,co-01",
                   "--max-tokens", "32", "--seed", "1"])
        bodies = [r.body for r in srv.llm_requests()]
    out = capsys.readouterr().out
    assert rc == 0
    assert Q1.question[:40] in out and "FAIL (score 30) → PASS (score 80)" in out and "Per-agent usage" in out
    assert "Answer: Scripted draft answer." in out
    assert all(b.get("seed") == 1 for b in bodies)


def test_cli_reads_agentuniverse_questions_and_a_corpus_dir(tmp_path, capsys):
    from examples.peer_financial_qa.run import main

    au = tmp_path / "au.jsonl"
    au.write_text('{"text": "Why did Zeta Corp raise prices?"}\n')
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "zeta.txt").write_text("Zeta Corp raised prices by 4% because input costs rose.")
    script = Script()

    def reply(body: dict[str, Any]) -> Any:  # the executors search for the question's keywords
        if agent_of(body) == "executor" and not searched(body):
            return {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "search_corpus", "arguments": '{"query": "Zeta Corp prices"}'}}]}
        return script(body)
    with RecordingOpenAIServer(reply=reply) as srv:
        rc = main(["--base-url", srv.base_url, "--model", "stub", "--data", str(au), "--corpus",
                   str(tmp_path / "notes"), "--show-findings"])
        tool_results = [m["content"] for r in srv.llm_requests() for m in r.body["messages"] if m["role"] == "tool"]
    out = capsys.readouterr().out
    assert rc == 0 and "Why did Zeta Corp raise prices?" in out and "PASS (score 80)" in out
    assert tool_results and all(t.startswith("[zeta.txt#1] Zeta Corp raised prices") for t in tool_results)
