"""``kvflow serve`` argument handling (the server itself is covered over HTTP elsewhere)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvflow_agents.cli.main import app
from kvflow_agents.serving.policy import KVFlowPolicy


def serve_without_uvicorn(monkeypatch, flags, find_spec: "dict | None" = None):
    """``kvflow serve --model tiny-random --device-tokens 512 --engine-thread FLAGS`` with the
    real engine and app, uvicorn's ``run`` replaced: ``(result, engine or None, uvicorn.run's
    keywords)``; on a thread, so the tests can read the engine's state the flags set (the
    engine process: tests/serving/test_engine_process.py). ``find_spec``: module name ->
    installed? (the rest as they are)."""
    import importlib.util

    import uvicorn

    if find_spec:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if find_spec[name] else None) if name in find_spec else real(name, *a)))
    seen: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw, engine=app.state.engine))
    r = CliRunner().invoke(app, ["serve", "--model", "tiny-random", "--device-tokens", "512",
                                 "--engine-thread"] + flags,
                           env={"COLUMNS": "200"})
    return r, seen.pop("engine", None), seen


def test_serve_help_and_engine_choice():
    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "--host-link-gbps" in r.output and "EMULATION" in r.output and "--api-key" in r.output
    r = runner.invoke(app, ["serve", "--engine", "sglang"])  # needs a model path
    assert r.exit_code != 0 and "--model-path" in r.output
    r = runner.invoke(app, ["serve", "--engine", "tgi"])
    assert r.exit_code != 0 and "embedded or sglang" in r.output
    r = runner.invoke(app, ["serve", "--model", "tiny-random", "--bogus-flag", "1"])
    assert r.exit_code != 0 and "--bogus-flag" in r.output
    r = runner.invoke(app, ["serve", "--policy", "fifo"])
    assert r.exit_code != 0 and "kvflow" in r.output
    r = runner.invoke(app, ["serve", "--admission", "lifo"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--admission" in r.output and "fcfs or workflow" in r.output
    r = runner.invoke(app, ["serve", "--torch-threads", "0"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--torch-threads" in r.output
    r = runner.invoke(app, ["sim", "run", "--admission", "lifo"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--admission" in r.output and "fcfs, workflow" in r.output


@pytest.mark.parametrize("flags, partial, lazy", [([], False, True), (["--partial-eviction"], True, True),
                                                 (["--upfront-decode-pages"], False, False)])
def test_serve_eviction_flags_reach_the_store(monkeypatch, flags, partial, lazy):
    """``kvflow serve`` builds its engine's store evicting whole nodes unless told to evict
    partially, and its sessions allocating decode pages lazily unless told to take them
    upfront. The engine is the real one; only uvicorn's loop is replaced."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, flags)
    assert r.exit_code == 0, r.output
    assert eng.manager.store.partial_eviction is partial and eng.manager.lazy_decode is lazy
    assert ("eviction partial nodes" if partial else "eviction whole nodes") in r.output
    assert ("decode pages lazy" if lazy else "decode pages upfront") in r.output


@pytest.mark.parametrize("flags, aware", [([], True), (["--always-load"], False)])
def test_serve_recompute_aware_flag_reaches_the_engine(monkeypatch, flags, aware):
    """``--always-load``: the engine reports no prefill speed, so the load tracker has no
    recompute estimate and every host hit is loaded (SGLang's HiCache as shipped). By default
    it has one, and weighs a load against recomputing once for the request and once per
    running request (the engine's scheduler, none running here)."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, ["--policy", "hicache"] + flags)
    assert r.exit_code == 0, r.output
    assert eng.config.recompute_aware is aware
    loads = eng.manager.loads
    assert loads.recompute_stalls() == len(eng.scheduler.running) == 0
    loads.observe_prefill(1000, 2.0)                # as a served prefill reports it
    assert loads.recompute_cost_s(100) == pytest.approx(0.2)


@pytest.mark.parametrize("flags, threaded", [([], False), (["--copy-thread"], True),
                                             (["--inline-copies"], False)])
def test_serve_copy_thread_flag_reaches_the_pool(monkeypatch, flags, threaded):
    """``--copy-thread`` moves the real engine's CPU KV copies onto a background thread;
    by default (``--inline-copies``) they run inline on the engine thread."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, ["--policy", "hicache"] + flags)
    assert r.exit_code == 0, r.output
    assert eng.pool.copy_thread is threaded
    assert f"KV copies {'copy thread' if threaded else 'inline'};" in r.output  # the startup summary says which


