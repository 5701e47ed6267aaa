"""The PEER financial-QA example (examples/peer_financial_qa): data, prompt layout, graph shape
(fan-out, barrier, review loop), parsing fallbacks, usage accounting, the server helper, and the
CLI — all against a real LangGraph graph and a real OpenAI-shaped HTTP server (no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
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
from examples.peer_financial_qa.server import EmbeddedServer, ServerStartError  # noqa: E402
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
    return "\n".join(m["content"] for m in body["messages"][1:] if isinstance(m.get("content"), str))


def question_of(body: dict[str, Any]) -> str | None:
    text = user_text(body)
    return next((q for q in N_SUBS if q in text), None)


class Script:
    """Scripted replies: planner JSON (3 or 4 sub-questions), reviewer verdicts per question."""

    def __init__(self, verdicts: dict[str, list[str]] | None = None, default_verdict: str = "PASS") -> None:
        self.verdicts = {k: list(v) for k, v in (verdicts or {}).items()}
        self.default_verdict = default_verdict

    def __call__(self, body: dict[str, Any]) -> str:
        agent = agent_of(body)
        if agent == "planner":
            q = question_of(body) or ""
            return json.dumps([f"Sub-question {i + 1} about {q[:30]} inflation energy margin?"
                               for i in range(N_SUBS.get(q, 3))])
        if agent == "reviewer":
            queue = self.verdicts.get(question_of(body) or "", [])
            v = queue.pop(0) if queue else self.default_verdict
            return f"VERDICT: {v}\nReasons:\n- scripted" if v in ("PASS", "FAIL") else v
        if agent == "executor":
            return "Sub-question: x\nFindings:\n- a fact [S1].\nGaps: none\nConfidence: high - scripted"
        return "Answer: scripted draft.\nKey points:\n- a\nRisks and what to watch:\n- b"


def run_questions(srv: RecordingOpenAIServer, questions: list[data.Question], *, jump: str = "expressing",
                  instrument: bool = False, callbacks: list[Any] | None = None
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Run each question through the compiled graph; ``[(final_state, request_bodies)]``."""
    llm = peer.make_llm(base_url=srv.base_url, model="stub", api_key="x", max_tokens=64,
                        callbacks=callbacks)
    app, _ = peer.compile_app(peer.build_graph(llm, jump=jump, max_rounds=2), instrument=instrument)
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


# -- data and prompts ---------------------------------------------------------------------------

def test_data_file_has_40_valid_questions_across_5_categories():
    assert len(QUESTIONS) >= 40
    counts = {c: sum(q.category == c for q in QUESTIONS) for c in data.CATEGORIES}
    assert set(counts) == {"macro", "markets", "company_analysis", "policy", "reports"}
    assert all(n >= 6 for n in counts.values()), counts
    assert len({q.id for q in QUESTIONS}) == len(QUESTIONS)
    for q in QUESTIONS:
        assert 3 <= len(q.background) <= 5 and q.question.endswith("?")
        assert all(40 <= len(s) <= 600 for s in q.background), q.id


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "x", "category": "macro", "question": "q?"}', "missing field(s) background"),
    ('{"id": "x", "category": "crypto", "question": "q?", "background": ["a", "b", "c"]}', "category 'crypto'"),
    ('{"id": "x", "category": "macro", "question": "q?", "background": ["a"]}', "3-5 snippets"),
    ('{"id": "x", "category": "macro", "question": "", "background": ["a", "b", "c"]}', "'question'"),
])
def test_loader_reports_bad_line(tmp_path, line, message):
    good = json.dumps({"id": "ok-1", "category": "macro", "question": "Q?", "background": ["a", "b", "c"]})
    f = tmp_path / "q.jsonl"
    f.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(data.DataError) as e:
        data.load_questions(f)
    assert "q.jsonl:3" in str(e.value) and message in str(e.value)


def test_loader_rejects_duplicate_ids(tmp_path):
    good = json.dumps({"id": "ok-1", "category": "macro", "question": "Q?", "background": ["a", "b", "c"]})
    f = tmp_path / "q.jsonl"
    f.write_text(good + "\n" + good + "\n")
    with pytest.raises(data.DataError, match="duplicate id 'ok-1'"):
        data.load_questions(f)


def test_select_round_robin_ids_and_category():
    first5 = data.select(QUESTIONS, n=5)
    assert [q.category for q in first5] == list(data.CATEGORIES)
    assert [q.id for q in data.select(QUESTIONS, ids=["co-02", "macro-01"])] == ["co-02", "macro-01"]
    assert {q.category for q in data.select(QUESTIONS, category="company")} == {"company_analysis"}
    with pytest.raises(ValueError, match="unknown question id"):
        data.select(QUESTIONS, ids=["nope"])


