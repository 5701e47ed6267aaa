"""The same-pool bound (``kvflow_agents/bench/pool_bound.py``, ``kvflow bench pool-bound``):
what no policy could have had on device, from a ``--raw`` run's per-call records."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvflow_agents.bench.pool_bound import call_bounds, summarize
from kvflow_agents.cli.main import app


def call(agent, start, latency, prompt, out, dev, host, measured=True, wf=0):
    return {"workflow": wf, "agent": agent, "start": start, "latency_s": latency, "measured": measured,
            "ok": True, "prompt_tokens": prompt, "completion_tokens": out,
            "device_hit_tokens": dev, "host_hit_tokens": host}


def test_the_request_that_just_finished_holds_its_pages_and_a_gap_loads_more():
    a = call("A", 0.0, 1.0, 80, 16, 0, 0, measured=False)
    # pool 10 pages of 16; A wrote 6 pages (80 + 15 tokens) and held them until it ended
    b_now = call("B", 1.0, 1.0, 100, 8, 32, 64)          # arrives as A ends: 6 + 6 - 10 = 2 pages
    assert [x.bound_tokens for x in call_bounds([a, b_now], 160, 16, 1.0, slack_s=0)] == [32]
    # the records are the client's: the server's gap is a little longer (GAP_SLACK_S)
    assert [x.bound_tokens for x in call_bounds([a, b_now], 160, 16, 0.01)] == [0]
    b_later = call("B", 1.5, 1.0, 100, 8, 96, 0)         # 0.5 s later: 0.2 s/page loads 2 pages
    assert [x.bound_tokens for x in call_bounds([a, b_later], 160, 16, 0.2, slack_s=0)] == [0]
    assert [x.bound_tokens for x in call_bounds([a, b_later], 160, 16, 0.4, slack_s=0)] == [16]
    assert [x.bound_tokens for x in call_bounds([a, b_later], 160, 16, slack_s=0)] == [0]  # instant link


def test_running_requests_hold_their_pages_and_a_shared_agent_bounds_nothing():
    a1 = call("A", 0.0, 5.0, 96, 0, 0, 0, measured=False)   # 6 pages, still running
    b = call("B", 1.0, 1.0, 100, 8, 0, 96)
    a2 = call("A", 1.0, 1.0, 100, 8, 0, 96)                  # A's prefix is a1's: counted once
    got = {x.agent: x.bound_tokens for x in call_bounds([a1, b, a2], 160, 16, secs_per_page=0.01)}
    # b: held by a1 (6 pages, running; a2 arrived with b, it holds nothing yet): 6 + 6 - 10
    assert got == {"B": 32, "A": 0}


def _doc(tmp_path):
    calls = lambda dev, host: [call("A", 0.0, 1.0, 80, 16, 0, 0, measured=False),  # noqa: E731
                               call("B", 1.0, 1.0, 100, 8, dev, host)]
    doc = {"server": {"device_tokens": 160, "page_size": 16, "host_link_gbps": 1.0},
           "calibration": {"kv_bytes_per_token": 62_500_000},      # 1 s per page
           "policies": {"hicache": {"policy": "hicache", "raw": {"calls": calls(0, 96)}},
                        "kvflow": {"policy": "kvflow", "raw": {"calls": calls(64, 32)}},
                        "kvflow-x": {"policy": "kvflow", "raw": {"calls": calls(32, 64)}},
                        "oracle": {"policy": "oracle", "raw": {"calls": calls(96, 0)}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    return doc, path


def test_summary_and_cli(tmp_path):
    doc, path = _doc(tmp_path)
    rows = summarize(doc)
    assert (rows["hicache"]["device_miss"], rows["hicache"]["bound"]) == (96, 32)
    assert rows["kvflow"]["same_pool_saving"] == 1.0           # at the bound
    assert rows["kvflow-x"]["same_pool_saving"] == 0.5          # half of hicache's excess left
    assert rows["oracle"]["bound"] is None and rows["oracle"]["same_pool_saving"] is None
    out = tmp_path / "bound.json"
    r = CliRunner().invoke(app, ["bench", "pool-bound", str(path), "--json", str(out)],
                           env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert "1.00" in r.output and "0.50" in r.output
    assert json.loads(out.read_text())["kvflow"]["device_miss"] == 32
    r = CliRunner().invoke(app, ["bench", "pool-bound", str(path), "--gap-slack", "2"],
                           env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "not a lower bound" not in r.output
    doc["policies"]["kvflow"]["raw"]["calls"][1]["host_hit_tokens"] = 0      # beats it: say so
    doc["policies"]["kvflow"]["raw"]["calls"][1]["device_hit_tokens"] = 96
    path.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "pool-bound", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "not a lower bound" in r.output
    del doc["policies"]["kvflow"]["raw"]
    path.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "pool-bound", str(path)], env={"COLUMNS": "120"})
    assert r.exit_code == 2 and "--raw" in r.output


def test_peer_bench_reports_the_bound_per_column():
    """What `kvflow bench peer` adds to each column's workload (the per-call records it keeps
    anyway) and the two rows its table prints from them; the oracle's column has no bound."""
    from kvflow_agents.bench.peer import _pool_bound
    from kvflow_agents.bench.report import render_table
    from kvflow_agents.bench.report_rows import pool_bound_rows
    from kvflow_agents.bench.runner import PolicyResult, ServerConfig
    from kvflow_agents.bench.workload import CallRecord, WorkloadResult
    from kvflow_agents.serving.embedded.model.config import get_preset

    def res(dev, host):
        return WorkloadResult(calls=[
            CallRecord(0, 0, "A", 0, False, 0.0, 0.1, 1.0, prompt_tokens=80, completion_tokens=16,
                       device_hit_tokens=0, host_hit_tokens=0),
            CallRecord(0, 0, "B", 1, True, 1.0, 0.1, 1.0, prompt_tokens=100, completion_tokens=8,
                       device_hit_tokens=dev, host_hit_tokens=host)])

    # a link of 1 s per page: the gap's slack loads nothing
    link = get_preset("tiny-random").kv_bytes_per_token * 16 / 1e9
    server = ServerConfig(model="tiny-random", device_tokens=160, host_tokens=0, host_link_gbps=link,
                          variants={"oracle-x": ("oracle", ())})
    cols = {"hicache": res(0, 96), "kvflow": res(64, 32), "oracle-x": res(96, 0)}
    pb = {label: _pool_bound(r, server, label) for label, r in cols.items()}
    assert pb["hicache"] == {"device_miss": 96, "bound": 32, "beat_bound": 0}
    assert pb["oracle-x"]["bound"] is None
    results = [PolicyResult(label, {"pool_bound": v}) for label, v in pb.items()]
    rows = dict(pool_bound_rows(results))
    assert rows["missing / bound (tok)"] == ["96 / 32", "32 / 32", "0 / -"]
    assert rows["same-pool saving"] == ["-", "1.00", "-"]
    assert render_table(results, "t").row_count >= 2
