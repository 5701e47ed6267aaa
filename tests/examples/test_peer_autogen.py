"""The AutoGen GraphFlow version of the PEER example (examples/peer_financial_qa/autogen_app.py):
graph shape, request layout (fixed system prompt first, the LangGraph per-call user message
after it), fan-out in one step, the review loop for both jump targets, max_rounds, the hints on
the wire, the bench-shaped app and the CLI — a real GraphFlow against a real OpenAI-shaped HTTP
server (no model)."""

from __future__ import annotations

import json

import asyncio
import re
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")
pytest.importorskip("langgraph")        # the parsers live in app.py (LangGraph version)
pytest.importorskip("langchain_openai")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.peer_financial_qa import app as lg  # noqa: E402
from examples.peer_financial_qa import autogen_app as ag  # noqa: E402
from examples.peer_financial_qa import data, prompts  # noqa: E402
from kvflow_agents.testing import RecordingOpenAIServer  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BY_PROMPT = {v: k for k, v in prompts.SYSTEM_PROMPTS.items()}
QUESTIONS = data.load_questions()
Q1 = next(q for q in QUESTIONS if q.id == "macro-01")
Q2 = next(q for q in QUESTIONS if q.id == "co-01")


def role_of(body: dict[str, Any]) -> str:
    return BY_PROMPT.get(body["messages"][0]["content"], "?")


def user_text(body: dict[str, Any]) -> str:
    return body["messages"][1]["content"]


def plan_for(q: Any, n: int = 3) -> list[str]:
    name = q.question.split("'")[0].split()[-1]
    return [f"What is fact number {i} about {name} in this question?" for i in range(1, n + 1)]


class Script:
    """Scripted replies by role: a plan of ``n_subs`` sub-questions, a finding that names its
    sub-question, a draft numbered per call, and reviewer verdicts in order (then ``default``)."""

    def __init__(self, q: Any = Q1, verdicts: list[str] | None = None, default: str = "PASS", n_subs: int = 3) -> None:
        self.q, self.verdicts, self.default, self.n_subs = q, list(verdicts or []), default, n_subs
        self.drafts = 0

    def __call__(self, body: dict[str, Any]) -> str:
        role = role_of(body)
        if role == "planner":
            return str(plan_for(self.q, self.n_subs)).replace("'", '"')
        if role == "executor":
            sub = user_text(body).splitlines()[0].removeprefix("Sub-question: ")
            if body.get("tools") and not any(m["role"] == "tool" for m in body["messages"]):
                # the LangGraph executor searches first (AutoGen's searches in its model context)
                return {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "search_corpus", "arguments": json.dumps({"query": sub})}}]}
            return f"Finding for: {sub} [S1]"
        if role == "expresser":
            self.drafts += 1
            return f"Draft {self.drafts}: the answer [S1]."
        if role == "reviewer":
            v = self.verdicts.pop(0) if self.verdicts else self.default
            return v if v.startswith("VERDICT") or v == "" else f"VERDICT: {v}\nNotes for {v}."
        return "?"


def run_ag(srv: RecordingOpenAIServer, question: Any = Q1, *, instrument: bool = True,
           next_run: bool = False, **team_kw: Any) -> dict:
    client = ag.make_client(base_url=srv.base_url, model="stub", max_tokens=32, seed=1)
    team, instrumented = ag.instrument_team(ag.build_team(client, **team_kw), instrument=instrument,
                                            next_run=next_run)
    assert instrumented == instrument

    async def go() -> dict:
        try:
            return await ag.run_question(team, question)
        finally:
            await client.close()

    result = asyncio.run(go())
    result["team"] = team
    return result


def sent(srv: RecordingOpenAIServer) -> list[tuple[str, dict, dict]]:
    """(role by system prompt, body, hints) of every LLM request, in arrival order."""
    return [(role_of(r.body), r.body, r.hints or {}) for r in srv.llm_requests()]


