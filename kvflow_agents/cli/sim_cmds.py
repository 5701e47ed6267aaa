"""``kvflow sim …``: the discrete-event simulator (serving/sim) over the policy core.

``run`` (one config, policies side by side), ``paper`` (the paper's figures vs its reported
ratios), ``sweep`` (concurrency x link bandwidth), ``replay`` (a recorded trace), ``profiles``,
``validate`` (the embedded engine's own profile vs ``kvflow bench workflow``).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Optional

import typer

from .options import positive_list

_POLICIES = "lru,hicache,kvflow,oracle"


def _policies(text: str) -> list[str]:
    from kvflow_agents.serving.policy import POLICIES

    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in POLICIES]
    if not out or bad:
        raise typer.BadParameter(f"unknown {', '.join(bad) or '(none)'}; choose from {', '.join(sorted(POLICIES))}",
                                 param_hint="--policies")
    return out


def _profile(name: str, link_gbps: Optional[float]):
    from kvflow_agents.serving.sim import load_profile

    if link_gbps is not None and link_gbps <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--link-gbps")
    try:
        return load_profile(name, link_gbps=link_gbps)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--profile") from None


@contextmanager
def _bar(total: int, label: str, enabled: bool, console):
    if not enabled:
        yield lambda *_: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task(label, total=total)
        yield lambda desc="": prog.update(task, advance=1, description=f"{label} {desc}")


def _run_policies(prof, wl, pols, console, progress: bool, **kw):
    from kvflow_agents.serving.sim import Simulator

    out = {}
    with _bar(len(pols), "simulating", progress, console) as step:
        for p in pols:
            try:
                out[p] = Simulator(prof, wl, p, **kw).run()
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
            step(p)
    return out


def _emit(console, doc, json_out: Optional[str]) -> None:
    from kvflow_agents.serving.sim import report

    if json_out == "-":
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    elif json_out:
        report.write_json(doc, json_out)
        console.print(f"[dim]JSON written to {json_out}[/]")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    sim = typer.Typer(help="Discrete-event simulator over the same policy code (no GPU, no torch).",
                      no_args_is_help=True)
    app.add_typer(sim, name="sim")

    @sim.command("run")
    def run(
        workload: str = typer.Option("cycle", help="cycle | fanout | peer."),
        profile: str = typer.Option("llama-3.1-8b-a10g", help="Profile name (kvflow sim profiles) or a JSON file."),
        agents: int = typer.Option(10, min=1, help="Agents (cycle/fanout)."),
        fixed: int = typer.Option(8192, min=1, help="Fixed prompt tokens per agent."),
        dynamic: int = typer.Option(32, min=0, help="Dynamic tokens per call."),
        output: int = typer.Option(32, min=1, help="Output tokens per call."),
        rounds: int = typer.Option(2, min=1, help="Measured rounds (cycle/fanout)."),
        warmup_rounds: int = typer.Option(1, min=0, help="Unmeasured warm-up rounds first."),
        workflows: int = typer.Option(1, min=1, help="Concurrent workflows."),
        share_prompts: bool = typer.Option(False, help="Workflows share the agents' fixed prompts."),
        questions: int = typer.Option(8, min=1, help="PEER: questions in all."),
        fixed_mult: float = typer.Option(4.0, help="PEER: scale of the agentUniverse fixed prompts."),
        device_tokens: Optional[int] = typer.Option(None, min=1, help="Device KV pool (tokens); default from the profile."),
        device_fraction: Optional[float] = typer.Option(None, help="Device pool as a fraction of all fixed prompts."),
        host_tokens: Optional[int] = typer.Option(None, min=0, help="Host KV pool (tokens)."),
        link_gbps: Optional[float] = typer.Option(None, help="Override the profile's host link (GB/s)."),
        page_size: int = typer.Option(64, min=1, help="Tokens per KV page."),
        lookahead: int = typer.Option(1, min=0, help="Prefetch lookahead (STE)."),
        busy_lookahead: Optional[int] = typer.Option(
            None, min=0, help="Below --lookahead: agents further ahead load only on an idle link."),
        layerwise: bool = typer.Option(True, help="Layer-wise overlap of on-demand loads (HiCache)."),
        admission: Optional[str] = typer.Option(
            None, help="Admission order for every policy: fcfs | workflow (oldest workflow first). "
                       "Default: each policy's own (kvflow: workflow, the others: fcfs)."),
        stagger_s: float = typer.Option(0.0, min=0.0, help="Cycle: workflow w starts at w x this "
                                        "(arrivals over time instead of all at once)."),
        policies: str = typer.Option(_POLICIES, help="Comma-separated policies."),
        seed: int = typer.Option(0, help="Seed (PEER token lengths)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write results as JSON ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        progress: bool = typer.Option(True, help="Progress bar."),
    ) -> None:
        """One configuration, policies side by side."""
        from rich.console import Console

        from kvflow_agents.serving.sim import cycle, fanout, peer

        pols = _policies(policies)
        prof = _profile(profile, link_gbps)
        if busy_lookahead is not None and busy_lookahead >= lookahead:
            raise typer.BadParameter(f"must be below --lookahead ({lookahead})",
                                     param_hint="--busy-lookahead")
        from kvflow_agents.serving.policy.admission import ADMISSION_ORDERS

        if admission is not None and admission not in ADMISSION_ORDERS:
            raise typer.BadParameter(f"choose from {', '.join(ADMISSION_ORDERS)}", param_hint="--admission")
        if device_fraction is not None and not 0 < device_fraction <= 100:
            raise typer.BadParameter("must be in (0, 100]", param_hint="--device-fraction")
        kw = dict(page_size=page_size, device_tokens=device_tokens, device_fraction=device_fraction,
                  host_tokens=host_tokens)
        try:
            if workload == "cycle":
                wl = cycle(agents=agents, fixed=fixed, dynamic=dynamic, output=output, rounds=rounds,
                           warmup_rounds=warmup_rounds, workflows=workflows, share_prompts=share_prompts,
                           rotate=workflows > 1, stagger_s=stagger_s, **kw)
            elif workload == "fanout":
                wl = fanout(agents=agents, fixed=fixed, dynamic=dynamic, output=output, rounds=rounds,
                            warmup_rounds=warmup_rounds, workflows=workflows, share_prompts=share_prompts, **kw)
            elif workload == "peer":
                wl = peer(questions=questions, workflows=workflows, fixed_mult=fixed_mult, seed=seed, **kw)
            else:
                raise typer.BadParameter("choose cycle, fanout or peer", param_hint="--workload")
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        console = Console(stderr=json_out == "-")
        res = _run_policies(prof, wl, pols, console, progress and json_out != "-", lookahead=lookahead,
                            layerwise=layerwise, admission=admission, busy_lookahead=busy_lookahead)
        title = f"kvflow sim run: {wl.name} on {prof.name} (link {prof.link_gbps} GB/s)"
        _report_run(console, res, wl, prof, title, json_out, plot_out)

    @sim.command("paper")
    def paper_cmd(
        quick: bool = typer.Option(False, help="Fewer configurations (about 15 s)."),
        only: Optional[str] = typer.Option(None, help="Comma-separated figure ids to run."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write results as JSON ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        markdown: Optional[str] = typer.Option(None, help="Write the tables as Markdown here."),
        wide: bool = typer.Option(False, help="Every column (the default tables fit 80 columns)."),
        progress: bool = typer.Option(True, help="Progress bar."),
    ) -> None:
        """The paper's figure configurations: lru, hicache, kvflow, oracle; paper ratio vs ours."""
        from rich.console import Console

        from kvflow_agents.serving.sim import paper, report

        figs = paper.figures(quick=quick)
        if only:
            want = [x.strip() for x in only.split(",") if x.strip()]
            ids = [f.id for f in figs]
            bad = [x for x in want if x not in ids]
            if bad:
                raise typer.BadParameter(f"unknown figure {', '.join(bad)}; choose from {', '.join(ids)}",
                                         param_hint="--only")
            figs = [f for f in figs if f.id in want]
        console = Console(stderr=json_out == "-")
        total = sum(len(f.configs) for f in figs)
        with _bar(total, "figures", progress and json_out != "-", console) as step:
            paper.run_figures(figs, progress=step)
        sums = [paper.figure_summary(f) for f in figs]
        if json_out != "-":
            for t in report.paper_tables(sums, wide=wide):
                console.print(t)
        _emit(console, {"source": paper.PAPER_SRC, "figures": sums}, json_out)
        if markdown:
            with open(markdown, "w") as fh:
                fh.write(report.markdown_paper(sums))
        if plot_out:
            report.plot_paper(sums, plot_out)
            if json_out != "-":
                console.print(f"[dim]plot written to {plot_out}[/]")

    @sim.command("sweep")
    def sweep_cmd(
        profile: str = typer.Option("llama-3.1-8b-a10g", help="Profile (its link is replaced by the sweep)."),
        concurrency: str = typer.Option("1,4,16,64", help="Concurrent workflows (comma-separated)."),
        bandwidth: str = typer.Option("0.05,0.1,0.25,0.5,1,2,4,8,16,64", help="Host link GB/s (comma-separated)."),
        fixed: int = typer.Option(2048, min=1), dynamic: int = typer.Option(64, min=0),
        output: int = typer.Option(64, min=1),
        prefix_fraction: float = typer.Option(0.3, help="Device pool = running requests + this fraction of all fixed prompts."),
        layerwise: bool = typer.Option(True, help="Layer-wise overlap of on-demand loads (HiCache)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write results as JSON ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write the heatmaps (PNG) here."),
        wide: bool = typer.Option(False, help="One table with all three metrics per cell (wider than 80 columns)."),
        progress: bool = typer.Option(True, help="Progress bar."),
    ) -> None:
        """Concurrency x bandwidth: hidden-load fraction, kvflow/hicache, hicache vs recompute."""
        from rich.console import Console

        from kvflow_agents.serving.sim import paper, report

        conc = positive_list(concurrency, "--concurrency", integer=True)
        bws = positive_list(bandwidth, "--bandwidth")
        if not 0 <= prefix_fraction <= 10:
            raise typer.BadParameter("must be in [0, 10]", param_hint="--prefix-fraction")
        _profile(profile, None)
        console = Console(stderr=json_out == "-")
        with _bar(len(conc) * len(bws), "sweep", progress and json_out != "-", console) as step:
            sw = paper.sweep(profile, concurrency=conc, bandwidth=bws, fixed=fixed, dynamic=dynamic,
                             output=output, prefix_fraction=prefix_fraction, layerwise=layerwise,
                             progress=step)
        if json_out != "-":
            for t in report.sweep_tables(sw, wide=wide):
                console.print(t)
        _emit(console, sw, json_out)
        if plot_out:
            report.plot_sweep(sw, plot_out)

    @sim.command("replay")
    def replay(
        trace: str = typer.Argument(..., help="JSONL trace (format: kvflow_agents.serving.sim.workloads)."),
        profile: str = typer.Option("llama-3.1-8b-a10g", help="Profile name or JSON file."),
        scale: int = typer.Option(1, min=1, help="Copies of every recorded workflow."),
        time_scale: float = typer.Option(1.0, help="Divide recorded times by this (>1: faster arrivals)."),
        stagger_s: float = typer.Option(0.0, min=0.0, help="Start offset between copies (s)."),
        distinct_prompts: bool = typer.Option(False, help="Copies get their own fixed prompts."),
        device_tokens: Optional[int] = typer.Option(None, min=1), host_tokens: Optional[int] = typer.Option(None, min=0),
        device_fraction: Optional[float] = typer.Option(None),
        link_gbps: Optional[float] = typer.Option(None), page_size: int = typer.Option(16, min=1),
        policies: str = typer.Option(_POLICIES),
        json_out: Optional[str] = typer.Option(None, "--json"), plot_out: Optional[str] = typer.Option(None, "--plot"),
        progress: bool = typer.Option(True),
    ) -> None:
        """Replay a trace recorded by the embedded server (``kvflow serve --record``) at scale."""
        from rich.console import Console

        from kvflow_agents.serving.sim import from_trace, load_trace

        pols = _policies(policies)
        prof = _profile(profile, link_gbps)
        if time_scale <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--time-scale")
        try:
            wl = from_trace(load_trace(trace), scale=scale, time_scale=time_scale, stagger_s=stagger_s,
                            distinct_prompts=distinct_prompts, page_size=page_size,
                            device_tokens=device_tokens, host_tokens=host_tokens, device_fraction=device_fraction)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="TRACE") from None
        console = Console(stderr=json_out == "-")
        res = _run_policies(prof, wl, pols, console, progress and json_out != "-")
        title = f"kvflow sim replay: {trace} x{scale} on {prof.name}"
        _report_run(console, res, wl, prof, title, json_out, plot_out)

    @sim.command("profiles")
    def profiles(name: Optional[str] = typer.Argument(None, help="Show one profile with sources.")) -> None:
        """List the cost profiles (or one, with each constant's source)."""
        from rich.console import Console

        from kvflow_agents.serving.sim import load_profile, profile_names
        from kvflow_agents.serving.sim.costs import profile_sources

        console = Console()
        if name is None:
            for n in profile_names():
                console.print(load_profile(n).describe())
            return
        if name not in profile_names():
            raise typer.BadParameter(f"choose from {', '.join(profile_names())}", param_hint="NAME")
        prof = load_profile(name)
        for k, v in prof.as_dict().items():
            src = profile_sources(name).get(k, "")
            console.print(f"[bold]{k}[/] = {v}" + (f"  [dim]({src})[/]" if src else ""))

    @sim.command("validate")
    def validate(
        bench_json: Optional[str] = typer.Option(None, help="`kvflow bench workflow --json` output to compare with."),
        json_out: Optional[str] = typer.Option(None, "--json"),
    ) -> None:
        """Simulate ``kvflow bench workflow``'s default config on the embedded-cpu profile."""
        from rich.console import Console

        from kvflow_agents.serving.sim import paper

        console = Console(stderr=json_out == "-")
        b = None
        if bench_json:
            try:
                with open(bench_json) as fh:
                    b = json.load(fh)
            except (OSError, ValueError) as e:
                raise typer.BadParameter(str(e), param_hint="--bench-json") from None
        v = paper.validate(b)  # the bench's own workload, pools and calibrated link when given
        doc: dict = {"sim": v}
        if b is not None:
            doc["bench"] = b
            doc["comparison"] = _compare_bench(v, b)
        if json_out != "-":
            console.print_json(json.dumps(doc.get("comparison") or v, default=str))
        _emit(console, doc, json_out)


