"""``kvflow bench layout``: the layouts it times are the ones it names, and the command runs.

No timed assertions: only the layouts' shapes and the command's output fields."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench.page_layout import layout_rows
from kvflow_agents.cli.main import app
from kvflow_agents.serving.embedded.kv_pool import page_runs


def _runs(row: list[int]) -> int:
    return len(page_runs(row, row))


@pytest.mark.parametrize("runs, expected", [(1, 1), (4, 4), (19, 19), (0, 69), (200, 69)])
def test_layout_rows_have_the_asked_runs_and_no_shared_page(runs, expected):
    pool = 4 * 8 * 69 + 64
    rows = layout_rows(69, 8, runs, pool, random.Random(runs))
    assert len(rows) == 8 and all(len(r) == 69 for r in rows)
    assert all(_runs(r) == expected for r in rows)
    flat = [p for r in rows for p in r]
    assert len(set(flat)) == len(flat) and 0 <= min(flat) and max(flat) < pool
    # the runs are really apart: no run of one sequence continues another sequence's run
    assert _runs(sorted(flat)) == 8 * expected


def test_layout_rows_refuses_a_pool_too_small():
    with pytest.raises(ValueError, match="too small"):
        layout_rows(69, 8, 1, 69 * 8, random.Random(0))


def test_layout_command_times_each_layout(tmp_path):
    out = tmp_path / "layout.json"
    png = tmp_path / "layout.png"
    r = CliRunner().invoke(app, ["bench", "layout", "--batch", "2", "--context", "64", "--runs", "1,0",
                                 "--reps", "2", "--steps", "2", "--json", str(out), "--plot", str(png)],
                           env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["bench"] == "layout" and doc["batch"] == 2 and doc["context"] == 64
    res = doc["results"]
    assert [x["runs"] for x in res] == [1, 5]           # 64 tokens + the new one: 5 pages
    assert res[0]["vs_one_run"] == 1.0
    assert all(x["step_ms"] > 0 and x["step_min_ms"] <= x["step_ms"] for x in res)
    assert png.stat().st_size > 0 and "runs / sequence" in r.output


def test_layout_command_rejects_bad_runs():
    r = CliRunner().invoke(app, ["bench", "layout", "--runs", "one"], env={"COLUMNS": "120"})
    assert r.exit_code == 2 and "comma-separated" in r.output
    r = CliRunner().invoke(app, ["bench", "layout", "--runs", "-1"], env={"COLUMNS": "120"})
    assert r.exit_code == 2 and ">= 0" in r.output