def agent_sequence(reqs) -> list[str]:
    """One entry per step: the agents (hinted names) that ran in it."""
    steps: dict[int, list[str]] = {}
    for _role, _body, h in reqs:
        steps.setdefault(h["kvflow_step"], []).append(h["kvflow_agent"])
    return ["+".join(sorted(v)) for _k, v in sorted(steps.items())]


EXEC3 = "executor_1+executor_2+executor_3"


# ------------------------------------------------------------------------------------ structure
def test_graph_shape_fixed_fanout_all_join_and_review_loop():
    client = ag.make_client(base_url="http://127.0.0.1:9/v1", model="stub")
    team = ag.build_team(client)
    g = team._graph
    assert [p.name for p in team._participants] == ["planner", *ag.executor_names(3), "expresser", "reviewer", "final"]
    assert g.get_start_nodes() == {"planner"} and g.get_leaf_nodes() == {"final"}
    into_expresser = [(n.name, e) for n in g.nodes.values() for e in n.edges if e.target == "expresser"]
    groups = {(e.activation_group, e.activation_condition) for _s, e in into_expresser}
    assert groups == {(ag.FINDINGS_GROUP, "all"), (ag.RETRY_GROUP, "any")}
    assert sorted(s for s, e in into_expresser if e.activation_group == ag.FINDINGS_GROUP) == ag.executor_names(3)
    review_edges = {e.target: e for e in g.nodes["reviewer"].edges}
    assert set(review_edges) == {"expresser", "final"}
    assert all(e.condition_function is not None for e in review_edges.values())
    # every LLM agent: the fixed prompt as its system message, the shared client
    for p in team._participants:
        if p.name != "final":
            assert p._system_messages[0].content == prompts.SYSTEM_PROMPTS[ag.role_of(p.name)]
            assert p._model_client is client
    planning = ag.build_team(client, jump="planning", executors=5)
    assert {e.target for e in planning._graph.nodes["reviewer"].edges} == {"planner", "final"}
    assert len([p for p in planning._participants if p.name.startswith("executor_")]) == 5
    for bad in ({"jump": "nowhere"}, {"max_rounds": 0}, {"executors": 2}, {"executors": 6}):
        with pytest.raises(ValueError):
            ag.build_team(client, **bad)
    # the instrumented ASG: one all-join of the executors into the expresser
    team, _ = ag.instrument_team(ag.build_team(client))
    asg = team.kvflow_graph
    assert asg.joins("expresser") == [ag.executor_names(3)]
    assert asg.entry_agents == ["planner"]
    asyncio.run(client.close())


# ---------------------------------------------------------------------------- the default loop
def test_next_run_hints_name_the_next_questions_planner():
    """``instrument_team(next_run=True)``: while the reviewer runs, the next question's planner
    is one step after the team's ``final`` agent (the last before END); without it the planner
    is unreachable (None on the wire)."""
    def by_role(next_run):
        with RecordingOpenAIServer(reply=Script(verdicts=["PASS"])) as srv:
            r = run_ag(srv, next_run=next_run)
            reqs = sent(srv)
        assert r["final_verdict"] == "PASS"
        return {role: (h["kvflow_ste"]["planner"], h["kvflow_ste"]["final"]) for role, _body, h in reqs}
    on, off = by_role(True), by_role(False)
    planner, final = on["reviewer"]
    assert final >= 1 and planner == final + 1 and on["planner"][0] == 0
    assert on["expresser"][0] == on["expresser"][1] + 1
    assert off["reviewer"][0] is None and off["expresser"][0] is None