def _report_run(console, res: dict, wl, prof, title: str, json_out: Optional[str],
                plot_out: Optional[str]) -> None:
    """Policies side by side: a table (unless JSON goes to stdout), JSON, an optional plot."""
    from kvflow_agents.serving.sim import report

    if json_out != "-":
        console.print(report.run_table(res, title))
    _emit(console, {"workload": wl.meta, "profile": prof.as_dict(),
                    "results": {p: r.as_dict() for p, r in res.items()}}, json_out)
    if plot_out:
        report.plot_run(res, plot_out, title)


def _compare_bench(sim: dict, bench: dict) -> dict:
    """Sim vs measured: per-policy latency order and kvflow ratios (within 20%?)."""
    lat = {}
    pols = bench.get("policies") or bench.get("results") or []
    for r in (pols.values() if isinstance(pols, dict) else pols):
        if isinstance(r, dict) and r.get("policy"):
            v = (r.get("workload") or {}).get("workflow_latency_mean_s")
            if v:
                lat[r["policy"]] = v
    out: dict = {"measured_latency": lat, "sim_latency": sim["latency"]}
    if {"kvflow", "lru", "hicache"} <= set(lat):
        meas = {"kvflow_vs_lru": lat["lru"] / lat["kvflow"], "kvflow_vs_hicache": lat["hicache"] / lat["kvflow"]}
        out["measured"] = meas
        out["sim"] = {k: sim[k] for k in meas}
        out["within_20pct"] = {k: abs(sim[k] / meas[k] - 1) <= 0.2 for k in meas}
        pols = [p for p in ("lru", "hicache", "kvflow") if p in lat]
        out["same_order"] = (sorted(pols, key=lat.get) == sorted(pols, key=sim["latency"].get))
    return out
