"""The fault suite itself (`kvflow bench reliability --quick`): every row passes, and the fuzz
corpus is seeded and reproducible. The full run is `kvflow bench reliability` (README)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvflow_agents.bench.reliability import Plan, Suite
from kvflow_agents.bench.reliability_corpus import fuzz_cases


def test_fuzz_corpus_is_seeded_reproducible_and_mixed():
    a, b, c = fuzz_cases(7, 600), fuzz_cases(7, 600), fuzz_cases(8, 600)
    assert [(x.path, x.body, x.valid) for x in a] == [(x.path, x.body, x.valid) for x in b]
    assert [x.body for x in a] != [x.body for x in c]
    kinds = {x.kind for x in a}
    assert {"hint", "hint-header", "oob", "body-field", "body-ok", "structural"} <= kinds
    assert 0.3 < sum(x.valid for x in a) / len(a) < 0.8


def test_quick_suite_has_no_correctness_failure():
    """Every row runs and none fails (no drop, no 5xx, no leak, no cross-tenant success, no
    batch variance in deterministic mode). Targets on timings, shares and memory growth are
    figures of the full run on a quiet box, reported here but not asserted."""
    rows = Suite(Plan.quick(), seed=1, log=lambda s: None).run()
    names = [r.name.split(":")[0].split(" (")[0] for r in rows]
    assert len(rows) == 11, names
    failed = {r.name: (r.failed, r.figure, r.detail) for r in rows if r.failed}
    assert not failed, json.dumps(failed, indent=1, default=str)
    assert all(r.tried > 0 for r in rows)
    assert {r.name.split(" (")[0].split(":")[0] for r in rows if r.target is not None} == {
        "/health while max-size requests are tokenized", "flood vs quiet tenant", "hint memory", "soak"}


def test_cli_wrapper_prints_the_table(tmp_path, monkeypatch):
    """The CLI runs the same suite; here with a stub suite so the plumbing is checked fast."""
    from kvflow_agents.bench import reliability as rel
    from kvflow_agents.cli.main import app

    class Stub(rel.Suite):
        def run(self):
            self.series["soak_rss"] = [(0.0, 100.0), (1.0, 101.0)]
            return [rel.Row("fuzz: hints + bodies", 5200, 0, "0 crashes"),
                    rel.Row("soak", 10, 0, "grew", target=False)]
    monkeypatch.setattr(rel, "Suite", Stub)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "reliability", "--quick", "--no-progress", "--json", str(out),
                                   "--plot", str(tmp_path / "r.png")])
    assert res.exit_code == 1, res.output  # one row missed its target
    assert "fuzz: hints + bodies" in res.output and "5200" in res.output and "missed" in res.output
    doc = json.loads(out.read_text())
    assert doc["all_ok"] is False and [r["ok"] for r in doc["rows"]] == [True, False]
    assert (tmp_path / "r.png").stat().st_size > 1000