def test_default_jump_fail_goes_back_to_expresser_with_layout_and_hints():
    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL", "PASS"])) as srv:
        r = run_ag(srv)
        reqs = sent(srv)
    team = r["team"]
    assert agent_sequence(reqs) == ["planner", EXEC3, "expresser", "reviewer", "expresser", "reviewer"]
    assert r["verdicts"] == ["FAIL", "PASS"] and r["rounds"] == 2 and r["final_verdict"] == "PASS"
    assert r["answer"] == "Draft 2: the answer [S1]." and r["plans"] == 1 and r["plan_source"] == "json"
    assert r["sub_questions"] == plan_for(Q1) and [f["index"] for f in r["findings"]] == [0, 1, 2]
    assert r["stop_reason"] and r["messages"][-1] == ("final", r["answer"])
    for role, body, h in reqs:
        # the fixed prompt first, byte-identical; then exactly one per-call user message
        assert [m["role"] for m in body["messages"]] == ["system", "user"]
        assert body["messages"][0]["content"] == prompts.SYSTEM_PROMPTS[role]
        assert "name" not in body["messages"][1]
        assert body["max_tokens"] == 32 and body["seed"] == 1
        # hints: the agent's own name, the team as the workflow, the system message as fixed prefix
        assert ag.role_of(h["kvflow_agent"]) == role
        assert h["kvflow_workflow"] == team._team_id and h["kvflow_app"] == ag.APP_ID
        assert h["kvflow_fixed_messages"] == 1
    execs = [(body, h) for role, body, h in reqs if role == "executor"]
    for body, h in execs:  # executor_i got sub-question i
        i = int(h["kvflow_agent"].split("_")[1]) - 1
        assert user_text(body).startswith(f"Sub-question: {plan_for(Q1)[i]}\n")
        assert "\n\nsearch_corpus results:\n[" in user_text(body)  # BM25 over the corpus
        assert h["kvflow_ste"]["expresser"] == 1 and h["kvflow_ste"]["planner"] is None  # never again
        assert h["kvflow_ste"]["reviewer"] == 2
    assert len({h["kvflow_step"] for _b, h in execs}) == 1
    # the second expresser call revises: previous draft and review notes after the findings
    expr = [body for role, body, _h in reqs if role == "expresser"]
    assert "Your previous draft:\nDraft 1" not in user_text(expr[0])
    assert "Your previous draft:\nDraft 1: the answer [S1].\n\nReview notes to address:\nVERDICT: FAIL" in user_text(expr[1])
    # the planner's message is the LangGraph one
    assert user_text(reqs[0][1]) == prompts.planner_user(Q1.question, Q1.category)


def test_jump_planning_fail_goes_back_to_planner():
    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL", "PASS"])) as srv:
        r = run_ag(srv, jump="planning")
        reqs = sent(srv)
    assert agent_sequence(reqs) == ["planner", EXEC3, "expresser", "reviewer",
                                    "planner", EXEC3, "expresser", "reviewer"]
    assert r["plans"] == 2 and r["verdicts"] == ["FAIL", "PASS"] and r["final_verdict"] == "PASS"
    planner2 = [body for role, body, _h in reqs if role == "planner"][1]
    assert "A previous answer was rejected. Review notes:\nVERDICT: FAIL" in user_text(planner2)
    # with jump=planning the planner is 4 steps past the executors (exec→expr→rev→planner)
    ste = [h["kvflow_ste"] for role, _b, h in reqs if role == "executor"][0]
    assert ste["expresser"] == 1 and ste["planner"] is not None and ste["planner"] >= 3


@pytest.mark.parametrize("max_rounds,reply,final,jump,k", [
    (1, "FAIL", "FAIL (rounds used up)", "expressing", 3),
    (2, "FAIL", "FAIL (rounds used up)", "expressing", 3),
    (3, "FAIL", "FAIL (rounds used up)", "expressing", 4),
    (2, "VERDICT? no idea", "PASS (assumed: no verdict)", "expressing", 3),
    (3, "FAIL", "FAIL (rounds used up)", "planning", 5),   # the longest run fits in max_turns
])
def test_at_most_max_rounds(max_rounds, reply, final, jump, k):
    with RecordingOpenAIServer(reply=Script(default=f"VERDICT: {reply}" if reply == "FAIL" else "no verdict")) as srv:
        r = run_ag(srv, max_rounds=max_rounds, jump=jump, executors=k)
        roles = Counter(role for role, _b, _h in sent(srv))
    plans = max_rounds if jump == "planning" else 1
    assert r["rounds"] == max_rounds and roles["reviewer"] == max_rounds and roles["expresser"] == max_rounds
    assert roles["planner"] == plans and roles["executor"] == k * plans
    assert r["final_verdict"] == final and r["messages"][-1][0] == "final"
    assert r["stop_reason"] == "Digraph execution is complete"


