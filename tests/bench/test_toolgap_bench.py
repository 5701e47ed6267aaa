"""``kvflow bench toolgap`` on a small configuration: the numbers are not judged (timings belong
to benchmarks), but what each policy did with the agent's last turn is."""

from __future__ import annotations

from typer.testing import CliRunner


def test_toolgap_bench_small_run_and_cli():
    from kvflow_agents.bench.toolgap import bench_toolgap
    from kvflow_agents.cli.main import app

    res = bench_toolgap(gaps=(0.6,), trials=1, fixed=256, history=768, background_rate=10,
                        background_fixed=256, background_task=512, device_tokens=2048, host_link_gbps=0.2)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"lru", "hicache", "kvflow (no tool time)", "kvflow"}
    history_tokens = 768
    # lru dropped the last turn under the other workflows' load and recomputed it
    assert rows["lru"]["recomputed_tokens"] > history_tokens
    # with the tool's timing, kvflow kept the whole last turn (or brought it back in time):
    # only the new tokens (the tool's result) are computed, and nothing waits for a load
    assert rows["kvflow"]["recomputed_tokens"] < 64 and rows["kvflow"]["load_wait_s"] == 0
    assert all(r["warm_ttft_s"] > 0 and r["trials"] == 1 for r in rows.values())
    r = CliRunner().invoke(app, ["bench", "toolgap", "--gaps", "0,1"])
    assert r.exit_code != 0 and "positive" in r.output