@pytest.mark.parametrize("flags, installed, want", [
    ([], True, "uvloop"), ([], False, "asyncio"), (["--loop", "asyncio"], True, "asyncio"),
    (["--loop", "uvloop"], True, "uvloop"), (["--loop", "uvloop"], False, None),
    (["--loop", "trio"], True, None)])
def test_serve_loop_flag_picks_the_event_loop_as_uvicorn_would(monkeypatch, flags, installed, want):
    """``--loop`` is uvicorn's: auto takes uvloop where it is installed; uvloop asked for where
    it is not, or an unknown loop, is a bad flag (exit 2, what is wrong), not a traceback."""
    r, eng, seen = serve_without_uvicorn(monkeypatch, flags, find_spec={"uvloop": installed})
    if want is None:
        assert r.exit_code == 2 and "--loop" in r.output and eng is None
        assert ("not installed" in r.output) if "uvloop" in flags else "'trio'" in r.output
        return
    assert r.exit_code == 0, r.output
    assert seen["loop"] == want and f"event loop {want}," in r.output


@pytest.mark.parametrize("flags, installed, want", [
    ([], True, "httptools"), ([], False, "h11"), (["--http", "h11"], True, "h11"),
    (["--http", "httptools"], True, "httptools"), (["--http", "httptools"], False, None),
    (["--http", "hyper"], True, None)])
def test_serve_http_flag_picks_the_protocol_with_the_header_timeout(monkeypatch, flags, installed, want):
    """``--http`` is uvicorn's: auto takes httptools where it is installed; either protocol
    class uvicorn gets is the guarded one (the header timeout); httptools asked for where it is
    not installed, or an unknown name, is a bad flag (exit 2, what is wrong)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kvflow_agents.serving.embedded.limits import _HeadTimer

    r, eng, seen = serve_without_uvicorn(monkeypatch, flags, find_spec={"httptools": installed})
    if want is None:
        assert r.exit_code == 2 and "--http" in r.output and eng is None
        assert ("not installed" in r.output) if "httptools" in flags else "'hyper'" in r.output
        return
    assert r.exit_code == 0, r.output
    base = HttpToolsProtocol if want == "httptools" else H11Protocol
    assert issubclass(seen["http"], base) and issubclass(seen["http"], _HeadTimer)
    assert f"HTTP {want};" in r.output


@pytest.mark.parametrize("policy, flags, aware, scope", [
    ("kvflow", [], True, KVFlowPolicy.skip_scope), ("hicache", [], False, "all"),
    ("kvflow", ["--no-status-aware"], False, KVFlowPolicy.skip_scope),
    ("hicache", ["--status-aware"], True, "all"),
    ("kvflow", ["--skip-scope", "workflow"], True, "workflow"),
    ("kvflow", ["--skip-scope", "all"], True, "all")])
def test_serve_status_aware_flags_reach_the_scheduler(monkeypatch, policy, flags, aware, scope):
    """Skipping requests whose prefix is loading, and whom the skip lets ahead, are the
    policy's defaults unless a flag says otherwise (the benches compare them with
    --policy-variant)."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, ["--policy", policy] + flags)
    assert r.exit_code == 0, r.output
    assert eng.scheduler.status_aware is aware
    assert eng.scheduler.skip_scope == scope
    assert (f"(status-aware, skip scope {scope})" in r.output) is aware


