"""``kvflow bench peer``: the PEER example (LangGraph or AutoGen) as the workload, one embedded
server per policy (helpers shared with ``bench workflow`` live in :mod:`.bench_options`)."""

from __future__ import annotations

from typing import List, Optional

import typer

from .bench_options import (
    _DEFAULT_POLICIES,
    _HINTS_HELP,
    _OTHER_PYTHON_HELP,
    _SERVER_FLAG_HELP,
    _SERVER_THREADS_HELP,
    _VARIANT_HELP,
    _hint_mode,
    _other_checkout,
    _policies,
    _policy_variants,
    _round_page,
    _run_and_report,
    _runs_policy,
    _server_flags,
    _server_threads,
    _variants_json,
    command_line,
)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("peer")
    def peer(
        framework: str = typer.Option("langgraph", help="langgraph (the PEER example) or autogen."),
        questions: int = typer.Option(2, min=1, help="Measured questions (one workflow each)."),
        ids: Optional[str] = typer.Option(None, help="Comma-separated question ids (overrides --questions)."),
        warmup_questions: int = typer.Option(1, min=0, help="Unmeasured warm-up questions first."),
        jump: str = typer.Option("expressing", help="Where a failed review goes: expressing | planning."),
        max_rounds: int = typer.Option(2, min=1, help="Most reviews per question."),
        max_tokens: int = typer.Option(
            48, min=1, help="Max completion tokens per call of the AutoGen app (the LangGraph app "
                            "caps each agent's calls itself: MAX_TOKENS in "
                            "examples/peer_financial_qa/app.py)."),
        policies: str = typer.Option(_DEFAULT_POLICIES, help="Comma-separated: lru,hicache,kvflow,oracle."),
        model: str = typer.Option("smollm2-135m", help="Model preset for the embedded servers."),
        device_tokens: Optional[int] = typer.Option(
            None, help="Device KV pool (tokens). Default: --device-fraction of the 4 agents' fixed "
                       "prompts, at least what the largest single request needs."),
        device_fraction: float = typer.Option(0.6, help="Default device pool as a fraction of the fixed prompts."),
        host_tokens: int = typer.Option(16384, min=0, help="Host KV pool (tokens)."),
        page_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
        host_link_gbps: Optional[float] = typer.Option(
            None, help="Emulated host link (GB/s). Default: calibrated (load = --load-fraction x recompute)."),
        load_fraction: float = typer.Option(1 / 3, show_default="1/3",
                                            help="Calibration target: load time / recompute time."),
        lookahead: int = typer.Option(1, min=0, help="Server prefetch lookahead (STE)."),
        base_url: Optional[str] = typer.Option(None, help="Measure this running server (…/v1) instead."),
        served_model: Optional[str] = typer.Option(None, help="Model name sent with --base-url."),
        api_key: Optional[str] = typer.Option(None, envvar="KVFLOW_API_KEY", help="API key for the server(s)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        raw: bool = typer.Option(False, help="Include every LLM call's record in the JSON."),
        seed: int = typer.Option(0, help="Sampling seed sent to the server."),
        hints: str = typer.Option("on", help=_HINTS_HELP),
        hint_lag: int = typer.Option(2, min=1, help="--hints stale: STE map from this many requests earlier."),
        policy_variant: Optional[List[str]] = typer.Option(None, help=_VARIANT_HELP),
        other_python: Optional[str] = typer.Option(None, help=_OTHER_PYTHON_HELP),
        server_flag: Optional[List[str]] = typer.Option(None, help=_SERVER_FLAG_HELP),
        server_threads: Optional[int] = typer.Option(None, min=0, help=_SERVER_THREADS_HELP),
        next_run: bool = typer.Option(True, help="The app's hints name the next question's planner while "
                                      "the reviewer runs (kvflow.instrument(next_run=True)): questions come "
                                      "one after another."),
        fresh_servers: bool = typer.Option(False, help="Start every policy's server again for each "
                                                       "measured question (each warmed up with the "
                                                       "warm-up question(s) first): what one process "
                                                       "drew is drawn again per question."),
        wide: bool = typer.Option(False, help="Every table row (the default table fits 80 columns)."),
        progress: bool = typer.Option(True, help="Progress bars."),
    ) -> None:
        """The PEER example (plan / parallel execute / express / review) as the workload."""
        from rich.console import Console

        from kvflow_agents.bench import report

        if framework not in ("langgraph", "autogen"):
            raise typer.BadParameter("choose langgraph or autogen", param_hint="--framework")
        if jump not in ("expressing", "planning"):
            raise typer.BadParameter("choose expressing or planning", param_hint="--jump")
        if host_link_gbps is not None and host_link_gbps <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--host-link-gbps")
        if not 0 < device_fraction <= 10:
            raise typer.BadParameter("must be in (0, 10]", param_hint="--device-fraction")
        if not 0 < load_fraction <= 10:
            raise typer.BadParameter("must be in (0, 10]", param_hint="--load-fraction")
        _hint_mode(hints)
        pols, variants = _policy_variants(policy_variant, _policies(policies))
        pols, variants, commands = _other_checkout(other_python, pols, variants)
        extra_args = _server_flags(server_flag)
        threads = _server_threads(server_threads)
        for given, hint in ((extra_args, "--server-flag"), (commands, "--other-python"),
                            (variants, "--policy-variant")):
            if given and base_url:
                raise typer.BadParameter("passes options to the embedded servers this command starts; "
                                         "not with --base-url", param_hint=hint)
        if fresh_servers and base_url:
            raise typer.BadParameter("restarts the servers this command starts; not with --base-url",
                                     param_hint="--fresh-servers")
        console = Console(stderr=json_out == "-")
        from kvflow_agents.bench import peer as peer_bench

        try:
            peer_bench.check_available(framework)
        except peer_bench.PeerUnavailable as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
        opts = peer_bench.PeerOptions(questions=questions, ids=ids.split(",") if ids else None,
                                      warmup_questions=warmup_questions, jump=jump, max_rounds=max_rounds,
                                      max_tokens=max_tokens, seed=seed, framework=framework,
                                      hints=hints, hint_lag=hint_lag, next_run=next_run)
        try:
            qs, warm = peer_bench.pick_questions(opts)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--ids") from None
        meta: dict = {"bench": "peer", "framework": framework, "options": opts.as_dict(),
                      "questions": [q.id for q in qs], "warmup": [q.id for q in warm],
                      "policies_run": pols}
        server = None
        if not base_url:
            from kvflow_agents.bench.runner import ServerConfig

            fixed_toks = peer_bench.fixed_prompt_tokens(model)
            total = sum(fixed_toks.values())
            need = peer_bench.min_device_tokens(
                fixed_toks, peer_bench.largest_completion(framework, max_tokens), page_size)
            dev = device_tokens if device_tokens is not None else max(
                _round_page(device_fraction * total, page_size), need)
            link = host_link_gbps
            if link is None and _runs_policy(pols, variants, ("hicache", "kvflow")):
                from kvflow_agents.bench.calibrate import calibrate_link
                from kvflow_agents.bench.workload import token_counter

                console.print(f"[dim]calibrating the emulated host link on {model} …[/]")
                cal = calibrate_link(model, int(sum(fixed_toks.values()) / len(fixed_toks)),
                                     counter=token_counter(model), dynamic=64, page_size=page_size,
                                     load_fraction=load_fraction, samples=2, torch_threads=threads)
                console.print(cal.describe())
                meta["calibration"] = cal.as_dict()
                link = cal.link_gbps
            console.print(f"fixed prompts {fixed_toks} = {total} tokens; device pool {dev} tokens "
                          f"({dev / total:.0%}); host pool {host_tokens}; host link "
                          + (f"{link:.4g} GB/s (EMULATED)" if link else "real copy speed"))
            server = ServerConfig(model=model, device_tokens=dev, host_tokens=host_tokens,
                                  page_size=page_size, host_link_gbps=link, lookahead=lookahead,
                                  torch_threads=threads, extra_args=extra_args, variants=variants,
                                  commands=commands)
            meta["server"] = {"model": model, "device_tokens": dev, "host_tokens": host_tokens,
                              "page_size": page_size, "host_link_gbps": link, "lookahead": lookahead,
                              "torch_threads": threads, "extra_args": list(extra_args),
                              "fixed_prompt_tokens": fixed_toks,
                              "variants": _variants_json(variants), "commands": commands}
        meta["command"] = command_line("peer")
        title = (f"kvflow bench peer ({framework}): {len(qs)} question(s) ({', '.join(q.id for q in qs)}), "
                 f"{model}, "
                 + (f"max_tokens {max_tokens}" if framework == "autogen" else "max_tokens per agent")
                 + ("" if hints == "on" else f", hints: {hints}"))
        _run_and_report(
            lambda hook, log: peer_bench.run_peer_bench(qs, warm, opts, pols, server, base_url=base_url,
                                                        model=served_model or model, api_key=api_key,
                                                        progress=hook, keep_raw=raw,
                                                        fresh_servers=fresh_servers, log=log),
            console, meta, title=title, targets=report.PEER_TARGETS if not base_url else (),
            progress=progress, raw=raw, json_out=json_out, plot_out=plot_out, wide=wide)

    @bench_app.command("pool-bound")
    def pool_bound(
        result: str = typer.Argument(..., help="A `kvflow bench peer --raw --json` file."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Also write the numbers here."),
        gap_slack: float = typer.Option(
            0.02, min=0.0, help="Seconds added to each gap between a request's end and the next "
                                "one's arrival (the records are the client's; the server's gaps "
                                "are a few ms longer): keeps the bound a lower bound."),
    ):
        """What no policy could have had on device with the run's pool: per policy, the reusable
        prefix tokens missing from device at arrival vs a same-pool lower bound, and the share of
        hicache's excess over that bound a policy removed (kvflow_agents/bench/pool_bound.py)."""
        import json
        from pathlib import Path

        from rich.console import Console
        from rich.table import Table

        from kvflow_agents.bench.pool_bound import summarize

        try:
            doc = json.loads(Path(result).read_text())
            rows = summarize(doc, slack_s=gap_slack)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="RESULT") from None
        table = Table(title=f"device misses vs the same-pool bound: {Path(result).name}")
        for col in ("policy", "reusable", "missing", "bound", "same-pool saving"):
            table.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in rows.items():
            sav = r["same_pool_saving"]
            table.add_row(name, str(r["want_tokens"]), str(r["device_miss"]),
                          "-" if r["bound"] is None else str(r["bound"]),
                          "-" if sav is None else f"{sav:.2f}")
        console = Console()
        console.print(table)
        for name, r in rows.items():
            if r["bound"] is None:
                per = ", ".join(f"{a} {v['device_miss']}" for a, v in r["by_agent"].items())
                console.print(f"{name}: missing by agent (its pool grows: no bound): {per}")
                continue
            per = ", ".join(f"{a} {v['device_miss']}/{v['bound']}" for a, v in r["by_agent"].items())
            console.print(f"{name}: missing/bound by agent: {per}")
        beat = {n: r["beat_bound"] for n, r in rows.items() if r["bound"] is not None and r["beat_bound"]}
        if beat:
            console.print(f"[yellow]calls with fewer misses than the bound {beat}: it is not a lower "
                          f"bound for this run; raise --gap-slack[/]")
        if json_out:
            Path(json_out).write_text(json.dumps(rows, indent=1))

