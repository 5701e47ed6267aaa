"""``kvflow bench``: the synthetic workload (token lengths, hint sequences over the wire), the
CLI (one small real run on two embedded servers, an external server), the paper-regime preset,
progress bars, and the runner (counter deltas, policy lists, measured rounds, servers per
trial); a section each, in that order. The report's numbers: test_bench_stats.py; ``bench
peer``: test_bench_peer.py.

No timed assertions: the numbers depend on the machine. Only shapes, fields and invariants."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import report, report_rows
from kvflow_agents.bench.runner import metrics_delta, parse_policies, rotated
from kvflow_agents.bench.driver import WorkflowDriver
from kvflow_agents.bench.workload import (ByteLevelCounter, Prompts, TokenCounter, WorkloadSpec,
                                          build_graph, fixed_prompt_tokens, steps)
from kvflow_agents.cli.main import app
from kvflow_agents.testing import RecordingOpenAIServer


# ------------------------------------------------------------------------------ token lengths
@pytest.mark.parametrize("n", [1, 7, 16, 255, 1024])
def test_byte_level_text_has_exact_length(n):
    c = ByteLevelCounter()
    t = c.make_text(n, random.Random(n), "lead")
    assert c.count(t) == n == len(t) and t.isascii()


def test_prompts_lengths_distinct_and_deterministic():
    spec = WorkloadSpec(agents=4, fixed=256, dynamic=32, output=8, workflows=2, seed=3)
    c = ByteLevelCounter()
    p, q = Prompts(spec, c), Prompts(spec, c)
    fixed = {(w, a): p.fixed(w, a) for w in range(2) for a in spec.agent_names()}
    assert all(c.count(t) == 256 for t in fixed.values())
    assert len(set(fixed.values())) == 8                       # per agent and per workflow
    assert len({t[:16] for t in fixed.values()}) == 8          # distinct from the first page
    assert fixed[(1, "agent_2")] == q.fixed(1, "agent_2")      # deterministic
    dyn = [p.dynamic(0, r, "agent_0") for r in range(3)]
    assert all(c.count(d) == 32 for d in dyn) and len(set(dyn)) == 3
    assert fixed_prompt_tokens(spec, c) == 8 * 256
    shared = WorkloadSpec(agents=4, fixed=256, workflows=2, share_prompts=True)
    ps = Prompts(shared, c)
    assert ps.fixed(0, "agent_1") == ps.fixed(1, "agent_1")
    assert fixed_prompt_tokens(shared, c) == 4 * 256
    # a repeated trial sends the same fixed prompts but new dynamic parts
    t1 = Prompts(spec, c, trial=1)
    assert t1.fixed(0, "agent_0") == p.fixed(0, "agent_0")
    assert t1.dynamic(0, 0, "agent_0") != p.dynamic(0, 0, "agent_0")
    # the word-based fallback counts one token per word
    assert TokenCounter().count(TokenCounter().make_text(50, random.Random(0))) == 50


def test_spec_validation_and_steps():
    with pytest.raises(ValueError):
        WorkloadSpec(variant="ring").validate()
    with pytest.raises(ValueError):
        WorkloadSpec(variant="fanout", agents=2).validate()
    spec = WorkloadSpec(agents=5, variant="fanout")
    assert steps(spec) == [["head"], ["worker_1", "worker_2", "worker_3"], ["tail"]]
    g = build_graph(spec)
    assert g.joins("tail") == [["worker_1", "worker_2", "worker_3"]]
    assert steps(WorkloadSpec(agents=3)) == [["agent_0"], ["agent_1"], ["agent_2"]]


# ------------------------------------------------------------------------------ hints on the wire
def _drive(spec: WorkloadSpec, stream: bool = True):
    with RecordingOpenAIServer(reply=lambda body: "a b c") as srv:
        drv = WorkflowDriver(spec, srv.base_url, "stub", counter=ByteLevelCounter(), run_id="t",
                             stream=stream)
        res = asyncio.run(drv.run())
        return res, srv.llm_requests(), srv.hint_posts()


def test_cycle_hint_sequence_over_the_wire():
    spec = WorkloadSpec(agents=3, fixed=64, dynamic=16, output=4, rounds=2, warmup_rounds=1)
    res, reqs, posts = _drive(spec)
    assert len(reqs) == 9 and len(res.calls) == 9
    assert [r.hints["kvflow_agent"] for r in reqs] == ["agent_0", "agent_1", "agent_2"] * 3
    first = reqs[0].hints
    assert first["kvflow_v"] == 1 and first["kvflow_workflow"] == "bench-t-wf0"
    assert first["kvflow_ste"] == {"agent_0": 0, "agent_1": 1, "agent_2": 2}
    assert first["kvflow_next"] == ["agent_1"] and first["kvflow_fixed_messages"] == 1
    assert reqs[2].hints["kvflow_ste"] == {"agent_0": 1, "agent_1": 2, "agent_2": 0}
    steps_sent = [r.hints["kvflow_step"] for r in reqs]
    assert steps_sent == sorted(steps_sent) and len(set(steps_sent)) == 9
    body = reqs[4].body
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert len(body["messages"][0]["content"]) == 64 and len(body["messages"][1]["content"]) == 16
    assert reqs[0].headers["x-kvflow-agent"] == "agent_0"
    # the same agent sends the same fixed prompt every round, a new dynamic part every call
    a0 = [r.body["messages"] for r in reqs if r.hints["kvflow_agent"] == "agent_0"]
    assert len({m[0]["content"] for m in a0}) == 1 and len({m[1]["content"] for m in a0}) == 3
    # out-of-band end, after the last LLM request
    assert len(posts) == 1 and posts[0].body["kvflow_event"] == "end"
    assert posts[0].body["kvflow_workflow"] == "bench-t-wf0" and posts[0].time >= reqs[-1].time
    # measured vs warm-up
    assert sum(c.measured for c in res.calls) == 6 and sum(r.measured for r in res.rounds) == 2
    assert all(c.ok and c.ttft_s <= c.latency_s for c in res.calls)


def test_fanout_hints_and_concurrent_workflows():
    spec = WorkloadSpec(agents=4, variant="fanout", fixed=32, dynamic=8, output=2, rounds=1,
                        warmup_rounds=0, workflows=2)
    res, reqs, posts = _drive(spec, stream=False)
    assert len(reqs) == 8 and {r.hints["kvflow_workflow"] for r in reqs} == {"bench-t-wf0", "bench-t-wf1"}
    for wf in ("bench-t-wf0", "bench-t-wf1"):
        mine = [r.hints for r in reqs if r.hints["kvflow_workflow"] == wf]
        head = next(h for h in mine if h["kvflow_agent"] == "head")
        assert head["kvflow_ste"] == {"head": 0, "worker_1": 1, "worker_2": 1, "tail": 2}
        workers = [h for h in mine if h["kvflow_agent"].startswith("worker")]
        assert len(workers) == 2 and workers[0]["kvflow_step"] == workers[1]["kvflow_step"]
        assert all(h["kvflow_ste"]["worker_1"] == 0 == h["kvflow_ste"]["worker_2"] for h in workers)
        assert all(h["kvflow_ste"]["tail"] == 1 and h["kvflow_next"] == ["tail"] for h in workers)
        tail = next(h for h in mine if h["kvflow_agent"] == "tail")
        assert tail["kvflow_ste"]["head"] == 1 and tail["kvflow_step"] > workers[0]["kvflow_step"]
    assert sorted(p.body["kvflow_workflow"] for p in posts) == ["bench-t-wf0", "bench-t-wf1"]


# ------------------------------------------------------------------------------ CLI
def test_cli_rejects_bad_flags():
    runner = CliRunner()
    env = {"COLUMNS": "200"}
    r = runner.invoke(app, ["bench", "workflow", "--variant", "ring"], env=env)
    assert r.exit_code == 2 and "cycle" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--policies", "lru,fifo"], env=env)
    assert r.exit_code == 2 and "fifo" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--variant", "fanout", "--agents", "2"], env=env)
    assert r.exit_code == 2 and "3 agents" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--device-tokens", "64", "--host-link-gbps", "1"], env=env)
    assert r.exit_code == 2 and "cannot hold one request" in r.output
    r = runner.invoke(app, ["bench", "peer", "--framework", "crewai"], env=env)
    assert r.exit_code == 2 and "langgraph or autogen" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--server-threads", "-1"], env=env)
    assert r.exit_code == 2 and "--server-threads" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--server-flag", "partial-eviction"], env=env)
    assert r.exit_code == 2 and "--server-flag" in r.output and "not a kvflow serve option" in r.output
    r = runner.invoke(app, ["bench", "peer", "--server-flag", "deterministic"], env=env)
    assert r.exit_code == 2 and "not a kvflow serve option" in r.output
    r = runner.invoke(app, ["bench", "peer", "--server-flag=--deterministic", "--base-url",
                            "http://127.0.0.1:9/v1"], env=env)
    assert r.exit_code == 2 and "not with --base-url" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--server-flag=--whole-node-eviction",
                            "--base-url", "http://127.0.0.1:9/v1"], env=env)
    assert r.exit_code == 2 and "--server-flag" in r.output and "--base-url" in r.output
    for bad, why in (("kvflow-m8", "LABEL=POLICY"), ("kvflow=kvflow", "new name"), ("a b=kvflow", "new name"),
                     ("m8=fifo", "not a policy"), ("m8=kvflow whole-node-eviction", "not a kvflow serve option")):
        r = runner.invoke(app, ["bench", "workflow", "--policy-variant", bad], env=env)
        assert r.exit_code == 2 and "--policy-variant" in r.output and why in r.output, (bad, r.output)
    r = runner.invoke(app, ["bench", "peer", "--policy-variant", "w=kvflow --whole-node-eviction",
                            "--base-url", "http://127.0.0.1:9/v1"], env=env)
    assert r.exit_code == 2 and "--policy-variant" in r.output and "--base-url" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--policy-variant", "w=kvflow --whole-node-eviction",
                            "--base-url", "http://127.0.0.1:9/v1"], env=env)
    assert r.exit_code == 2 and "--policy-variant" in r.output and "--base-url" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--fresh-servers", "--base-url", "http://127.0.0.1:9/v1"],
                      env=env)
    assert r.exit_code == 2 and "not with --base-url" in r.output
    r = runner.invoke(app, ["bench", "workflow", "--help"], env=env)
    assert r.exit_code == 0 and "--host-link-gbps" in r.output and "--device-fraction" in r.output


def test_small_real_run_through_the_cli(tmp_path):
    """tiny-random, 4 agents, fixed 256, 2 rounds, lru vs kvflow and a variant of kvflow, calibrated
    link: JSON + PNG."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = CliRunner().invoke(app, [
        "bench", "workflow", "--agents", "4", "--fixed", "256", "--dynamic", "32", "--output", "8",
        "--rounds", "2", "--trials", "1", "--policies", "lru,kvflow", "--model", "tiny-random",
        "--device-tokens", "1024", "--json", str(out), "--plot", str(png), "--no-progress",
        "--server-flag=--whole-node-eviction", "--policy-variant", "kvflow-part=kvflow --partial-eviction"],
        env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "speedup vs lru" in r.output and "GB/s" in r.output
    # readable in an 80-column terminal: nothing wider, no cell cut short
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not [line for line in lines if "…" in line and not line.startswith("calibrating")]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "workflow" and doc["workload"]["agents"] == 4
    cal = doc["calibration"]
    assert cal["link_gbps"] > 0 and cal["recompute_s"] > 0 and cal["kv_bytes_per_token"] > 0
    assert doc["server"]["host_link_gbps"] == cal["link_gbps"] and doc["server"]["device_tokens"] == 1024
    assert list(doc["policies"]) == ["lru", "kvflow", "kvflow-part"]   # a variant follows its policy
    for name, p in doc["policies"].items():
        w = p["workload"]
        assert w["calls"] == 8 and w["errors"] == 0 and w["workflow_rounds"] == 2
        for key in ("workflow_latency_mean_s", "ttft_mean_s", "ttft_p90_s", "device_hit_rate",
                    "host_hit_rate", "miss_rate", "load_wait_s", "prompt_tokens"):
            assert w[key] is not None, (name, key)
        assert w["prompt_tokens"] >= 8 * (256 + 32)
        s = p["server"]
        for key in ("hit_tokens_device", "hit_tokens_host", "miss_tokens", "load_hidden_s",
                    "load_exposed_s", "prefetch_issued", "prefetch_used", "device_rate"):
            assert key in s, (name, key)
        fwd = s["engine_prefill_forward_s"] + s["engine_decode_forward_s"]  # within the busy steps
        assert s["engine_busy_s"] >= fwd + s["engine_copy_s"] and fwd > 0
        assert s["engine_process_cpu_s"] >= s["engine_thread_cpu_s"] > 0 < s["http_process_cpu_s"]
        argv = p["serve_argv"]
        assert argv[argv.index("--policy") + 1] == name.split("-")[0]
    lru, kv = doc["policies"]["lru"], doc["policies"]["kvflow"]
    assert lru["workload"]["host_hit_rate"] == 0 and lru["server"]["prefetch_issued"] == 0
    # the servers leave the client a core (torch threads), calibration timed the same way
    from kvflow_agents.bench.server import client_core_threads
    assert doc["server"]["torch_threads"] == client_core_threads()
    assert f"--torch-threads {client_core_threads()}" in " ".join(lru["serve_argv"])
    # --server-flag reaches every server (they started with it)
    assert doc["server"]["extra_args"] == ["--whole-node-eviction"]
    assert doc["policies"]["lru"]["serve_argv"][-1] == "--whole-node-eviction"
    # ... and a variant's own options come after them, on its server only
    part = doc["policies"]["kvflow-part"]
    assert part["serve_argv"][-2:] == ["--whole-node-eviction", "--partial-eviction"]  # the last wins
    assert doc["server"]["variants"] == {"kvflow-part": ["kvflow", ["--partial-eviction"]]}
    assert part["workload"]["calls"] == 8 and part["workload"]["errors"] == 0
    # identical server flags apart from --policy
    strip = lambda argv: [a for a in argv if a not in ("lru", "kvflow")]  # noqa: E731
    assert strip(lru["serve_argv"]) == strip(kv["serve_argv"])
    # kvflow: the fixed prompts come back from host or are prefetched (not recomputed)
    assert kv["workload"]["miss_rate"] < lru["workload"]["miss_rate"]
    assert kv["server"]["prefetch_issued"] > 0
    assert set(doc["ratios"]) == {"lru", "kvflow", "kvflow-part"}
    assert math.isclose(doc["ratios"]["lru"]["speedup_vs_lru"], 1.0)
    assert [t["target"] for t in doc["targets"]][0] == "kvflow >= 3x lru"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the JSON re-renders as the Markdown table (python -m kvflow_agents.bench.report FILE)
    md = report.plain_table(report.results_from_json(doc))
    assert md.startswith("| metric | lru | kvflow |") and "| speedup vs lru |" in md
    busy = next(line for line in md.splitlines() if line.startswith("| engine busy / its CPU (ms per call) |"))
    assert all(re.fullmatch(r"[0-9.]+ / [0-9.]+", cell.strip()) for cell in busy.split("|")[2:-1]), busy


