"""The quickstart example and ``kvflow bench instrument`` run (tiny sizes, no timing asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_against_its_stub(capsys):
    spec = importlib.util.spec_from_file_location("quickstart_langgraph", ROOT / "examples" / "quickstart_langgraph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    assert mod.main(["--rounds", "1", "--thread", "qs-test"]) == 0
    out = capsys.readouterr().out
    assert "step  1  planner     STE planner=0 researcher=1 coder=1 tools=2 writer=3 reviewer=4" in out
    assert "step  4  writer      STE planner=· researcher=· coder=· tools=· writer=0 reviewer=1" in out
    assert "out of band: transition step  3  tools" in out
    assert "out of band: end" in out
    assert "done: 5 LLM calls, 1 review round(s)" in out


def test_bench_instrument_reports_the_overhead():
    from kvflow_agents.cli.instrument_cmds import bench_instrument

    res = bench_instrument(nodes=4, runs=2, warmup=1)
    assert res["graph"] == {"nodes": 4, "shape": "chain", "llm_calls_per_run": 4}
    assert res["per_call_us"]["plain"] > 0 and res["per_call_us"]["instrumented"] > 0
    assert res["ratio"] > 0 and res["hint_path_us"] > 0 and res["kvflow_self_us_per_call"] > 0


def test_bench_instrument_cli_is_registered():
    from kvflow_agents.cli.main import app

    r = CliRunner().invoke(app, ["bench", "instrument", "--nodes", "3", "--runs", "1", "--shape", "fanout", "--json"])
    assert r.exit_code == 0, r.output
    assert '"ratio"' in r.output
    r = CliRunner().invoke(app, ["bench", "instrument", "--shape", "ring"])
    assert r.exit_code != 0