def test_fixed_prompts_are_large_and_static():
    for name, text in prompts.SYSTEM_PROMPTS.items():
        assert 4000 <= len(text) <= 8000, (name, len(text))
        for q in QUESTIONS:  # no per-call variable leaked into a fixed prompt
            assert q.question not in text
    assert '["' in prompts.PLANNER_SYSTEM and "VERDICT: PASS" in prompts.REVIEWER_SYSTEM


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


def test_pick_snippets_by_keyword_overlap():
    bg = list(Q1.background)
    labels = [lbl for lbl, _ in peer.pick_snippets("How did the crown exchange rate move?", bg)]
    assert labels == ["S4"]
    picked = peer.pick_snippets("Zebra?", bg)  # no overlap: the first two
    assert [lbl for lbl, _ in picked] == ["S1", "S2"] and picked[0][1] == bg[0]


# -- the graph against an OpenAI-shaped server ---------------------------------------------------

def test_graph_shape_declares_executor_target_and_review_loop():
    b = peer.build_graph(object())
    assert set(b.nodes) == {"planner", "executor", "expresser", "reviewer"}
    assert ("executor", "expresser") in b.edges and ("expresser", "reviewer") in b.edges
    assert set(b.branches["planner"]["fan_out"].ends.values()) == {"executor"}
    assert set(b.branches["reviewer"]["after_review"].ends.values()) == {"expresser", "__end__"}
    bp = peer.build_graph(object(), jump="planning")
    assert set(bp.branches["reviewer"]["after_review"].ends.values()) == {"planner", "__end__"}
    with pytest.raises(ValueError):
        peer.build_graph(object(), jump="executing")


def test_default_jump_messages_fanout_and_review_loop():
    script = Script(verdicts={Q2.question: ["FAIL", "PASS"]})
    with RecordingOpenAIServer(reply=script) as srv:
        (r1, b1), (r2, b2) = run_questions(srv, [Q1, Q2])

    # every request: [fixed system prompt, user message with the per-call variables]
    for body in b1 + b2:
        msgs = body["messages"]
        assert agent_of(body) in prompts.SYSTEM_PROMPTS
        assert msgs[0]["role"] == "system" and [m["role"] for m in msgs[1:]] == ["user"]
        assert msgs[0]["content"] in prompts.SYSTEM_PROMPTS.values()  # byte-identical fixed prefix
        for q in (Q1, Q2):
            assert q.question not in msgs[0]["content"]
            assert not any(s in msgs[0]["content"] for s in q.background)
    for body in b1:
        if agent_of(body) != "executor":  # executors see only their sub-question
            assert Q1.question in user_text(body)
        else:
            assert "Sub-question" in user_text(body) and "[S" in user_text(body)

    # Q1: 3 sub-questions -> 3 executors -> one expresser -> PASS
    assert sequence(b1) == ["planner", "executor×3", "expresser", "reviewer"]
    assert len(r1["sub_questions"]) == 3 and r1["verdicts"] == ["PASS"] and r1["final_verdict"] == "PASS"
    assert len(r1["findings"]) == 3
    # Q2: 4 executors; FAIL -> back to the expresser (not the planner) -> PASS
    assert sequence(b2) == ["planner", "executor×4", "expresser", "reviewer", "expresser", "reviewer"]
    assert r2["verdicts"] == ["FAIL", "PASS"] and r2["rounds"] == 2 and r2["plans"] == 1
    # the revision carries the previous draft and the review notes, in the user message
    revision = [b for b in b2 if agent_of(b) == "expresser"][1]
    assert "Review notes to address" in user_text(revision) and "scripted" in user_text(revision)
    assert "Review notes" not in user_text([b for b in b2 if agent_of(b) == "expresser"][0])


def test_jump_planning_goes_back_to_planner():
    script = Script(verdicts={Q1.question: ["FAIL", "PASS"]})
    with RecordingOpenAIServer(reply=script) as srv:
        [(r, bodies)] = run_questions(srv, [Q1], jump="planning")
    assert sequence(bodies) == ["planner", "executor×3", "expresser", "reviewer",
                                "planner", "executor×3", "expresser", "reviewer"]
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
    def reply(body: dict[str, Any]) -> str:
        return "Sure! Let me think about this question carefully." if agent_of(body) == "planner" \
            else "VERDICT: PASS" if agent_of(body) == "reviewer" else "text"
    with RecordingOpenAIServer(reply=reply) as srv:
        [(r, bodies)] = run_questions(srv, [Q2])
    assert r["plan_source"] == "default"
    assert r["sub_questions"] == peer.default_sub_questions("company_analysis", Q2.question)
    assert sum(agent_of(b) == "executor" for b in bodies) == 3