def test_pass_at_first_review_ends_after_one_round():
    with RecordingOpenAIServer(reply=Script(verdicts=["PASS"])) as srv:
        r = run_ag(srv, jump="planning", max_rounds=3)
        reqs = sent(srv)
    assert agent_sequence(reqs) == ["planner", EXEC3, "expresser", "reviewer"] and r["rounds"] == 1


# ---------------------------------------------------------------------- the same requests as LangGraph
def _requests(reqs) -> Counter:
    """The [system, user] pairs of the planner, expresser and reviewer requests."""
    return Counter(tuple((m["role"], m["content"]) for m in body["messages"])
                   for r, body, _h in reqs if r != "executor")


def _executor_evidence(reqs) -> Counter:
    """What each executor read: AutoGen's in its user message, LangGraph's as the tool result."""
    out: Counter = Counter()
    for r, body, _h in reqs:
        if r != "executor":
            continue
        msgs = body["messages"]
        if msgs[-1]["role"] == "tool":
            out[(msgs[1]["content"], msgs[-1]["content"])] += 1
        elif msgs[-1]["role"] == "user" and "search_corpus results:" in msgs[-1]["content"]:
            task, _, results = msgs[-1]["content"].partition("\n\nsearch_corpus results:\n")
            out[(task, results)] += 1
    return out


@pytest.mark.parametrize("jump", ["expressing", "planning"])
def test_same_messages_as_the_langgraph_version(jump):
    """Same scripted model, same question: the planner, expresser and reviewer requests are the
    same multiset of [system, user] pairs (the executors' arrival order is not), and each
    executor read the same passages (LangGraph: its search_corpus call; AutoGen: in its context)."""
    with RecordingOpenAIServer(reply=Script(Q2, verdicts=["FAIL", "PASS"])) as srv:
        run_ag(srv, Q2, jump=jump, instrument=False)
        autogen_reqs = sent(srv)
    with RecordingOpenAIServer(reply=Script(Q2, verdicts=["FAIL", "PASS"])) as srv:
        llm = lg.make_llm(base_url=srv.base_url, model="stub", max_tokens=32, seed=1)
        app, _ = lg.compile_app(lg.build_graph(llm, jump=jump, max_rounds=2), instrument=False)
        out = app.invoke(lg.initial_state(Q2), config={"recursion_limit": 64})
        langgraph_reqs = sent(srv)
    assert out["verdicts"] == ["FAIL", "PASS"]
    n_exec = 6 if jump == "planning" else 3
    assert len(autogen_reqs) == (12 if jump == "planning" else 8) == len(langgraph_reqs) - n_exec
    assert _requests(autogen_reqs) == _requests(langgraph_reqs)
    assert sum(_executor_evidence(autogen_reqs).values()) == n_exec
    assert _executor_evidence(autogen_reqs) == _executor_evidence(langgraph_reqs)


# ------------------------------------------------------------------------------ fan-out padding
def test_fixed_fanout_pads_and_truncates_the_plan():
    subs, source = ag.plan_for_executors('["Only one sub-question about Arcadia here?"]', "macro", Q1.question, 5)
    assert len(subs) == 5 and len({s.lower() for s in subs}) == 5 and source == "json+default"
    assert subs[1:4] == lg.default_sub_questions("macro", Q1.question)
    subs, _ = ag.plan_for_executors(str(plan_for(Q1, 5)).replace("'", '"'), "macro", Q1.question, 3)
    assert subs == plan_for(Q1, 3)  # beyond k: dropped
    subs, source = ag.plan_for_executors("no plan at all", "reports", Q1.question, 3)
    assert subs == lg.default_sub_questions("reports", Q1.question) and source == "default"