def test_base_url_mode_against_a_recording_server(tmp_path):
    """--base-url: one 'external' column, hints on every request, no server started."""
    out = tmp_path / "ext.json"
    with RecordingOpenAIServer(reply=lambda body: "x y") as srv:
        r = CliRunner().invoke(app, [
            "bench", "workflow", "--base-url", srv.base_url, "--served-model", "stub", "--agents", "3",
            "--fixed", "40", "--dynamic", "8", "--output", "2", "--rounds", "1", "--trials", "2",
            "--json", str(out), "--no-progress"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        reqs = srv.llm_requests()
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["external"] and doc["policies"]["external"]["server"] is None
    w = doc["policies"]["external"]["workload"]
    assert w["calls"] == 6 and w["workflow_rounds"] == 2 and w["trials"] == 2
    hinted = [q for q in reqs if q.hints]
    assert len(reqs) == 14 and len(hinted) == 12   # + one unhinted kernel warm-up per trial
    assert all(q.body["model"] == "stub" for q in reqs)
    assert len({q.hints["kvflow_workflow"] for q in hinted}) == 2   # one workflow per trial


# ------------------------------------------------------------------------ paper regime preset
def test_paper_regime_target_and_fit():
    from kvflow_agents.bench.calibrate import _fit_ratio, paper_recompute_ratio

    t = paper_recompute_ratio()
    # Llama-3.1-8B / A10G profile: recomputing 8192 tokens is 2-3x a call with them cached
    assert t["fixed"] == 8192 and t["dynamic"] == 32 and t["output"] == 32
    assert 1.5 < t["ratio"] < 4 and t["recompute_s"] > t["call_s"] > 0
    # the fit recovers an exact quadratic/linear pair and is increasing even from noisy probes
    rec = lambda n: 2e-5 * n + 1e-8 * n * n  # noqa: E731
    call = lambda n: 0.05 + 1e-6 * n  # noqa: E731
    f = _fit_ratio([[n, rec(n), call(n), rec(n) / call(n)] for n in (1024, 2048, 4096)])
    assert f(3000) == pytest.approx(rec(3000) / call(3000), rel=1e-6)
    noisy = _fit_ratio([[1024, 0.046, 0.075, 0], [2048, 0.187, 0.221, 0], [4096, 0.628, 0.183, 0]])
    assert all(noisy(a) < noisy(b) for a, b in ((512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)))
    r = CliRunner().invoke(app, ["bench", "workflow", "--preset", "gpu"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "paper" in r.output


# probes of `kvflow bench workflow --preset paper` on a box whose recompute jumps between 1,024
# and 2,048 tokens and is flat to 2,368 (results/wf_paper_s37.json): [n, recompute, call, ratio]
_KINKED_PROBES = [[1024, 0.0419, 0.0485, 0.864], [2048, 0.1201, 0.0581, 2.067],
                  [4096, 0.4441, 0.0801, 5.545], [2240, 0.1245, 0.0602, 2.067],
                  [2304, 0.1290, 0.0616, 2.093], [2368, 0.1306, 0.0631, 2.071],
                  [2304, 0.1243, 0.0603, 2.060]]


def test_paper_regime_solves_between_the_probes_that_bracket_the_target():
    """Where measured probes bracket the target ratio the next length is interpolated between
    them (each probe narrows the bracket), not taken from the fit through every probe, which
    on these probes read 2.37 at 2,304 tokens where three probes measured 2.06-2.09; the link
    is set from the probes near the chosen length, not from that fit (145 ms where 124-129 ms
    were measured)."""
    from kvflow_agents.bench.calibrate import _fit, _fit_near, _next_length

    target = 2.364
    n, capped = _next_length(_KINKED_PROBES, target, 8192)
    assert not capped and 2368 < n < 4096 and n % 64 == 0
    # the fit through every probe puts the target at 2,304, inside the measured flat part
    assert _fit(_KINKED_PROBES)[0](2304) / _fit(_KINKED_PROBES)[1](2304) == pytest.approx(2.37, abs=0.02)
    # only the first three probes: the bracket is 2,048-4,096
    n3, _ = _next_length(_KINKED_PROBES[:3], target, 8192)
    assert 2048 < n3 < 4096
    # nothing brackets it: solved on the fit, capped where even max_fixed falls short
    n2, capped2 = _next_length(_KINKED_PROBES[:2], target, 8192)
    assert n2 > 2048 and not capped2
    assert _next_length(_KINKED_PROBES[:2], 50.0, 4096) == (4096, True)
    rec, call = _fit_near(_KINKED_PROBES, 2304)
    assert 0.1243 <= rec(2304) <= 0.1306 and 0.0602 <= call(2304) <= 0.0631
    assert _fit(_KINKED_PROBES)[0](2304) > 0.14
    # a power law is recovered exactly; a single nearby length falls back to the global fit
    law = [[m, 1e-6 * m ** 1.5, 0.05 * (m / 1024) ** 0.2, 0] for m in (1024, 1280, 1536)]
    r, c = _fit_near(law, 1280)
    assert r(1400) == pytest.approx(1e-6 * 1400 ** 1.5, rel=1e-9)
    assert c(1400) == pytest.approx(0.05 * (1400 / 1024) ** 0.2, rel=1e-9)
    assert _fit_near(law[:1] + [[8192, 0.5, 0.1, 0]], 1024)[0](1024) == _fit(law[:1] + [[8192, 0.5, 0.1, 0]])[0](1024)


def test_paper_regime_probes_a_served_engine():
    """``--preset paper`` measures recompute and call on a real ``kvflow serve`` (it once sent
    the model name "default", which the server rightly refuses: the preset failed at once)."""
    from kvflow_agents.bench.calibrate import choose_fixed_for_ratio
    from kvflow_agents.bench.workload import token_counter

    log: list = []
    cal = choose_fixed_for_ratio("tiny-random", token_counter("tiny-random"), target_ratio=1.0,
                                 dynamic=16, output=4, samples=1, probes=(128, 256),
                                 max_fixed=512, log=log.append)
    assert [p[0] for p in cal.probes[:2]] == [128, 256] and len(log) == len(cal.probes)
    assert 3 <= len(cal.probes) <= 8               # 2 probes + 1 to 6 solve-and-measure rounds
    assert 64 <= cal.fixed <= 512 and cal.fixed % 64 == 0
    assert cal.probes[-1][0] == cal.fixed and cal.ratio_at_fixed == cal.probes[-1][3]
    assert cal.recompute_s > 0 and cal.call_s > 0 and cal.ratio_at_fixed > 0
    assert cal.recompute_fit_s > 0 and cal.ratio_fit > 0


# ------------------------------------------------------------------------------ progress bars
def test_progress_bars_grow_when_a_run_makes_more_calls_than_estimated():
    """PEER's call count is an estimate (a failed review adds calls): the bar's total follows
    what was done instead of printing 45/40."""
    import io

    from rich.console import Console

    from kvflow_agents.cli.bench_options import _progress

    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    with _progress(True, console) as hook:
        hook("start:kvflow", 4)
        for _ in range(6):
            hook("advance:kvflow", 1)
    text = out.getvalue()
    assert "6/6" in text and "6/4" not in text, text


# ------------------------- runner: counter deltas, policy lists, measured rounds, servers per trial
def test_metrics_delta_policy_lists_and_wasted_prefetches():
    """The server's counters as deltas over a run, the wide table's wasted-prefetch cell, and
    the policy list parsing and start-order rotation."""
    before = {"hit_tokens_device": 10, "miss_tokens": 10, "load_hidden_s": 1.0, "load_exposed_s": 0.0,
              "evictions": {"device:alloc": 1}}
    after = {"hit_tokens_device": 40, "miss_tokens": 20, "hit_tokens_host": 0, "hit_tokens_loading": 0,
             "load_hidden_s": 4.0, "load_exposed_s": 1.0, "evictions": {"device:alloc": 3}}
    d = metrics_delta(before, after)
    assert d["device_rate"] == pytest.approx(0.75) and d["load_hidden_fraction"] == pytest.approx(0.75)
    assert d["evictions"] == {"device:alloc": 2}
    # wasted prefetches by cause: deltas like the evictions, shown in the wide table
    d = metrics_delta({**before, "prefetch_wasted": 1, "prefetch_wasted_by": {"alloc": 1}},
                      {**after, "prefetch_wasted": 4, "prefetch_wasted_by": {"alloc": 2, "grow": 2}})
    assert d["prefetch_wasted"] == 3 and d["prefetch_wasted_by"] == {"alloc": 1, "grow": 2}
    assert report_rows._wasted(d) == "3 (grow 2, alloc 1)" and report_rows._wasted(None) == "-"
    assert metrics_delta(None, after) is None
    assert parse_policies("lru, kvflow") == ["lru", "kvflow"]
    assert parse_policies("kvflow,oracle-pool") == ["kvflow", "oracle-pool"]
    for bad in ("lru,fifo", "", "lru,lru"):
        with pytest.raises(ValueError):
            parse_policies(bad)
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]


def test_measured_rounds_run_on_a_collected_frozen_heap():
    """The client collects garbage between the warm-up and the measured rounds and freezes what
    survives (no full collection pauses a measured call), and unfreezes after the trial."""
    import gc

    from kvflow_agents.bench import runner

    seen = []
    spec = WorkloadSpec(agents=2, fixed=40, dynamic=8, output=2, rounds=1, warmup_rounds=1)
    with RecordingOpenAIServer(reply=lambda body: "x y") as srv:
        res, _ = runner._run_workload("external", 0, spec, srv.base_url, "stub",
                                      counter=ByteLevelCounter(), api_key=None,
                                      on_call=lambda rec: seen.append((rec.measured, gc.get_freeze_count())))
    assert len(res.calls) == 4 and sorted(m for m, _ in seen) == [False, False, True, True]
    assert all(n > 0 for m, n in seen if m)          # measured calls: the heap was frozen
    assert all(n == 0 for m, n in seen if not m)     # warm-up calls: not yet
    assert gc.get_freeze_count() == 0                # and nothing stays frozen after the trial


def test_round_interleave_runs_round_k_on_every_server_before_round_k_plus_1():
    """``--interleave round``: every server's warm-up (at once), then measured round k on each server
    (the order rotated per round), one round a barrier across that server's workflows; each
    server's workflows end after its last round. The result per server is what a whole-trial
    run gives: every call and round, measured ones flagged; measured_s sums its rounds' wall time."""
    from kvflow_agents.bench import runner

    spec = WorkloadSpec(agents=2, fixed=40, dynamic=8, output=2, rounds=3, warmup_rounds=1,
                        workflows=2)
    seen: list = []
    with RecordingOpenAIServer(reply=lambda body: "x y") as a, \
            RecordingOpenAIServer(reply=lambda body: "x y") as b:
        srv = {"a": a, "b": b}
        got = runner._run_interleaved(
            ["a", "b"], 0, spec, {p: s.base_url for p, s in srv.items()}, "stub",
            counter=ByteLevelCounter(), api_key=None,
            on_call={p: (lambda rec, p=p: seen.append((p, rec.round))) for p in srv})
        ends = {p: [e for e in s.hint_posts() if (e.body or {}).get("kvflow_event") == "end"]
                for p, s in srv.items()}
        reqs = {p: s.llm_requests() for p, s in srv.items()}
    first_measured = next(i for i, (_, rnd) in enumerate(seen) if rnd > 0)
    assert sorted(set(seen[:first_measured])) == [("a", 0), ("b", 0)]   # the warm-ups first
    rest = seen[first_measured:]
    blocks = [k for i, k in enumerate(rest) if i == 0 or rest[i - 1] != k]
    assert blocks == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    assert all(seen.count(k) == spec.workflows * spec.agents for k in blocks + [("a", 0), ("b", 0)])
    for p, (res, delta) in got.items():
        assert delta is None    # a server without cache counters: no delta, nothing invented
        assert len(res.calls) == 2 * 2 * 4 and sum(c.measured for c in res.calls) == 2 * 2 * 3
        measured = [r for r in res.rounds if r.measured]
        assert sorted((r.workflow, r.round) for r in measured) == [(w, k) for w in (0, 1) for k in (1, 2, 3)]
        longest = {k: max(r.latency_s for r in measured if r.round == k) for k in (1, 2, 3)}
        assert sum(longest.values()) <= res.measured_s     # a round's wall time, barriers included
        names = sorted(e.body["kvflow_workflow"] for e in ends[p])
        assert len(names) == 2 and all(n.startswith(f"bench-{p}-t0-") for n in names)
        assert [n[-4:] for n in names] == ["-wf0", "-wf1"]
        assert min(e.time for e in ends[p]) >= max(r.time for r in reqs[p])


def test_round_interleave_warms_every_server_up_at_once():
    """The warm-ups are not measured, so ``--interleave round`` runs them concurrently: each
    server's warm-up request waits here until the other server has one too, which one after
    the other could not happen (the first would wait out its 5 s alone)."""
    import threading

    from kvflow_agents.bench import runner

    spec = WorkloadSpec(agents=2, fixed=40, dynamic=8, output=2, rounds=1, warmup_rounds=1,
                        workflows=1)
    arrived = {"a": threading.Event(), "b": threading.Event()}
    met: dict = {}

    def reply_for(p: str, other: str):
        def reply(body: dict) -> str:
            if body["messages"][-1]["content"] == "warm up":   # runner.warm_kernels' request
                arrived[p].set()
                met[p] = arrived[other].wait(5.0)
            return "x y"
        return reply

    with RecordingOpenAIServer(reply=reply_for("a", "b")) as a, \
            RecordingOpenAIServer(reply=reply_for("b", "a")) as b:
        got = runner._run_interleaved(
            ["a", "b"], 0, spec, {"a": a.base_url, "b": b.base_url}, "stub",
            counter=ByteLevelCounter(), api_key=None, on_call={"a": lambda rec: None, "b": lambda rec: None})
    assert met == {"a": True, "b": True}
    assert all(sum(c.measured for c in res.calls) == 2 for res, _ in got.values())


def test_interleave_is_checked():
    from kvflow_agents.bench import runner

    with pytest.raises(ValueError, match="interleave"):
        runner.run_workflow_bench(WorkloadSpec(), ["lru"], None, counter=ByteLevelCounter(),
                                  base_url="http://127.0.0.1:9/v1", interleave="call")
    r = CliRunner().invoke(app, ["bench", "workflow", "--interleave", "call"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--interleave" in r.output and "trial, round" in r.output
    r = CliRunner().invoke(app, ["bench", "workflow", "--interleave", "round", "--base-url",
                                 "http://127.0.0.1:9/v1"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "not with --base-url" in r.output


def test_fresh_servers_start_each_trial_on_new_processes(server_set_pids):
    """``--fresh-servers``: every trial runs on servers started for it (so one process's luck is
    drawn again per trial); the trials' calls are merged as with one server per policy."""
    from kvflow_agents.bench import runner
    from kvflow_agents.bench.workload import WorkloadSpec, token_counter

    pids = server_set_pids
    spec = WorkloadSpec(agents=2, fixed=64, dynamic=8, output=2, rounds=1, warmup_rounds=0)
    server = runner.ServerConfig(model="tiny-random", device_tokens=512, host_tokens=1024,
                                 torch_threads=1)
    out = runner.run_workflow_bench(spec, ["lru", "kvflow"], server, counter=token_counter("tiny-random"),
                                    trials=2, fresh_servers=True)
    assert len(pids) == 2 and pids[0]["kvflow"] != pids[1]["kvflow"] and pids[0]["lru"] != pids[1]["lru"]
    assert [list(p) for p in pids] == [["lru", "kvflow"], ["kvflow", "lru"]]   # start order rotates
    for res in out:
        w = res.workload
        assert w["calls"] == 2 * 2 and w["errors"] == 0 and w["trials"] == 2
        # each trial's server said how fast its model ran (bench.speed pairs trials by it)
        assert [t for t, _ in w["decode_step_trials_s"]] == [0, 1]
        assert all(0 < v < 1 for _, v in w["decode_step_trials_s"])
        assert res.startup_s > 0 and res.serve_argv[:2] == ["kvflow", "serve"]


def test_other_python_serves_every_column_twice(tmp_path):
    """``--other-python PY``: each column also runs as ``other-LABEL`` on servers started by
    that interpreter (another checkout's venv; here this one's), right after its own column,
    with the same policy and options; the JSON records the command. A missing interpreter or
    a running server to measure is a bad flag."""
    out = tmp_path / "ab.json"
    env = {"COLUMNS": "200"}
    r = CliRunner().invoke(app, [
        "bench", "workflow", "--agents", "3", "--fixed", "128", "--dynamic", "16", "--output", "4",
        "--rounds", "1", "--trials", "1", "--policies", "lru", "--model", "tiny-random",
        "--device-tokens", "1024", "--host-link-gbps", "1", "--json", str(out), "--no-progress",
        "--policy-variant", "lru-part=lru --partial-eviction", "--other-python", sys.executable], env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert list(doc["policies"]) == ["lru", "other-lru", "lru-part", "other-lru-part"]
    twin = [sys.executable, "-P", "-m", "kvflow_agents.cli.main", "serve"]
    assert doc["server"]["commands"] == {"other-lru": twin, "other-lru-part": twin}
    for name, p in doc["policies"].items():
        assert p["workload"]["calls"] == 3 and p["workload"]["errors"] == 0, name
        argv = p["serve_argv"]
        assert argv[:5] == (twin if name.startswith("other-") else ["kvflow", "serve"] + argv[2:5])
        assert argv[argv.index("--policy") + 1] == "lru"
        assert ("--partial-eviction" in argv) == name.endswith("-part")
    for flags, why in ((["--other-python", str(tmp_path / "nope")], "not an executable"),
                       (["--other-python", sys.executable, "--base-url", "http://127.0.0.1:9/v1"],
                        "--base-url")):
        r = CliRunner().invoke(app, ["bench", "workflow", *flags], env=env)
        assert r.exit_code == 2 and "--other-python" in r.output and why in r.output, r.output