def test_serve_refuses_an_unknown_skip_scope():
    r = CliRunner().invoke(app, ["serve", "--model", "tiny-random", "--skip-scope", "nobody"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "unknown skip scope 'nobody'" in r.output


@pytest.mark.parametrize("flags, reserve", [([], 0.25), (["--decode-reserve", "0.5"], 0.5),
                                            (["--decode-reserve", "0.5", "--deterministic"], 0.5)])
def test_serve_decode_reserve_reaches_the_manager(monkeypatch, flags, reserve):
    """The optimistic decode reserve, in deterministic mode too (a retracted request replays
    its outputs there)."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, flags)
    assert r.exit_code == 0, r.output
    assert eng.manager.decode_reserve == reserve and f"reserve {reserve:g} of max_tokens" in r.output


def test_serve_rejects_a_decode_reserve_outside_0_1():
    for bad in ("0", "1.5", "x"):
        r = CliRunner().invoke(app, ["serve", "--decode-reserve", bad], env={"COLUMNS": "200"})
        assert r.exit_code == 2 and "--decode-reserve" in r.output


@pytest.mark.parametrize("flags, want", [
    ([], "all"), (["--backup", "tagged"], "tagged"), (["--backup", "all"], "all"),
    (["--backup", "some"], None), (["--policy", "hicache", "--backup", "tagged"], None)])
def test_serve_backup_flag_reaches_the_kvflow_policy(monkeypatch, flags, want):
    """``--backup tagged`` makes the real engine's kvflow policy write through only victims on
    some agent's fixed prefix (the startup summary says which); an unknown mode, or the flag
    on another policy, is a bad flag (exit 2, what is wrong)."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, flags)
    if want is None:
        assert r.exit_code == 2 and "backup" in r.output and eng is None
        assert ("'some'" in r.output) if "some" in flags else "kvflow policy" in r.output
        return
    assert r.exit_code == 0, r.output
    assert isinstance(eng.policy, KVFlowPolicy) and eng.policy.backup == want
    assert f"whole nodes, backup {want};" in r.output


@pytest.mark.parametrize("flags, want", [
    ([], 0.75), (["--fill-link-cap", "0.5"], 0.5), (["--fill-link-cap", "1"], None),
    (["--fill-link-cap", "0"], "--fill-link-cap")])
def test_serve_fill_link_cap_reaches_the_prefetcher(monkeypatch, flags, want):
    """``--fill-link-cap``: the link's recent busy share above which idle-link fills wait (1:
    no cap); out of range is a bad flag that says which."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, ["--lookahead", "3", "--busy-lookahead", "1", *flags])
    if isinstance(want, str):
        assert r.exit_code == 2 and want in r.output and eng is None
        return
    assert r.exit_code == 0, r.output
    assert eng.manager.prefetcher.fill_link_cap == want


@pytest.mark.parametrize("flags, want", [
    ([], None), (["--lookahead", "2", "--busy-lookahead", "1"], 1),
    (["--busy-lookahead", "1"], "below lookahead (1)"),
    (["--lookahead", "2", "--busy-lookahead", "2"], "below lookahead (2)")])
def test_serve_busy_lookahead_reaches_the_prefetch_planner(monkeypatch, flags, want):
    """``--busy-lookahead`` sets the STE beyond which the engine's prefetch planner loads only
    on an idle link; one not below ``--lookahead`` is a bad flag that says what is wrong."""
    r, eng, _ = serve_without_uvicorn(monkeypatch, flags)
    if isinstance(want, str):
        assert r.exit_code == 2 and "busy_lookahead" in r.output and want in r.output
        assert eng is None
        return
    assert r.exit_code == 0, r.output
    planner = eng.manager.prefetcher.planner
    assert planner.busy_lookahead == want and eng.manager.lookahead == (2 if want else 1)
