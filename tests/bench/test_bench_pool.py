"""``kvflow bench pool`` (:mod:`kvflow_agents.bench.pool`): stored runs of one workload pooled
into one sample. A run pooled alone gives ``kvflow bench show``'s figures; the pool's interval
resamples trials within each run; runs of different workloads, or without the policy, are
refused with a clear error. No server is started."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import pool, report, speed, stats
from kvflow_agents.bench.runner import PolicyResult
from kvflow_agents.cli.main import app

WORKLOAD = {"agents": 10, "variant": "cycle", "fixed": 1024, "dynamic": 32, "output": 16, "rounds": 4,
            "warmup_rounds": 1, "workflows": 1, "share_prompts": False, "hints": "on"}
SERVER = {"model": "tiny-random", "device_tokens": 4096, "host_tokens": 22080, "page_size": 16}


def _result(policy, per_trial, skew=1.0):
    """``skew``: trials as several workflows give them, each trial's median, whose mean is not
    the mean over every workflow (that is ``skew`` x theirs)."""
    from statistics import mean, median
    return PolicyResult(policy, {"workflow_latency_p50_s": median(per_trial),
                                 "workflow_latency_mean_s": skew * mean(per_trial),
                                 "workflow_latency_trials_s": [[i, v] for i, v in enumerate(per_trial)],
                                 "calls": 40, "errors": 0})


def _save(tmp_path, name, cols, skew=None, **meta_over):
    """A stored `kvflow bench workflow --json` run with these per-trial latencies per policy."""
    results = [_result(p, v, (skew or {}).get(p, 1.0)) for p, v in cols.items()]
    meta = {"bench": "workflow", "command": "kvflow bench workflow --trials 5",
            "workload": dict(WORKLOAD), "server": dict(SERVER)}
    for k, v in meta_over.items():
        part, key = k.split("__")
        meta[part][key] = v
    path = tmp_path / name
    path.write_text(json.dumps(report.to_json(meta, results, report.WORKFLOW_TARGETS)))
    return path, results


RUN_A = {"lru": [3.0, 3.2, 2.9, 3.1, 3.3], "hicache": [1.50, 1.62, 1.41, 1.55, 1.60],
         "kvflow": [1.02, 1.10, 0.98, 1.05, 1.12], "oracle": [1.00, 1.05, 0.97, 1.01, 1.06]}
RUN_B = {"lru": [2.6, 2.7, 2.5, 2.8], "hicache": [1.30, 1.36, 1.25, 1.33],
         "kvflow": [0.95, 0.93, 0.90, 0.97], "oracle": [0.90, 0.92, 0.88, 0.93]}


def test_a_run_pooled_alone_gives_what_bench_show_derives(tmp_path):
    path, results = _save(tmp_path, "a.json", RUN_A, skew={"kvflow": 1.02})
    out = pool.pool([pool.load_run(str(path))])
    shown = stats.saving_ratios(results)["kvflow"]
    for f in (out["runs"][0], out["pooled"]):
        assert f["trials"] == 5
        for base in ("lru", "hicache"):
            B, K, O = (sum(RUN_A[c]) for c in (base, "kvflow", "oracle"))
            assert f["saving"][base]["ratio"] == pytest.approx((B - K) / (B - O))   # the trials' sums
            assert f["saving"][base]["ci"] == shown[base]["ci"]   # the same statistic, the same draws
            # not the mean over every workflow, which bench show prints beside that interval
            assert shown[base]["ratio_mean"] < f["saving"][base]["ratio"] - 0.01
        lat = speed.paired_ratio(results, "kvflow")
        assert f["latency_vs_reference"] == pytest.approx(lat)
    assert out["baselines"] == ["lru", "hicache"]
    assert out["workload"] == "cycle of 10 agents, 1024/32/16 tokens, 1 workflow, tiny-random"


def test_the_pool_sums_every_runs_trials_and_resamples_within_each_run(tmp_path):
    a, _ = _save(tmp_path, "a.json", RUN_A)
    b, _ = _save(tmp_path, "b.json", RUN_B)
    out = pool.pool([pool.load_run(str(a)), pool.load_run(str(b))])
    p = out["pooled"]
    assert p["trials"] == 9 and [r["run"] for r in out["runs"]] == ["a.json", "b.json"]
    H, K, O = (sum(RUN_A[c]) + sum(RUN_B[c]) for c in ("hicache", "kvflow", "oracle"))
    s = p["saving"]["hicache"]
    assert s["ratio"] == pytest.approx((H - K) / (H - O))
    assert s["ci"]["lo"] < s["ratio"] < s["ci"]["hi"]
    logs = [math.log(k / o) for run in (RUN_A, RUN_B) for k, o in zip(run["kvflow"], run["oracle"])]
    assert p["latency_vs_reference"]["ratio"] == pytest.approx(math.exp(sum(logs) / len(logs)))
    assert p["latency_vs_reference"]["lo"] < p["latency_vs_reference"]["ratio"] < p["latency_vs_reference"]["hi"]
    # per run: each run's own figures
    assert out["runs"][1]["saving"]["hicache"]["ratio"] == pytest.approx(
        (sum(RUN_B["hicache"]) - sum(RUN_B["kvflow"])) / (sum(RUN_B["hicache"]) - sum(RUN_B["oracle"])))


def test_stratified_resamples_keep_each_runs_weight():
    """Two runs, each of identical trials, on boxes of different speed: resampling within each
    run can only redraw the same trials, so the interval is the point; resampling the pooled
    trials as one sample mixes the runs' counts and spreads."""
    fast, slow = [(2.0, 1.1, 1.0)] * 4, [(4.0, 2.8, 2.0)] * 6
    trials = fast + slow
    point = (sum(t[0] for t in trials) - sum(t[1] for t in trials)) / (
        sum(t[0] for t in trials) - sum(t[2] for t in trials))
    within = stats.saving_interval(trials, strata=[4, 6])
    assert within["lo"] == pytest.approx(point) and within["hi"] == pytest.approx(point)
    mixed = stats.saving_interval(trials)
    assert mixed["hi"] - mixed["lo"] > 0.05
    # one stratum is the unstratified draws exactly (stored intervals depend on them)
    assert stats.saving_interval(trials, strata=[10]) == mixed
    with pytest.raises(ValueError, match="do not partition"):
        stats.saving_interval(trials, strata=[4, 5])
    with pytest.raises(ValueError, match="do not partition"):
        stats.paired_bootstrap(lambda idx: 0.0, 3, strata=[3, 0])