def test_five_executors_each_get_their_own_sub_question():
    with RecordingOpenAIServer(reply=Script(n_subs=2)) as srv:
        r = run_ag(srv, executors=5)
        reqs = sent(srv)
    execs = {h["kvflow_agent"]: user_text(body).splitlines()[0] for role, body, h in reqs if role == "executor"}
    assert sorted(execs) == ag.executor_names(5) and len(set(execs.values())) == 5
    assert len({h["kvflow_step"] for role, _b, h in reqs if role == "executor"}) == 1
    assert r["plan_source"] == "json+default" and len(r["findings"]) == 5


# ------------------------------------------------------------------------------ runs and threads
def test_team_is_reset_between_questions_and_plain_text_tasks_work():
    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL", "PASS", "PASS"])) as srv:
        client = ag.make_client(base_url=srv.base_url, model="stub")
        team, _ = ag.instrument_team(ag.build_team(client))

        async def go():
            try:
                return [await ag.run_question(team, Q1), await ag.run_question(team, "Why is the sky blue?")]
            finally:
                await client.close()

        r1, r2 = asyncio.run(go())
        reqs = sent(srv)
    assert r1["rounds"] == 2 and r2["rounds"] == 1 and r2["question"] == "Why is the sky blue?"
    second = reqs[8:]
    assert agent_sequence(second) == ["planner", EXEC3, "expresser", "reviewer"]
    assert all(Q1.question not in user_text(body) for _r, body, _h in second)
    assert user_text(second[0][1]) == prompts.planner_user("Why is the sky blue?", "macro")


def test_fold_thread_follows_plans_findings_and_reviews():
    task = ag.task_message(Q1)
    assert ag.parse_task(task)["background"] == list(Q1.background) and ag.parse_task("plain") is None
    st = ag.fold_thread([("user", task), ("planner", "garbage"), ("executor_2", " two "), ("executor_1", "one"),
                         ("expresser", "d1"), ("reviewer", "VERDICT: FAIL"), ("planner", '["a b c d e f g h?"]')], 3)
    assert st.plans == 2 and st.findings == {} and st.verdicts == ["FAIL"] and st.rounds == 1
    assert st.sub_questions[0] == "a b c d e f g h?" and st.plan_source == "json+default"
    st = ag.fold_thread([("user", task), ("planner", ""), ("executor_2", " two "), ("executor_1", "")], 3)
    assert st.ordered_findings() == ["(no findings)", "two"]
    st = ag.fold_thread([("user", task), ("reviewer", "VERDICT: PASS"), ("user", ag.task_message(Q2))], 3)
    assert st.qid == Q2.id and st.rounds == 0  # a new task starts over


def test_uninstrumented_requests_carry_no_hints():
    with RecordingOpenAIServer(reply=Script()) as srv:
        run_ag(srv, instrument=False)
        reqs = srv.llm_requests()
    assert len(reqs) == 6 and all("custom_params" not in r.body for r in reqs)


# ------------------------------------------------------------------------------ bench / CLI shape
def _opts(**kw: Any) -> Any:
    try:
        from kvflow_agents.bench.peer import PeerOptions
    except ImportError:
        return SimpleNamespace(**{"jump": "expressing", "max_rounds": 2, "max_tokens": 48, "seed": 0, **kw})
    return PeerOptions(**kw)


