"""The bench report's numbers (:mod:`kvflow_agents.bench.stats`) and how :mod:`.report` shows
them: ratios and targets, the achievable saving with its per-trial spread and paired-bootstrap
interval, ``kvflow bench show`` on a saved result, the counter-based cache-cost saving. No
server is started; the speed-adjusted figures are test_bench_speed.py's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import report, report_rows, stats
from kvflow_agents.bench.figures import Figures
from kvflow_agents.bench.runner import PolicyResult
from kvflow_agents.cli.main import app


# ------------------------------------------------------------------------------ ratios, targets, saving
def _result(policy, lat, ttft):
    return PolicyResult(policy, {"workflow_latency_p50_s": lat, "workflow_latency_mean_s": lat * 1.1,
                                 "ttft_mean_s": ttft, "calls": 10, "errors": 0})


def test_ratios_and_targets():
    rs = [_result("lru", 3.0, 0.3), _result("hicache", 1.5, 0.15), _result("kvflow", 1.0, 0.1),
          _result("oracle", 0.95, 0.09)]
    rat = stats.ratios(rs)
    assert rat["kvflow"]["speedup_vs_lru"] == pytest.approx(3.0)
    assert rat["kvflow"]["speedup_vs_hicache"] == pytest.approx(1.5)
    assert rat["kvflow"]["latency_vs_oracle"] == pytest.approx(1 / 0.95)
    got = report.check_targets(rs, report.WORKFLOW_TARGETS)
    # 3x lru, 1.3x hicache, <= 1.10x oracle; saving (3-1)/(3-0.95) = 0.976 vs lru,
    # (1.5-1)/(1.5-0.95) = 0.909 vs hicache
    assert [t["met"] for t in got] == [True, True, True, True, False]
    assert got[0]["measured_mean"] == pytest.approx(3.0)
    assert got[3]["measured"] == pytest.approx(2 / 2.05) and got[4]["measured"] == pytest.approx(0.5 / 0.55)
    got = report.check_targets(rs[1:], report.WORKFLOW_TARGETS)  # no lru column: not judged
    assert got[0]["met"] is None
    assert "kvflow" in report.plain_table(rs)


def _trial_result(policy, per_trial):
    """A result whose trials' p50 workflow latencies are ``per_trial`` (pooled p50 = median)."""
    from statistics import mean, median
    return PolicyResult(policy, {"workflow_latency_p50_s": median(per_trial),
                                 "workflow_latency_mean_s": mean(per_trial),
                                 "workflow_latency_trials_s": [[i, v] for i, v in enumerate(per_trial)],
                                 "calls": 10, "errors": 0})


def _exact_bootstrap(trials):
    """Every ordered resample of ``trials`` (n^n, equally likely): the bootstrap distribution
    the seeded sampler approximates (brute-force reference)."""
    import itertools
    out = []
    for pick in itertools.product(trials, repeat=len(trials)):
        b, m, o = (sum(t[i] for t in pick) for i in range(3))
        if b - o > 0:
            out.append((b - m) / (b - o))
    return sorted(out)


