"""The rows of the bench report's table (:mod:`.report` renders them): one list of cells per row,
one cell per policy, from a run's :class:`~.runner.PolicyResult` list and its
:class:`~.figures.Figures`. Narrow rows fit 80 columns; ``wide`` adds the rest."""

from __future__ import annotations

from statistics import mean
from typing import Any, Optional, Sequence

from .figures import Figures
from .runner import PolicyResult
from .stats import BASELINES, CI_LEVEL, MEAN_KEY, cost_saving, ratios


# one cell's text by kind: seconds (3 decimals), seconds shown in ms, a share, a ratio, a count
_CELL = {"s": lambda v: f"{v:.3f}", "ms": lambda v: f"{v * 1e3:.1f}", "%": lambda v: f"{v * 100:.1f}%",
         "x": lambda v: f"{v:.2f}x", "int": lambda v: f"{int(v)}", "f2": lambda v: f"{v:.2f}"}


def fmt(v: Any, kind: str) -> str:
    """One cell (``kind``: a key of ``_CELL``; any other: ``str``); ``None`` is "-"."""
    return "-" if v is None else _CELL.get(kind, str)(v)


def fmt_range(xs: Sequence[Optional[float]], kind: str) -> str:
    """``lo-hi`` in at most 11 characters (seconds >= 10 with one decimal)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if kind == "s" and max(xs) >= 10:
        lo, hi = f"{min(xs):.1f}", f"{max(xs):.1f}"
    else:
        lo, hi = fmt(min(xs), kind), fmt(max(xs), kind)
    return lo if lo == hi else f"{lo}-{hi}"


def _wasted(server: Optional[dict]) -> str:
    """``15 (alloc 7, grow 4, workflow_end 4)``: wasted prefetches by what took them."""
    if not server or server.get("prefetch_wasted") is None:
        return "-"
    by = sorted((server.get("prefetch_wasted_by") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    causes = ", ".join(f"{k} {v}" for k, v in by if v)
    return f"{server['prefetch_wasted']}" + (f" ({causes})" if causes else "")


def rows(results: Sequence[PolicyResult], wide: bool = True, *,
         figures: Optional[Figures] = None) -> list[tuple[str, list[str]]]:
    """The table's rows. Narrow (``wide=False``): short names, one value per cell, so the table
    fits 80 columns with four policies; wide: every row. ``figures``: the report's
    :class:`Figures` of ``results`` (made here when left out)."""
    fig = figures if figures is not None else Figures(results)
    rat = ratios(results)
    mrat = ratios(results, MEAN_KEY)
    trat = ratios(results, "ttft_mean_s")
    sav = fig.saving
    psav = fig.saving_same_pool
    csav = cost_saving(results)
    adj = fig.adjusted.results if fig.adjusted else None
    asav = fig.adjusted.saving if fig.adjusted else {}

    def w(key, kind):
        return [fmt(r.workload.get(key), kind) for r in results]

    def s(key, kind):
        return [fmt((r.server or {}).get(key), kind) for r in results]

    def saving(base, what, sav=sav):
        vals = []
        for r in results:
            x = sav.get(r.policy, {}).get(base)
            if not x:
                vals.append("-")
            elif what in ("ratio", "ratio_mean"):
                vals.append(fmt(x.get(what), "f2"))
            elif what == "ci":
                vals.append(fmt_range([x["ci"]["lo"], x["ci"]["hi"]], "f2") if x.get("ci") else "-")
            else:
                vals.append(fmt_range([x["min"], x["max"]], "f2") if x["trials"] else "-")
        return vals

    raw_vs_o, adj_vs_o = ([fig.latency_vs_oracle[k].get(r.policy) for r in results]
                          for k in ("raw", "adjusted"))

    step_ms = [fmt(mean(v for _, v in tr) if (tr := r.workload.get("decode_step_trials_s")) else None, "ms")
               for r in results]
    trial_p50 = [fmt_range([v for _, v in (r.workload.get("workflow_latency_trials_s") or [])], "s")
                 for r in results]
    pf = [f"{fmt((r.server or {}).get('prefetch_used'), 'int')}/"
          f"{fmt((r.server or {}).get('prefetch_issued'), 'int')}" if r.server else "-" for r in results]
    narrow = [
        ("workflow p50 (s)", w("workflow_latency_p50_s", "s")),
        ("workflow mean (s)", w("workflow_latency_mean_s", "s")),
        ("workflow p90 (s)", w("workflow_latency_p90_s", "s")),
        ("trial p50s (s)", trial_p50),
        ("TTFT mean (ms)", w("ttft_mean_s", "ms")),
        ("after 1st token (ms)", w("after_first_token_mean_s", "ms")),
        ("call mean (ms)", w("call_latency_mean_s", "ms")),
        ("hit device (usage)", w("device_hit_rate", "%")),
        ("hit host (usage)", w("host_hit_rate", "%")),
        ("recomputed (usage)", w("miss_rate", "%")),
        ("load hidden (s)", s("load_hidden_s", "s")),
        ("load exposed (s)", s("load_exposed_s", "s")),
        ("load wait (s)", w("load_wait_s", "s")),
        ("prefetch used/issued", pf),
        ("demand loads", s("demand_loads", "int")),
        ("requests (errors)", [f"{r.workload.get('calls')} ({r.workload.get('errors')})" for r in results]),
        ("speedup vs lru", [fmt(rat[r.policy]["speedup_vs_lru"], "x") for r in results]),
        ("speedup vs hicache", [fmt(rat[r.policy]["speedup_vs_hicache"], "x") for r in results]),
        ("latency vs oracle", [fmt(rat[r.policy]["latency_vs_oracle"], "x") for r in results]),
        ("saving vs lru", saving("lru", "ratio")),
        ("  over trials", saving("lru", "range")),
        ("saving vs hicache", saving("hicache", "ratio")),
        ("  over trials", saving("hicache", "range")),
        ("  mean", saving("hicache", "ratio_mean")),
        (f"  {CI_LEVEL:.0%} CI (mean)", saving("hicache", "ci")),
        *([("saving vs hicache, pool", saving("hicache", "ratio", psav)),
           ("  over trials", saving("hicache", "range", psav))] if psav else []),
        *([("model ms / decode step", step_ms),
           ("vs oracle per trial", [f"{x['ratio']:.3f}" if x else "-" for x in raw_vs_o]),
           ("  speed-adjusted", [f"{x['ratio']:.3f}" if x else "-" for x in adj_vs_o]),
           (f"  {CI_LEVEL:.0%} CI", [fmt_range([x["lo"], x["hi"]], "f2") if x else "-" for x in adj_vs_o]),
           ("saving vs hicache, adj.", saving("hicache", "ratio", asav)),
           ("  mean", saving("hicache", "ratio_mean", asav)),
           (f"  {CI_LEVEL:.0%} CI (mean)", saving("hicache", "ci", asav)),
           ("saving vs lru, adj.", saving("lru", "ratio", asav))] if adj else []),
        ("cache cost (s)", w("cache_cost_s", "s")),
        ("cost saving vs lru", [fmt(csav.get(r.policy, {}).get("lru"), "f2") for r in results]),
        ("cost saving vs hicache", [fmt(csav.get(r.policy, {}).get("hicache"), "f2") for r in results]),
    ]
    if any("pool_bound" in r.workload for r in results):  # bench peer: the same-pool bound
        narrow += pool_bound_rows(results)
    if not wide:
        return narrow
    return narrow + [
        ("TTFT p90 (ms)", w("ttft_p90_s", "ms")),
        ("of TTFT: queued (ms)", w("queue_mean_s", "ms")),
        ("match: device / host / loading / miss", [
            " / ".join(fmt((r.server or {}).get(f"{k}_rate"), "%") for k in ("device", "host", "loading", "miss"))
            if r.server else "-" for r in results]),
        ("load hidden fraction", s("load_hidden_fraction", "%")),
        ("engine: forwards / KV copies (s)", [
            f"{fmt(r.server['engine_prefill_forward_s'] + r.server['engine_decode_forward_s'], 's')} / "
            f"{fmt(r.server.get('engine_copy_s'), 's')}"
            if r.server and "engine_prefill_forward_s" in r.server else "-" for r in results]),
        *engine_cost_rows(results),
        ("retractions (no room to decode)", s("retractions", "int")),
        ("prefetch wasted (what took it)", [_wasted(r.server) for r in results]),
        ("prefetched pages evicted unread", s("prefetch_evicted_pages", "int")),
        ("prompt / output tokens", [f"{r.workload.get('prompt_tokens')} / {r.workload.get('completion_tokens')}"
                                    for r in results]),
        ("speedup vs lru / hicache (mean)", [
            f"{fmt(mrat[r.policy]['speedup_vs_lru'], 'x')} / {fmt(mrat[r.policy]['speedup_vs_hicache'], 'x')}"
            for r in results]),
        ("latency vs oracle (mean)", [fmt(mrat[r.policy]["latency_vs_oracle"], "x") for r in results]),
        (f"saving vs lru, {CI_LEVEL:.0%} CI (mean)", saving("lru", "ci")),
        ("saving vs lru / hicache (mean)", [
            " / ".join(fmt(sav.get(r.policy, {}).get(b, {}).get("ratio_mean"), "f2") for b in BASELINES)
            for r in results]),
        ("TTFT speedup vs lru", [fmt(trat[r.policy]["speedup_vs_lru"], "x") for r in results]),
    ]


def engine_cost_rows(results: Sequence[PolicyResult]) -> list[tuple[str, list[str]]]:
    """Per call, over the measured rounds: the engine's busy steps (wall) and what of them lay
    outside its forwards and KV copies (scheduling, cache work, sampling, the rest of a step),
    the engine thread's CPU, and the CPU of the engine's process and of the HTTP process (one
    process with ``--engine-thread``: both then read the same). Servers before these counters
    (stored runs from before 2026-12-07) show "-"."""
    def per_call(r: PolicyResult, *keys: str) -> Optional[float]:
        srv, calls = r.server or {}, r.workload.get("calls")
        if not calls or any(srv.get(k) is None for k in keys):
            return None
        return srv[keys[0]] / calls - sum(srv[k] for k in keys[1:]) / calls

    def pair(a, b) -> list[str]:
        return [f"{fmt(x, 'ms')} / {fmt(y, 'ms')}" if x is not None or y is not None else "-"
                for x, y in ((a(r), b(r)) for r in results)]

    return [
        ("engine busy / its CPU (ms per call)", pair(
            lambda r: per_call(r, "engine_busy_s"), lambda r: per_call(r, "engine_thread_cpu_s"))),
        ("  busy outside forwards, copies", [fmt(per_call(
            r, "engine_busy_s", "engine_prefill_forward_s", "engine_decode_forward_s", "engine_copy_s"),
            "ms") for r in results]),
        ("CPU: engine / HTTP process", pair(
            lambda r: per_call(r, "engine_process_cpu_s"), lambda r: per_call(r, "http_process_cpu_s"))),
    ]


def pool_bound_rows(results: Sequence[PolicyResult]) -> list[tuple[str, list[str]]]:
    """Reusable tokens missing from device vs what no policy could have had with the same pool,
    and the share of hicache's excess over that bound removed (:mod:`.pool_bound`)."""
    from .pool_bound import same_pool_saving

    pb = {r.policy: r.workload.get("pool_bound") or {} for r in results}
    base = pb.get("hicache", {}).get("device_miss")

    def pair(v: dict) -> str:
        if "device_miss" not in v:
            return "-"
        return f"{v['device_miss']} / {'-' if v.get('bound') is None else v['bound']}"

    return [("missing / bound (tok)", [pair(pb[r.policy]) for r in results]),
            ("same-pool saving", [
                fmt(same_pool_saving(base, pb[r.policy].get("device_miss"), pb[r.policy].get("bound"))
                     if r.policy != "hicache" else None, "f2") for r in results])]
