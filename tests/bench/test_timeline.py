"""``kvflow bench timeline``: a ``--raw`` run's calls grouped by step, how far apart each
step's calls arrived and which waited for a load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from kvflow_agents.bench import timeline
from kvflow_agents.bench.driver import WorkflowDriver
from kvflow_agents.bench.runner import _raw
from kvflow_agents.bench.workload import ByteLevelCounter, WorkloadSpec
from kvflow_agents.cli.main import app
from kvflow_agents.testing import RecordingOpenAIServer

RESULTS = Path(__file__).resolve().parents[2] / "kvflow_agents" / "bench" / "results"


def _call(trial, rnd, step, start, *, wait=0.0, measured=True, ok=True, latency=1.0):
    return {"trial": trial, "round": rnd, "step": step, "start": start, "latency_s": latency,
            "load_wait_s": wait, "queue_s": None if wait is None else wait + 0.1, "measured": measured, "ok": ok}


def test_rows_group_each_trials_step_and_count_the_calls_that_waited():
    calls = [_call(0, 1, 5, 100.0), _call(0, 1, 5, 100.5, wait=0.3),
             _call(0, 1, 5, 100.2, wait=0.005),          # a tick's latency, not a wait
             _call(1, 1, 5, 900.0), _call(1, 1, 5, 900.1),  # the same step of another trial
             _call(0, 1, 6, 102.0, latency=2.5), _call(0, 1, 6, 102.0, wait=None),
             _call(0, 0, 1, 50.0, wait=9.0, measured=False),  # a warm-up call
             _call(0, 1, 6, 150.0, ok=False)]                # a failed one
    rows = timeline.step_rows(calls)
    assert [(r.trial, r.round, r.step, r.calls) for r in rows] == [(0, 1, 5, 3), (0, 1, 6, 2), (1, 1, 5, 2)]
    a, b, c = rows
    assert abs(a.spread_s - 0.5) < 1e-9 and a.waited == 1 and a.load_wait_max_s == 0.3
    assert abs(a.queue_max_s - 0.4) < 1e-9
    assert b.spread_s == 0 and b.waited == 0 and b.latency_max_s == 2.5
    assert abs(c.spread_s - 0.1) < 1e-9
    s = timeline.summary(rows)
    assert s["steps"] == 3 and s["calls"] == 7 and s["steps_waited"] == 1 and s["calls_waited"] == 1
    assert s["spread_max_s"] == 0.5 and abs(s["spread_p50_s"] - 0.1) < 1e-9
    assert timeline.summary([]) is None


def test_a_driven_run_records_its_trial_and_reads_back():
    spec = WorkloadSpec(agents=3, fixed=64, dynamic=16, output=4, rounds=2, warmup_rounds=1, workflows=2)
    with RecordingOpenAIServer(reply=lambda body: "a b c") as srv:
        drv = WorkflowDriver(spec, srv.base_url, "stub", counter=ByteLevelCounter(), run_id="t", trial=3)
        res = asyncio.run(drv.run())
    doc = json.loads(json.dumps({"policies": {"p": {"raw": _raw(res)}}}))  # as stored
    rows = timeline.from_result(doc)["p"]
    assert len(rows) == 2 * 3 and all(r.trial == 3 and r.calls == 2 for r in rows)
    assert {r.round for r in rows} == {1, 2}         # the warm-up round is not measured
    starts = {}
    for c in res.calls:
        if c.measured:
            starts.setdefault((c.round, c.step), []).append(c.start)
    assert [r.spread_s for r in rows] == [max(v) - min(v) for _, v in sorted(starts.items())]


def test_the_command_on_a_stored_run(tmp_path):
    src = RESULTS / "wf_8_smollm2_pool60_lf045_fill_s47_1t.json"
    out = tmp_path / "steps.json"
    r = CliRunner().invoke(app, ["bench", "timeline", str(src), "--policy", "kvflow", "--json", str(out)],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80
    doc = json.loads(out.read_text())
    raw = json.loads(src.read_text())["policies"]
    for name in ("kvflow", "kvflow-fill", "oracle"):
        calls = [c for c in raw[name]["raw"]["calls"] if c["measured"]]
        waited = sum((c["load_wait_s"] or 0) > timeline.WAITED_S for c in calls)
        assert doc[name]["summary"]["calls_waited"] == waited
        assert doc[name]["summary"]["calls"] == len(calls) == 160
    assert doc["kvflow"]["summary"]["calls_waited"] > 0 == doc["kvflow-fill"]["summary"]["calls_waited"]
    assert "kvflow: each step's calls" in r.output      # --policy lists its steps


def test_bad_input_says_what_is_wrong(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"policies": {"kvflow": {"workload": {}}}}))
    r = CliRunner().invoke(app, ["bench", "timeline", str(bare)])
    assert r.exit_code == 2 and "--raw" in r.output
    src = RESULTS / "wf_8_smollm2_pool60_lf045_fill_s47_1t.json"
    r = CliRunner().invoke(app, ["bench", "timeline", str(src), "--policy", "lru"])
    assert r.exit_code == 2 and "lru" in r.output and "kvflow-fill" in r.output