def test_saving_interval_brackets_the_mean_ratio_like_the_exact_bootstrap():
    trials = [(42.0, 40.0, 38.5), (45.0, 41.0, 40.0), (40.0, 39.5, 36.0), (44.0, 40.5, 41.0)]
    ci = stats.saving_interval(trials)
    b, m, o = (sum(t[i] for t in trials) for i in range(3))
    assert ci["lo"] < (b - m) / (b - o) < ci["hi"]
    exact = _exact_bootstrap(trials)                       # 256 resamples
    q = lambda f: exact[int(f * (len(exact) - 1))]         # noqa: E731
    assert q(0.02) <= ci["lo"] <= q(0.10) and q(0.90) <= ci["hi"] <= q(0.98)
    assert stats.saving_interval(trials) == ci            # seeded: the same run, the same interval
    # the same trial repeated: nothing to resample, the interval is the ratio itself
    same = stats.saving_interval([(2.0, 1.2, 1.0)] * 4)
    assert same["lo"] == pytest.approx(0.8) and same["hi"] == pytest.approx(0.8)
    # the policy's latency noisier around the same mean: a wider interval, wider with more noise
    widths = []
    for scale in (1.0, 2.0, 3.0):
        noisy = [(b_, m_ + scale * d, o_) for (b_, m_, o_), d in zip(trials, (1, -1, 1, -1))]
        wide = stats.saving_interval(noisy)
        widths.append(wide["hi"] - wide["lo"])
    assert ci["hi"] - ci["lo"] < widths[0] < widths[1] < widths[2]
    # too few trials, or an oracle lead that many resamples do not have: no interval
    assert stats.saving_interval(trials[:2]) is None
    assert stats.saving_interval([(1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (2.0, 1.5, 1.0)]) is None


def test_bench_show_reports_a_saved_result_again(tmp_path):
    rs = [_trial_result("hicache", [45.0, 40.0, 50.0, 42.0]), _trial_result("kvflow", [42.0, 39.0, 46.0, 41.0]),
          _trial_result("oracle", [41.0, 38.5, 45.0, 40.0])]
    saved = report.to_json({"bench": "peer", "command": "kvflow bench peer --questions 4"}, rs,
                           report.PEER_TARGETS, raw=True)
    for key in ("saving", "targets"):        # as a run of an older version wrote it: no interval
        saved.pop(key)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    out = tmp_path / "again.json"
    res = CliRunner().invoke(app, ["bench", "show", str(path), "--json", str(out),
                                   "--plot", str(tmp_path / "again.png")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "kvflow bench peer --questions 4" in res.output and "90% CI (mean)" in res.output
    assert "unresolved" in res.output or "above it" in res.output or "below it" in res.output
    doc = json.loads(out.read_text())
    k = doc["saving"]["kvflow"]["hicache"]
    assert k["ratio_mean"] == pytest.approx((177 - 168) / (177 - 164.5))
    assert k["ci"] == stats.saving_interval([(45.0, 42.0, 41.0), (40.0, 39.0, 38.5), (50.0, 46.0, 45.0),
                                              (42.0, 41.0, 40.0)])
    assert doc["policies"]["kvflow"]["workload"] == saved["policies"]["kvflow"]["workload"]
    assert (tmp_path / "again.png").stat().st_size > 0
    assert "EXPERIMENT" not in res.output
    # a run made under an experiment's script says so first
    path.write_text(json.dumps({**saved, "experiment": "EXPERIMENT: copies moved no bytes"}))
    res = CliRunner().invoke(app, ["bench", "show", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0 and res.output.startswith("EXPERIMENT: copies moved no bytes")
    # not a result: a clear error, exit 2
    (tmp_path / "bad.json").write_text('{"policies": []}')
    res = CliRunner().invoke(app, ["bench", "show", str(tmp_path / "bad.json")])
    assert res.exit_code == 2 and "not a kvflow bench result" in res.output


def test_ranges_in_an_80_column_table_break_between_their_numbers():
    """A five-column run shown in an 80-column terminal: a ``lo-hi`` range that does not fit
    its column goes on two lines after its hyphen (rich alone folded it inside a number:
    "0.88-1.0" over "2"); every number of every range is printed whole."""
    import re
    from pathlib import Path

    path = Path(report.__file__).parent / "results" / "wf_1_idle_12t.json"
    _, results, _ = report.from_json(json.loads(path.read_text()))
    assert len(results) == 5
    ranges = [m for _, vals in report_rows.rows(results, wide=False, figures=Figures(results))
              for v in vals if (m := report._RANGE.fullmatch(v))]
    assert len(ranges) >= 10
    res = CliRunner().invoke(app, ["bench", "show", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    # every number printed (a hyphen right after a digit separates a range's two)
    numbers = set(re.findall(r"-?[0-9][0-9.]*[0-9]", re.sub(r"(?<=[0-9])-", " ", res.output)))
    for m in ranges:
        assert m.group(1) in numbers and m.group(2) in numbers, m.group(0)
    assert report._break_range("0.88-1.02") == "0.88-\n1.02"
    assert report._break_range("-0.19-1.50") == "-0.19-\n1.50"
    assert report._break_range("480 (0)") == "480 (0)"


def test_a_variant_label_in_an_80_column_table_breaks_after_its_hyphen():
    """A ``--policy-variant`` column (``hicache-always``) in an 80-column terminal: its label
    goes on two lines after its hyphen, each part whole (rich alone folded it inside the
    word: "hicache-alway" over "s"); a table that fits keeps every label on one line."""
    from pathlib import Path

    path = Path(report.__file__).parent / "results" / "wf_32_s37_3t.json"
    _, results, _ = report.from_json(json.loads(path.read_text()))
    assert "hicache-always" in [r.policy for r in results]
    res = CliRunner().invoke(app, ["bench", "show", str(path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    words = [w for line in lines for w in line.split()]
    assert "hicache-" in words and "always" in words and "hicache-alway" not in words
    wide = CliRunner().invoke(app, ["bench", "show", str(path)], env={"COLUMNS": "200"})
    assert wide.exit_code == 0 and "hicache-always" in wide.output.split()
    assert report._break_label("kvflow-la2") == "kvflow-\nla2" and report._break_label("lru") == "lru"


def test_achievable_saving_pairs_trials_and_reports_the_spread():
    rs = [_trial_result("lru", [2.0, 2.2, 3.0]), _trial_result("hicache", [1.5, 1.6, 1.5]),
          _trial_result("kvflow", [1.05, 1.1, 1.2]), _trial_result("oracle", [1.0, 1.0, 1.0])]
    sav = stats.saving_ratios(rs)
    assert set(sav) == {"hicache", "kvflow"} and set(sav["kvflow"]) == {"lru", "hicache"}
    assert set(sav["hicache"]) == {"lru"}          # no column is compared with itself
    k = sav["kvflow"]["lru"]
    # pooled p50s: lru 2.2, kvflow 1.1, oracle 1.0 -> 1.1 / 1.2
    assert k["ratio"] == pytest.approx(1.1 / 1.2)
    # per trial: (2-1.05)/1 = 0.95, (2.2-1.1)/1.2 = 0.9167, (3-1.2)/2 = 0.9
    assert [t for t, _ in k["trials"]] == [0, 1, 2]
    assert [v for _, v in k["trials"]] == pytest.approx([0.95, 1.1 / 1.2, 0.9])
    assert (k["min"], k["max"]) == pytest.approx((0.9, 0.95)) and k["median"] == pytest.approx(1.1 / 1.2)
    h = sav["kvflow"]["hicache"]
    assert [v for _, v in h["trials"]] == pytest.approx([0.45 / 0.5, 0.5 / 0.6, 0.3 / 0.5])
    # a trial in which the oracle saves nothing over the baseline has no ratio
    rs2 = [_trial_result("lru", [1.0, 2.0]), _trial_result("kvflow", [1.0, 1.5]),
           _trial_result("oracle", [1.0, 1.0])]
    assert stats.saving_ratios(rs2)["kvflow"]["lru"]["trials"] == [[1, 0.5]]
    # targets carry the spread; the narrow table shows it; no oracle column: nothing to judge
    got = report.check_targets(rs, report.SAVING_TARGETS)
    assert got[0]["met"] is False and got[0]["trial_min"] == pytest.approx(0.9)
    names = [n for n, _ in report_rows.rows(rs, wide=False)]
    assert "saving vs lru" in names and "saving vs hicache" in names
    vals = dict(report_rows.rows(rs, wide=False))["saving vs lru"]
    assert vals == ["-", "0.58", "0.92", "-"]       # hicache (2.2-1.5)/1.2, kvflow 1.1/1.2
    ci = k["ci"]                                    # mean-based: (7.2-3.35)/(7.2-3) = 0.917
    assert ci["lo"] <= 3.85 / 4.2 <= ci["hi"] and ci["level"] == stats.CI_LEVEL
    row = dict(report_rows.rows(rs, wide=False))["  90% CI (mean)"]
    assert row[2] == f"{h['ci']['lo']:.2f}-{h['ci']['hi']:.2f}" and row[0] == "-"
    assert got[0]["ci"] == ci
    assert stats.saving_ratios(rs[:3]) == {}
    assert "saving vs hicache, pool" not in names            # no oracle-pool column
    # with the pool oracle: each policy's share of *its* saving over hicache, and its own share
    # of the unbounded oracle's (what any policy could take with this pool)
    rs3 = rs + [_trial_result("oracle-pool", [1.1, 1.2, 1.1])]
    pool = stats.saving_ratios(rs3, oracle="oracle-pool")
    assert pool["kvflow"]["hicache"]["ratio"] == pytest.approx((1.5 - 1.1) / (1.5 - 1.1))
    assert [v for _, v in pool["kvflow"]["hicache"]["trials"]] == pytest.approx(
        [0.45 / 0.4, 0.5 / 0.4, 0.3 / 0.4])
    assert "oracle-pool" not in pool and "lru" not in pool
    assert stats.saving_ratios(rs3)["oracle-pool"]["hicache"]["ratio"] == pytest.approx(0.4 / 0.5)
    table = dict(report_rows.rows(rs3, wide=False))
    assert table["saving vs hicache, pool"] == ["-", "-", "1.00", "-", "-"]
    assert report.to_json({}, rs3)["saving_same_pool"]["kvflow"]["hicache"]["ratio"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------ cache-cost saving
def test_cache_cost_saving_from_counters():
    """Recomputed tokens x calibrated s/token + exposed load: the saving ratio on it."""
    def res(p, miss, exposed):
        return PolicyResult(p, {"miss_rate": miss, "prompt_tokens": 1000, "workflow_latency_p50_s": 1.0},
                            {"load_exposed_s": exposed})
    rs = [res("lru", 1.0, 0.0), res("hicache", 0.1, 2.0), res("kvflow", 0.06, 0.1), res("oracle", 0.05, 0.0)]
    spt = stats.annotate_cache_cost(rs, {"calibration": {"recompute_s": 0.5, "prefix_tokens": 100}})
    assert spt == 0.005
    assert [r.workload["cache_cost_s"] for r in rs] == pytest.approx([5.0, 2.5, 0.4, 0.25])
    cs = stats.cost_saving(rs)
    assert cs["kvflow"]["lru"] == pytest.approx(4.6 / 4.75) and cs["kvflow"]["hicache"] == pytest.approx(2.1 / 2.25)
    assert stats.annotate_cache_cost(rs, {}) is None
    assert "cost saving vs lru" in dict(report_rows.rows(rs, wide=False))
    # without the oracle, the pool oracle is the reference (neither evicts: the same cost)
    rs[3] = PolicyResult("oracle-pool", rs[3].workload, rs[3].server)
    assert stats.cost_saving(rs)["kvflow"]["hicache"] == pytest.approx(2.1 / 2.25)
    assert "oracle-pool" not in stats.cost_saving(rs)
