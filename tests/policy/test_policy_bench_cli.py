"""``kvflow bench policy`` is wired up and reports every figure (tiny sizes: a smoke test,
not a timing test; the real figures come from running the command)."""

from __future__ import annotations

import json

from typer.testing import CliRunner


def test_bench_policy_json_smoke():
    from kvflow_agents.cli.main import app

    result = CliRunner().invoke(app, ["bench", "policy", "--nodes", "300,900", "--ops", "100",
                                      "--agents", "10", "--page-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [r["nodes"] for r in out["results"]] == [300, 900]
    for r in out["results"]:
        for k in ("match_ops_s", "insert_ops_s", "evict_ops_s", "hint_update_us"):
            assert r[k] > 0
    assert out["slowdown"]["to_nodes"] == 900
