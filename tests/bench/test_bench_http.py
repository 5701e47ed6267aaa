"""``kvflow bench http``: the HTTP side's CPU per request, per ``--loop`` / ``--http``, measured
on real ``kvflow serve`` processes over real HTTP. The tests check what is measured (whose CPU,
over which interval, against which baseline), never a time."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import http_side
from kvflow_agents.cli.main import app


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_split_charges_the_main_thread_to_the_loop_and_the_busiest_other_to_the_engine():
    """Read from this process's /proc: a thread that burns 0.3 s of CPU is the 'engine', the
    main thread (which burns 0.1 s) the 'event loop', a thread that idles is in neither."""
    pid = os.getpid()
    release, burnt = threading.Event(), threading.Event()

    def busy() -> None:
        _burn(0.3)
        burnt.set()
        release.wait()  # alive at the second snapshot (an ended thread leaves /proc)
    sleeper = threading.Thread(target=release.wait)
    sleeper.start()
    before = http_side.thread_cpu_s(pid)
    worker = threading.Thread(target=busy)
    worker.start()
    burnt.wait()
    _burn(0.1)
    after = http_side.thread_cpu_s(pid)
    release.set()
    for t in (sleeper, worker):
        t.join()
    loop, engine, rest = http_side.split_cpu(pid, before, after)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.1 - 2 * tick <= loop < 0.3          # the main thread's own CPU, not the busy thread's
    assert 0.3 - 2 * tick <= engine < 0.5
    assert rest < 0.05


def test_ratios_are_per_repetition_against_the_first_combination():
    """A combination measured 2x the baseline's loop CPU in one repetition and 0.5x in another
    reads its median ratio over repetitions, not the ratio of medians."""
    def s(loop, http, wall, cpu):
        return http_side.Sample(loop, http, wall, cpu, 1.0, 0.0, 100)
    base, fast = ("asyncio", "h11"), ("uvloop", "httptools")
    samples = [s(*base, 1.0, 1.0), s(*fast, 0.5, 0.5),      # repetition 1: fast 0.5x
               s(*fast, 1.8, 1.6), s(*base, 2.0, 2.0),      # repetition 2 (order reversed): 0.9x, 0.8x
               s(*base, 4.0, 4.0), s(*fast, 2.8, 2.8)]      # repetition 3: 0.7x
    rows = http_side.summarize(samples, [base, fast])
    assert [r.label for r in rows] == ["asyncio/h11", "uvloop/httptools"]
    assert rows[0].loop_cpu_vs_base == rows[0].wall_vs_base == 1.0
    assert rows[1].loop_cpu_vs_base == pytest.approx(0.7) and rows[1].wall_vs_base == pytest.approx(0.7)
    assert rows[1].loop_ms_per_request == pytest.approx(1000 * 1.6 / 100)   # median of 5, 16, 28 ms
    assert rows[1].engine_cpu_vs_base == 1.0  # engine CPU 1 s everywhere here


def test_bench_http_cli_measures_real_servers(tmp_path):
    """Two real servers (uvicorn's pure-Python HTTP and httptools, both installed by the serve
    extra; uvloop is not), streamed requests over HTTP: every
    request answered (a failed one would raise), CPU seen on the event loop and the engine
    thread during the load, JSON and PNG written, the table within 80 columns."""
    out, png = tmp_path / "h.json", tmp_path / "h.png"
    r = CliRunner().invoke(app, ["bench", "http", "--combos", "asyncio+h11,asyncio+httptools",
                                 "--requests", "16", "--concurrency", "2", "--tokens", "4",
                                 "--reps", "1", "--json", str(out), "--plot", str(png)],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert max(len(x) for x in r.output.splitlines()) <= 80
    doc = json.loads(out.read_text())
    assert doc["bench"] == "http" and doc["stream"] is True
    rows = doc["results"]
    assert [(x["loop"], x["http"]) for x in rows] == [("asyncio", "h11"), ("asyncio", "httptools")]
    for x in rows:
        (sample,) = x["samples"]
        assert sample["requests"] == 16 and sample["wall_s"] > 0
        assert sample["loop_cpu_s"] > 0 and sample["engine_cpu_s"] > 0
    assert rows[0]["wall_vs_base"] == 1.0
    assert png.stat().st_size > 0


def test_bench_http_rejects_an_unknown_combination():
    r = CliRunner().invoke(app, ["bench", "http", "--combos", "asyncio+hyper"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--combos" in r.output and "asyncio+hyper" in r.output


def test_bench_http_defaults_to_what_is_installed_and_refuses_what_is_not(monkeypatch):
    """Without uvloop the default combinations are the asyncio ones, and asking for uvloop is a
    bad flag that says what to install (not a server that fails to start)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert http_side.installed_combos() == [("asyncio", "h11"), ("asyncio", "httptools")]
    r = CliRunner().invoke(app, ["bench", "http", "--combos", "uvloop+h11"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "uvloop is not installed" in r.output