def test_bench_shaped_app_records_calls_per_role():
    pytest.importorskip("kvflow_agents.bench.workload")
    seen: list[Any] = []
    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL", "PASS"])) as srv:
        app = ag.AutoGenPeerApp(srv.base_url, "stub", _opts(max_tokens=16), None, on_call=seen.append)
        try:
            dt_warm = app.ask(Q1, -1, "external", False)
            asyncio.run(asyncio.sleep(0))  # the bench reads metrics with asyncio.run in between
            dt = app.ask(Q2, 0, "external", True)
        finally:
            app.close()
        bodies = [r.body for r in srv.llm_requests()]
    assert app.instrumented and dt > 0 and dt_warm > 0
    assert [a["question"] for a in app.answers] == ["macro-01", "co-01"]
    assert app.answers[0]["verdicts"] == ["FAIL", "PASS"] and app.answers[1]["verdicts"] == ["PASS"]
    assert app.answers[1]["executors"] == 3 and app.answers[1]["error"] is None
    calls = app.capture.calls
    assert len(calls) == len(seen) == 8 + 6 and all(c.ok and c.prompt_tokens == 1 for c in calls)
    assert Counter(c.agent for c in calls if c.measured) == {"planner": 1, "executor": 3, "expresser": 1, "reviewer": 1}
    assert {c.workflow for c in calls} == {-1, 0}
    assert len(app.result.rounds) == 2 and app.result.measured_s == pytest.approx(dt)
    assert all(b["max_tokens"] == 16 and b["seed"] == 0 for b in bodies)
    # a fresh team (workflow) per question
    assert len({b["custom_params"]["kvflow_workflow"] for b in bodies}) == 2


def test_bench_asks_measured_questions_on_a_collected_frozen_heap():
    """``kvflow bench peer`` (here against an external stub server): the warm-up question runs
    as usual, each measured one on a collected, frozen client heap, nothing frozen after."""
    import gc

    from kvflow_agents.bench.peer import run_peer_bench

    frozen: list[int] = []
    with RecordingOpenAIServer(reply=Script(verdicts=["PASS"])) as srv:
        out = run_peer_bench([Q2], [Q1], _opts(framework="autogen", max_tokens=8), ["external"], None,
                             base_url=srv.base_url, model="stub",
                             progress=lambda what, n: frozen.append(gc.get_freeze_count())
                             if what.startswith("advance:") else None)
    calls = out[0].workload["calls"]
    assert len(frozen) == 12 and calls == 6  # warm-up question: 6 calls, then the measured one
    assert all(n == 0 for n in frozen[:6]) and all(n > 0 for n in frozen[6:])
    assert gc.get_freeze_count() == 0


def test_run_peer_autogen_returns_per_question_records():
    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL"], default="PASS")) as srv:
        out = asyncio.run(ag.run_peer_autogen(srv.base_url, "stub", [Q1, Q2], jump="planning",
                                              max_rounds=2, max_tokens=8))
    assert [o["id"] for o in out] == ["macro-01", "co-01"]
    assert out[0]["rounds"] == 2 and out[0]["verdicts"] == ["FAIL", "PASS"] and out[0]["calls"] == 12
    assert out[1]["rounds"] == 1 and out[1]["error"] is None and all(o["latency_s"] > 0 for o in out)


def test_cli_framework_autogen_end_to_end(capsys):
    from examples.peer_financial_qa.run import main

    with RecordingOpenAIServer(reply=Script(verdicts=["FAIL", "PASS"])) as srv:
        rc = main(["--framework", "autogen", "--base-url", srv.base_url, "--model", "stub", "--ids", "macro-01",
                   "--max-tokens", "32", "--seed", "1", "--cache-poll", "0", "--show-findings"])
        bodies = [r.body for r in srv.llm_requests()]
    out = capsys.readouterr().out
    assert rc == 0, out
    assert Q1.question[:40] in out and "FAIL → PASS" in out and "Per-agent usage" in out
    assert "autogen: model stub" in out and "instrumented=True" in out
    assert re.search(r"executor\s+│\s+3\b", out), out  # executors merged into one usage row
    assert len(bodies) == 8 and all(b["max_tokens"] == 32 and b["seed"] == 1 for b in bodies)