def test_usage_callback_keys_by_langgraph_node():
    usage = UsageByAgent()
    with RecordingOpenAIServer(reply=Script(verdicts={Q2.question: ["FAIL", "PASS"]})) as srv:
        run_questions(srv, [Q1, Q2], callbacks=[usage])
    snap = usage.snapshot()
    assert {k: v.calls for k, v in snap.items()} == {"planner": 2, "executor": 7, "expresser": 3, "reviewer": 3}
    assert snap["executor"].prompt_tokens == 7  # the stub reports prompt_tokens=1 per call


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


@pytest.mark.skipif(not HAS_ADAPTER, reason="kvflow_agents.adapters.langgraph not written yet")
@pytest.mark.parametrize("jump, retry", [("expressing", "expresser"), ("planning", "planner")])
def test_instrumented_requests_carry_kvflow_agent(jump, retry):
    with RecordingOpenAIServer(reply=Script(verdicts={Q1.question: ["FAIL", "PASS"]})) as srv:
        [(r, bodies)] = run_questions(srv, [Q1], jump=jump, instrument=True)
    assert r["final_verdict"] == "PASS"
    cps = [body.get("custom_params") or {} for body in bodies]
    for body, cp in zip(bodies, cps):
        assert cp.get("kvflow_agent") == agent_of(body), cp
        assert cp.get("kvflow_fixed_messages") == 1  # exactly the leading system message
        assert cp["kvflow_ste"][agent_of(body)] == 0
    assert len({cp["kvflow_workflow"] for cp in cps}) == 1  # one workflow per question
    # the parallel executors share one step; the barrier's successor is one step away
    ex = [cp for body, cp in zip(bodies, cps) if agent_of(body) == "executor"]
    steps = [cp["kvflow_step"] for cp in ex]
    assert len(ex) == 3 * r["plans"] and all(steps.count(st) == 3 for st in steps)
    assert all(cp["kvflow_ste"]["expresser"] == 1 for cp in ex)
    # the review loop is declared: while the reviewer runs, the retry target is one step away
    rev = [cp for body, cp in zip(bodies, cps) if agent_of(body) == "reviewer"]
    assert all(cp["kvflow_ste"][retry] == 1 for cp in rev)


def test_uninstrumented_requests_carry_no_hints():
    with RecordingOpenAIServer(reply=Script()) as srv:
        [(_, bodies)] = run_questions(srv, [Q1], instrument=False)
    assert all("custom_params" not in b for b in bodies)


# -- the embedded-server helper and the CLI -------------------------------------------------------

def _fake_server(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "fake_serve.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_server_helper_reports_early_exit_with_log_tail(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys
        print("loading model", sys.argv[sys.argv.index('--model') + 1], file=sys.stderr)
        print("RuntimeError: weights not found", file=sys.stderr)
        sys.exit(7)
    """)
    with pytest.raises(ServerStartError) as e:
        EmbeddedServer("tiny", command=cmd, timeout_s=20).start()
    msg = str(e.value)
    assert "exited with code 7" in msg and "weights not found" in msg and "loading model tiny" in msg


def test_server_helper_times_out_with_log_tail(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys, time
        print("still compiling kernels...", file=sys.stderr, flush=True)
        time.sleep(30)
    """)
    srv = EmbeddedServer("tiny", command=cmd, timeout_s=1.0)
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert "not healthy after" in str(e.value) and "still compiling kernels" in str(e.value)
    assert srv.proc is None  # stopped


def test_server_helper_waits_for_health_and_stops(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys, time
        from http.server import BaseHTTPRequestHandler, HTTPServer
        port = int(sys.argv[sys.argv.index('--port') + 1])
        time.sleep(0.5)
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == '/health' else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        HTTPServer(('127.0.0.1', port), H).serve_forever()
    """)
    with EmbeddedServer("tiny", command=cmd, timeout_s=20) as srv:
        proc = srv.proc
        assert proc is not None and proc.poll() is None
        assert srv.base_url.endswith("/v1")
    assert proc.poll() is not None


def test_cli_end_to_end_against_stub(capsys):
    from examples.peer_financial_qa.run import main

    with RecordingOpenAIServer(reply=Script(verdicts={Q1.question: ["FAIL", "PASS"]})) as srv:
        rc = main(["--base-url", srv.base_url, "--model", "stub", "--ids", "macro-01,co-01",
                   "--max-tokens", "32", "--seed", "1"])
        bodies = [r.body for r in srv.llm_requests()]
    out = capsys.readouterr().out
    assert rc == 0
    assert Q1.question[:40] in out and "FAIL → PASS" in out and "Per-agent usage" in out
    assert all(b.get("max_tokens") == 32 or b.get("max_completion_tokens") == 32 for b in bodies)
    assert all(b.get("seed") == 1 for b in bodies)
