"""``kvflow bench aiperf``: the sessions AIPerf replays (bodies, hints per turn), the command line,
reading AIPerf's exports; a real AIPerf run when its virtualenv exists (``.venv-aiperf``: the
command creates it; CI does not, so that test is skipped there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import aiperf as ap
from kvflow_agents.bench.workload import ByteLevelCounter, WorkloadSpec
from kvflow_agents.cli.main import app

REPO = Path(__file__).resolve().parents[2]


def test_agentic_sessions_continue_the_warmup_with_hints(tmp_path):
    spec = WorkloadSpec(agents=3, fixed=40, dynamic=8, output=4, rounds=2, warmup_rounds=1, workflows=2)
    s = ap.agentic_sessions(spec, ByteLevelCounter(), model="m", run_id="r", first_round=1)
    assert list(s) == ["bench-r-wf0", "bench-r-wf1"] and all(len(b) == 6 for b in s.values())
    b = s["bench-r-wf0"]
    assert b[0]["stream"] is True and b[0]["ignore_eos"] is True and b[0]["max_tokens"] == 4
    assert [x["custom_params"]["kvflow_agent"] for x in b] == ["agent_0", "agent_1", "agent_2"] * 2
    # the tracker went through the warm-up round: steps continue after it
    assert b[0]["custom_params"]["kvflow_step"] == 4
    assert b[0]["custom_params"]["kvflow_ste"] == {"agent_0": 0, "agent_1": 1, "agent_2": 2}
    assert b[1]["custom_params"]["kvflow_ste"] == {"agent_0": 2, "agent_1": 0, "agent_2": 1}
    # the same agent sends the same fixed prompt, the rounds new dynamic parts
    assert b[0]["messages"][0] == b[3]["messages"][0] and b[0]["messages"][1] != b[3]["messages"][1]
    none = ap.agentic_sessions(WorkloadSpec(agents=3, fixed=40, rounds=1, hints="none"), ByteLevelCounter(),
                               model="m", run_id="r")
    assert all("custom_params" not in x for x in none["bench-r-wf0"])
    rev = ap.agentic_sessions(WorkloadSpec(agents=3, fixed=40, rounds=1, hints="reversed"), ByteLevelCounter(),
                              model="m", run_id="r")
    assert rev["bench-r-wf0"][0]["custom_params"]["kvflow_ste"] == {"agent_0": 2, "agent_1": 1, "agent_2": 0}
    d = ap.write_sessions(s, tmp_path / "ds")
    files = sorted(d.glob("*.jsonl"))
    assert len(files) == 2 and [json.loads(x) for x in files[0].read_text().splitlines()] == b
    with pytest.raises(ValueError, match="cycle"):
        ap.agentic_sessions(WorkloadSpec(agents=4, variant="fanout"), ByteLevelCounter(), model="m", run_id="r")


def test_aiperf_argv():
    run = ap.AIPerfRun(model="tiny-random", tokenizer="/t", concurrency=4, input_dir="/d", request_count=40)
    a = run.argv("aiperf", "http://h:1", "/out")
    assert a[:2] == ["aiperf", "profile"]
    for flag, val in (("--url", "http://h:1"), ("--custom-dataset-type", "raw-payload"), ("--input-file", "/d"),
                      ("--concurrency", "4"), ("--tokenizer", "/t"), ("--request-count", "40"),
                      ("--artifact-dir", "/out")):
        assert a[a.index(flag) + 1] == val
    assert "--streaming" in a
    mt = ap.AIPerfRun(model="m", tokenizer="/t", concurrency=2, workload="multi-turn", conversations=3, turns=4,
                      system_prompt_tokens=100, isl=10, osl=5).argv("aiperf", "u", "o")
    for flag, val in (("--conversation-num", "3"), ("--conversation-turn-mean", "4"),
                      ("--shared-system-prompt-length", "100"), ("--isl", "10"), ("--osl", "5"),
                      ("--request-count", "12")):
        assert mt[mt.index(flag) + 1] == val


def test_read_export_and_merge(tmp_path):
    stat = lambda avg, p50=None, p90=None, p99=None: {"unit": "ms", "avg": avg, "p50": p50, "p90": p90, "p99": p99}  # noqa: E731
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps({
        "time_to_first_token": stat(10.0, 9.0, 20.0), "inter_token_latency": stat(2.0, 1.5),
        "request_latency": stat(50.0, 45.0, 80.0, 90.0), "request_throughput": {"avg": 20.0},
        "output_token_throughput": {"avg": 320.0}, "request_count": {"avg": 4.0},
        "benchmark_duration": {"avg": 0.2}, "error_summary": []}))
    recs = [("a", 0, 100), ("a", 100, 300), ("b", 50, 150), ("b", 160, 900)]
    (tmp_path / "profile_export.jsonl").write_text("\n".join(json.dumps({"metadata": {
        "conversation_id": c, "request_start_ns": s * 10**6, "request_end_ns": e * 10**6,
        "benchmark_phase": "profiling"}}) for c, s, e in recs))
    r = ap.read_export(tmp_path)
    assert r["ttft_avg_ms"] == 10.0 and r["latency_p99_ms"] == 90.0 and r["requests_per_s"] == 20.0
    assert r["sessions"] == 2 and r["session_latency_p50_s"] == pytest.approx((0.3 + 0.85) / 2)
    pr = ap.as_policy_result("kvflow", [r, {**r, "session_latency_p50_s": 0.5}], None, [])
    assert pr.workload["workflow_latency_trials_s"] == [[0, pytest.approx(0.575)], [1, 0.5]]
    assert pr.workload["aiperf"]["requests"] == 8 and pr.workload["ttft_mean_s"] == pytest.approx(0.01)


def test_missing_aiperf_is_a_clear_error(tmp_path):
    with pytest.raises(ap.AIPerfUnavailable, match="not an executable"):
        ap.ensure_aiperf(str(tmp_path / "nope"))
    r = CliRunner().invoke(app, ["bench", "aiperf", "--no-install", "--aiperf-venv", str(tmp_path / "v")],
                           env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.exit_code == 2 and "aiperf not found" in r.output
    r = CliRunner().invoke(app, ["bench", "aiperf", "--workload", "chat"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "agentic" in r.output
    r = CliRunner().invoke(app, ["bench", "aiperf", "--policy-variant", "x=nope"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--policy-variant" in r.output and "not a policy" in r.output
    r = CliRunner().invoke(app, ["bench", "aiperf", "--other-python", str(tmp_path / "nope")],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--other-python" in r.output and "not an executable" in r.output


@pytest.mark.skipif(ap.find_aiperf(None, str(REPO / ".venv-aiperf")) is None,
                    reason="AIPerf's virtualenv (.venv-aiperf) is not installed")
def test_real_aiperf_against_two_policies(tmp_path):
    out = tmp_path / "a.json"
    r = CliRunner().invoke(app, [
        "bench", "aiperf", "--policies", "lru,kvflow", "--agents", "3", "--fixed", "128", "--output", "4",
        "--rounds", "1", "--workflows", "2", "--aiperf-venv", str(REPO / ".venv-aiperf"), "--no-install",
        "--policy-variant", "kvflow-lease=kvflow --lease-s 30", "--other-python", sys.executable,
        "--json", str(out)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    # --other-python: every column twice, the twin served by that interpreter
    twin = [sys.executable, "-P", "-m", "kvflow_agents.cli.main", "serve"]
    assert list(doc["policies"]) == ["lru", "other-lru", "kvflow", "other-kvflow", "kvflow-lease",
                                     "other-kvflow-lease"]
    assert doc["policies"]["other-kvflow"]["serve_argv"][:5] == twin
    # the variant: one more server, kvflow with its own option, measured as one more column
    assert doc["server"]["variants"]["kvflow-lease"] == ["kvflow", ["--lease-s", "30"]]
    assert doc["server"]["variants"]["other-kvflow-lease"] == ["kvflow", ["--lease-s", "30"]]
    assert doc["server"]["commands"] == {f"other-{p}": twin for p in ("lru", "kvflow", "kvflow-lease")}
    argv = doc["policies"]["kvflow-lease"]["serve_argv"]
    assert argv[argv.index("--policy") + 1] == "kvflow" and "--lease-s" in argv
    for p in doc["policies"]:
        a = doc["policies"][p]["workload"]["aiperf"]
        assert a["requests"] == 6 and a["errors"] == 0 and a["sessions"] == 2
        assert a["ttft_avg_ms"] > 0 and a["itl_avg_ms"] is not None and a["requests_per_s"] > 0
    assert doc["policies"]["kvflow"]["server"]["prefetch_issued"] >= 0