def test_a_trial_missing_from_one_column_leaves_that_runs_stratum(tmp_path):
    path, _ = _save(tmp_path, "a.json", RUN_A)
    doc = json.loads(path.read_text())
    doc["policies"]["hicache"]["workload"]["workflow_latency_trials_s"].pop(2)   # trial 2 failed there
    path.write_text(json.dumps(doc))
    out = pool.pool([pool.load_run(str(path))])
    f = out["runs"][0]
    assert f["trials"] == 4
    keep = [0, 1, 3, 4]
    H, K, O = (sum(RUN_A[c][i] for i in keep) for c in ("hicache", "kvflow", "oracle"))
    assert f["saving"]["hicache"]["ratio"] == pytest.approx((H - K) / (H - O))


def test_runs_of_different_workloads_or_without_the_policy_are_refused(tmp_path):
    a, _ = _save(tmp_path, "a.json", RUN_A)
    b, _ = _save(tmp_path, "b.json", RUN_B, workload__workflows=8, workload__rounds=2)
    with pytest.raises(ValueError, match=r"workload.rounds \(4 against 2\), workload.workflows \(1 against 8\)"):
        pool.pool([pool.load_run(str(a)), pool.load_run(str(b))])
    c, _ = _save(tmp_path, "c.json", {k: v for k, v in RUN_B.items() if k != "kvflow"})
    with pytest.raises(ValueError, match="c.json has no 'kvflow' column"):
        pool.pool([pool.load_run(str(a)), pool.load_run(str(c))])
    # a baseline only some runs have is left out, not an error
    d, _ = _save(tmp_path, "d.json", {k: v for k, v in RUN_B.items() if k != "lru"})
    out = pool.pool([pool.load_run(str(a)), pool.load_run(str(d))])
    assert out["baselines"] == ["hicache"]
    (tmp_path / "x.json").write_text('{"bench": "aiperf", "policies": {"kvflow": {"workload": {}}}}')
    with pytest.raises(ValueError, match="x.json: a 'aiperf' result"):
        pool.load_run(str(tmp_path / "x.json"))


