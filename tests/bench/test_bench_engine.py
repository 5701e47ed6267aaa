"""``kvflow bench engine``: the decode-step split is measured on real engines (tiny-random); the
test checks the shape and the accounting, never a time."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import engine_step
from kvflow_agents.cli.main import app


@pytest.mark.parametrize("sink", ["asyncio", "direct"])
def test_engine_bench_cli(tmp_path, sink):
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    r = CliRunner().invoke(app, ["bench", "engine", "--policies", "oracle,kvflow", "--batch", "2,1",
                                 "--context", "64", "--steps", "8", "--sink", sink, "--json", str(out),
                                 "--plot", str(png)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(x) for x in r.output.splitlines()) <= 80 and "target: rest <=" in r.output
    doc = json.loads(out.read_text())
    assert doc["bench"] == "engine" and doc["sink"] == sink
    rows = doc["results"]
    assert [(x["batch"], x["policy"]) for x in rows] == [(1, "oracle"), (1, "kvflow"), (2, "oracle"),
                                                          (2, "kvflow")]
    for x in rows:
        assert x["steps"] >= 4                       # decode-only steps with the whole batch
        assert x["step_ms"] > 0 and 0 < x["forward_ms"] <= x["step_ms"] * 1.5
        assert x["rest_ms"] >= 0
        assert set(x["breakdown_ms"]) == set(engine_step.CATEGORIES)
        assert x["breakdown_ms"]["forward"] > 0 and x["breakdown_ms"]["detokenise"] > 0
        assert x["breakdown_ms"]["sinks"] > 0 and x["breakdown_ms"]["cache"] > 0
        assert x["breakdown_ms"]["sampling"] > 0     # the engine's BatchSampler, once a step
    s = doc["summary"]
    assert set(s["batch1_rest_ms"]) == {"oracle", "kvflow"} and isinstance(s["met"], bool)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_engine_bench_rejects_bad_flags():
    r = CliRunner().invoke(app, ["bench", "engine", "--batch", "0"], env={"COLUMNS": "120"})
    assert r.exit_code == 2 and "[1, 256]" in r.output
    r = CliRunner().invoke(app, ["bench", "engine", "--sink", "pipe"], env={"COLUMNS": "120"})
    assert r.exit_code == 2 and "asyncio" in r.output


def test_timers_charge_exclusive_time(monkeypatch):
    """A nested wrapped call is charged to its own category, not to its caller's (fake clock)."""
    now = [0.0]
    monkeypatch.setattr(engine_step.time, "perf_counter", lambda: now[0])
    t = engine_step._Timers()

    def cache_work():
        now[0] += 2.0
    inner = t.wrap("cache", cache_work)

    def sink_work():
        now[0] += 1.0
        inner()
        now[0] += 0.5
    t.wrap("sinks", sink_work)()
    assert t.step == {"cache": 2.0, "sinks": 1.5}


def test_forwards_bench_interleaves_the_same_calls_on_every_policy(tmp_path):
    """``kvflow bench forwards``: every engine served the same calls (equal decode steps per
    repetition at batch 1), kvflow's from a pool that made it load prefixes from host (its cache
    work was in the measurement), ratios to the oracle per repetition; the table fits 80
    columns; the oracle is required."""
    out, png = tmp_path / "f.json", tmp_path / "f.png"
    r = CliRunner().invoke(app, ["bench", "forwards", "--policies", "kvflow,oracle", "--agents", "6",
                                 "--fixed", "128", "--rounds", "2", "--reps", "2", "--json", str(out),
                                 "--plot", str(png)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(x) for x in r.output.splitlines()) <= 80 and png.stat().st_size > 1000
    doc = json.loads(out.read_text())
    res = {x["policy"]: x for x in doc["results"]}
    assert res["kvflow"]["decode_steps"] == res["oracle"]["decode_steps"] == [2 * 6 * 15] * 2
    assert res["kvflow"]["load_pages"] > 0 and res["oracle"]["load_pages"] == 0
    rat = doc["ratios"]
    assert rat["oracle"]["decode"]["ratio"] == 1.0 and len(rat["kvflow"]["decode"]["reps"]) == 2
    for name in ("decode", "prefill", "wall", "beside"):
        v = rat["kvflow"][name]
        lo, hi = v["ci"]
        assert lo <= v["ratio"] <= hi and v["ratio"] > 0
    assert all(len(res[p]["wall_ms_per_call"]) == 2 and min(res[p]["wall_ms_per_call"]) > 0
               for p in res)
    # the engine's work beside the forwards: some for every policy, and the client waited for
    # it (a call's wall time holds its forwards and that work)
    for p in res:
        for beside, wall, prefill in zip(res[p]["beside_ms_per_call"], res[p]["wall_ms_per_call"],
                                         res[p]["prefill_ms_per_call"]):
            assert 0 < beside < wall - prefill
    assert "beside fwd ms / call" in r.output
    bad = CliRunner().invoke(app, ["bench", "forwards", "--policies", "kvflow,hicache"])
    assert bad.exit_code == 2 and "oracle" in bad.output


def test_forwards_bench_with_concurrent_workflows_takes_turns_by_round(tmp_path):
    """``--workflows 3``: each engine serves three workflows at once (its decode steps batch
    them: fewer steps than calls x tokens), every engine the same calls; the wall time per call
    is the client's, over the measured rounds; the pool is sized for all three workflows'
    prompts, so kvflow still loads from host."""
    out = tmp_path / "f.json"
    r = CliRunner().invoke(app, ["bench", "forwards", "--policies", "kvflow,oracle", "--agents", "4",
                                 "--fixed", "128", "--rounds", "2", "--reps", "2", "--workflows", "3",
                                 "--json", str(out)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(x) for x in r.output.splitlines()) <= 80 and "rounds interleaved" in r.output
    doc = json.loads(out.read_text())
    res = {x["policy"]: x for x in doc["results"]}
    assert doc["workflows"] == 3 and res["kvflow"]["calls"] == res["oracle"]["calls"] == 2 * 4 * 3
    for p in res:   # 24 calls x 15 decode steps each, batched three at most
        assert all(2 * 4 * 15 <= n < 2 * 4 * 3 * 15 for n in res[p]["decode_steps"])
        assert min(res[p]["wall_ms_per_call"]) > 0
    assert res["kvflow"]["load_pages"] > 0 and res["oracle"]["load_pages"] == 0
    assert doc["ratios"]["oracle"]["wall"]["ratio"] == 1.0
