"""``kvflow bench peer``: the PEER example as the workload, against a recording server (the
wiring: hints, calls per agent) and on embedded servers started per question
(``--fresh-servers``). No timed assertions: only shapes, fields and invariants."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvflow_agents.cli.main import app
from kvflow_agents.testing import RecordingOpenAIServer


def _recorded_peer_run(out) -> tuple[dict, list]:
    """One PEER question (LangGraph) against a recording server whose planner asks three
    sub-questions: the ``--json`` document and the LLM requests the server saw."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    with RecordingOpenAIServer(reply=lambda body: '["What is A?", "What is B?", "What is C?"]') as srv:
        r = CliRunner().invoke(app, [
            "bench", "peer", "--base-url", srv.base_url, "--served-model", "stub", "--questions", "1",
            "--warmup-questions", "0", "--max-rounds", "1", "--json", str(out), "--no-progress"],
            env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        return json.loads(out.read_text()), srv.llm_requests()


def test_peer_bench_wiring_against_a_recording_server(tmp_path):
    doc, reqs = _recorded_peer_run(tmp_path / "peer.json")
    w = doc["policies"]["external"]["workload"]
    assert w["instrumented"] is True and w["workflow_rounds"] == 1 and w["errors"] == 0
    assert w["calls_per_agent"] == {"planner": 1, "executor": 3, "expresser": 1, "reviewer": 1}
    assert {q.hints["kvflow_agent"] for q in reqs} == {"planner", "executor/agent", "expresser", "reviewer"}
    assert doc["targets"] == []  # an external server is not judged against the targets
    # the work the question ran, per answer: its calls and the tokens they decoded (the
    # recording server reports one completion token per call)
    (ans,) = w["answers"]
    assert ans["calls"] == len(reqs) == 6 and ans["output_tokens"] == w["completion_tokens"] == 6
    assert doc["work_differences"] == []


def test_peer_report_names_the_questions_whose_answers_diverged(tmp_path):
    """Greedy decoding depends on what shares a batch, so a policy's answer can diverge and
    its question then measures other work: ``bench show`` names it against the oracle and the
    JSON lists it (``work_differences``). A recorded run's answers stand for three policies,
    one of which decoded more tokens on the question."""
    out = tmp_path / "peer.json"
    doc, _ = _recorded_peer_run(out)
    one = doc["policies"].pop("external")
    for p in ("hicache", "kvflow", "oracle"):
        doc["policies"][p] = json.loads(json.dumps({**one, "policy": p}))
    (q,) = doc["policies"]["kvflow"]["workload"]["answers"]
    q["output_tokens"] += 70
    out.write_text(json.dumps(doc))
    shown = CliRunner().invoke(app, ["bench", "show", str(out), "--json", str(tmp_path / "again.json")],
                               env={"COLUMNS": "100"})
    assert shown.exit_code == 0, shown.output
    assert f"work: kvflow's answers differ from oracle's on {q['question']} (+70 output tokens)" in shown.output
    assert "hicache's answers" not in shown.output
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["work_differences"] == [{
        "policy": "kvflow", "question": q["question"], "calls": q["calls"],
        "output_tokens": q["output_tokens"], "reference": "oracle",
        "reference_calls": q["calls"], "reference_output_tokens": q["output_tokens"] - 70}]


def test_peer_fresh_servers_run_each_question_on_new_warmed_processes(server_set_pids):
    """``--fresh-servers``: every measured question runs on servers started for it, each of
    which first asks the warm-up question (unmeasured), so one process's speed is drawn again
    per question; the questions' calls and counters are merged per column as with one server."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from kvflow_agents.bench import peer, runner
    from kvflow_agents.bench.peer import PeerOptions, pick_questions, run_peer_bench

    pids = server_set_pids
    opts = PeerOptions(questions=2, warmup_questions=1, max_rounds=1, max_tokens=4)
    qs, warm = pick_questions(opts)
    fixed = peer.fixed_prompt_tokens("tiny-random")
    dev = peer.min_device_tokens(fixed, opts.max_tokens, 16)
    server = runner.ServerConfig(model="tiny-random", device_tokens=dev, host_tokens=8192,
                                 host_link_gbps=1.0, torch_threads=1)
    log: list[str] = []
    out = run_peer_bench(qs, warm, opts, ["kvflow"], server, model="tiny-random",
                         fresh_servers=True, log=log.append)
    assert len(pids) == 2                                      # one server set per question
    assert pids[0]["kvflow"] != pids[1]["kvflow"]
    assert sum("warm-up question" in line for line in log) == 2      # each set warmed up first
    for res in out:
        w = res.workload
        assert w["server_sets"] == 2 and w["errors"] == 0 and w["instrumented"] is True
        assert [a["question"] for a in w["answers"]] == [q.id for q in qs]
        assert w["workflow_rounds"] == 2                       # measured questions only
        assert w["calls_per_agent"]["planner"] == 2 and w["calls_per_agent"]["reviewer"] == 2
        assert res.server is not None and res.server["requests"] == w["calls"]
        assert res.startup_s > 0 and res.serve_argv[:2] == ["kvflow", "serve"]


def test_peer_fresh_servers_refused_with_base_url():
    r = CliRunner().invoke(app, ["bench", "peer", "--fresh-servers", "--base-url", "http://127.0.0.1:9/v1"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--fresh-servers" in r.output


@pytest.mark.parametrize("flag, expected", [([], None), (["--server-threads", "0"], None),
                                            (["--server-threads", "1"], 1)])
def test_peer_servers_leave_the_client_a_core_and_the_link_is_calibrated_on_as_many(
        monkeypatch, flag, expected):
    """The PEER client runs on the same machine: by default the servers' torch threads are one
    fewer than the cores (as in ``bench workflow``), and the link's calibration times the
    recompute with the same threads, so the load keeps its fraction of what the servers pay."""
    from types import SimpleNamespace

    from kvflow_agents.bench import calibrate, peer
    from kvflow_agents.bench.server import client_core_threads

    seen: dict = {}

    def fake_calibrate(model, fixed, **kw):
        seen["calibration_threads"] = kw.get("torch_threads")
        return SimpleNamespace(link_gbps=0.5, describe=lambda: "calibrated", as_dict=lambda: {})

    class Stop(Exception):
        pass

    def fake_run(qs, warm, opts, pols, server, **kw):
        seen["server"] = server
        raise Stop

    monkeypatch.setattr(calibrate, "calibrate_link", fake_calibrate)
    monkeypatch.setattr(peer, "run_peer_bench", fake_run)
    r = CliRunner().invoke(app, ["bench", "peer", "--model", "tiny-random", "--policies", "hicache,kvflow",
                                 "--no-progress", *flag],
                           env={"COLUMNS": "200"})
    assert isinstance(r.exception, Stop), r.output
    threads = client_core_threads() if not flag else expected
    assert seen["server"].torch_threads == threads == seen["calibration_threads"]
    argv = seen["server"].args("kvflow")
    assert (f"--torch-threads {threads}" in " ".join(argv)) == (threads is not None)