def test_bench_pool_prints_80_columns_a_verdict_json_and_a_plot(tmp_path):
    a, _ = _save(tmp_path, "wf_1_run_a.json", RUN_A)
    b, _ = _save(tmp_path, "wf_1_run_b.json", RUN_B)
    out_json, out_png = tmp_path / "pool.json", tmp_path / "pool.png"
    res = CliRunner().invoke(app, ["bench", "pool", str(a), str(b), "--json", str(out_json),
                                   "--plot", str(out_png)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    assert "wf_1_run_a" in res.output and "pooled" in res.output
    doc = json.loads(out_json.read_text())
    assert doc["command"].startswith("kvflow bench pool")
    s = doc["pooled"]["saving"]["hicache"]
    verdict = report.ci_verdict(s["ci"], 0.95)
    assert f"pooled vs hicache: {s['ratio']:.3f} of the oracle's saving over 9 trials" in res.output
    assert verdict.split(":")[0] in res.output
    assert out_png.stat().st_size > 0
    # another workload: exit 2 and the keys that differ
    c, _ = _save(tmp_path, "wf_8.json", RUN_B, workload__workflows=8)
    res = CliRunner().invoke(app, ["bench", "pool", str(a), str(c)], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "workload.workflows (1 against 8)" in res.output


def test_a_result_records_its_code_and_the_pool_names_the_versions(tmp_path):
    """Every written result records the code that made it (bench/provenance.py); re-written
    from a stored run, it keeps the run's record; the pool says which versions it pooled."""
    import subprocess
    from pathlib import Path

    from kvflow_agents.bench import provenance

    here = provenance.code_version()
    root = Path(provenance.__file__).resolve().parents[2]
    if (root / ".git").exists():  # a checkout (CI's clone): the commit it runs
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        assert here["git"] == head and isinstance(here["dirty"], bool)
    path, results = _save(tmp_path, "new.json", RUN_A)
    old = json.loads(path.read_text())
    assert "code" not in old  # as every run stored before the record
    report.write_json(report.to_json({"bench": "workflow"}, results), str(tmp_path / "w.json"))
    assert json.loads((tmp_path / "w.json").read_text())["code"] == here
    meta, res, targets = report.from_json(old)  # `bench show --json`: the stored run's record
    report.write_json(report.to_json(meta, res, targets), str(tmp_path / "shown.json"))
    assert json.loads((tmp_path / "shown.json").read_text())["code"] is None

    def stored(name, code):
        p, _ = _save(tmp_path, name, RUN_B)
        doc = json.loads(p.read_text())
        doc["code"] = code
        p.write_text(json.dumps(doc))
        return pool.load_run(str(p))

    v1, v2 = {"package": "0.1.0", "git": "a" * 40, "dirty": False}, {"git": "b" * 40, "dirty": True}
    same = pool.pool([stored("a.json", v1), stored("b.json", v1)])
    assert [r["code"] for r in same["runs"]] == ["aaaaaaaaaa"] * 2
    assert pool.verdict_lines(same)[0] == "code: every run on aaaaaaaaaa"
    mixed = pool.pool([stored("a.json", v1), stored("c.json", v2), stored("d.json", None)])
    line = pool.verdict_lines(mixed)[0]
    assert line.startswith("code: 1 run on aaaaaaaaaa; 1 run on bbbbbbbbbb+dirty; 1 run with no record")


def test_a_run_records_the_code_it_started_with(tmp_path, monkeypatch):
    """A bench command records the checkout when it starts (the ``bench`` group's callback), so
    a commit made while it runs is not named as its code; commands that only re-read stored
    runs (``show``, ``pool``) ask git nothing."""
    from kvflow_agents.bench import provenance
    from kvflow_agents.cli.main import app

    states = iter([{"git": "a" * 40, "dirty": False}, {"git": "b" * 40, "dirty": False}])
    asked = []

    def checkout_state(root):
        asked.append(root)
        return next(states)

    monkeypatch.setattr(provenance, "checkout_state", checkout_state)
    provenance.code_version.cache_clear()
    try:
        path, _ = _save(tmp_path, "stored.json", RUN_A)
        for cmd in (["bench", "show", str(path)], ["bench", "pool", str(path), str(path)]):
            CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
        assert asked == []
        # a bad flag stops the command after the group's callback, before any server starts
        res = CliRunner().invoke(app, ["bench", "workflow", "--rounds", "many"])
        assert res.exit_code == 2 and len(asked) == 1
        # ... the checkout is committed meanwhile; the JSON, written at the end, names the start
        report.write_json(report.to_json({"bench": "workflow"}, _save(tmp_path, "x.json", RUN_A)[1]),
                          str(tmp_path / "w.json"))
        assert json.loads((tmp_path / "w.json").read_text())["code"]["git"] == "a" * 40
    finally:
        provenance.code_version.cache_clear()  # the next test asks the real checkout


def test_a_checkout_is_dirty_only_where_its_code_differs(tmp_path):
    """``dirty``: a changed tracked ``.py`` file (at any depth) or pyproject.toml, not an edited
    README or result file, nor a new untracked file; outside a checkout nothing is claimed."""
    import subprocess

    from kvflow_agents.bench.provenance import checkout_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("# r\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    state = checkout_state(tmp_path)
    assert len(state["git"]) == 40 and state["dirty"] is False
    (tmp_path / "README.md").write_text("# edited\n")
    (tmp_path / "new.py").write_text("y = 2\n")        # untracked
    assert checkout_state(tmp_path)["dirty"] is False
    (tmp_path / "pkg" / "mod.py").write_text("x = 2\n")
    assert checkout_state(tmp_path)["dirty"] is True
    assert checkout_state(tmp_path / "pkg") == {"git": None, "dirty": None}  # no .git there
