"""``kvflow bench aiperf``: NVIDIA's AIPerf (a client we did not write) against ``kvflow serve``,
per policy (helpers shared with ``bench workflow`` live in :mod:`.bench_options`)."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from .bench_options import (
    _DEFAULT_POLICIES,
    _HINTS_HELP,
    _OTHER_PYTHON_HELP,
    _SERVER_THREADS_HELP,
    _VARIANT_HELP,
    _hint_mode,
    _other_checkout,
    _policies,
    _policy_variants,
    _round_page,
    _server_threads,
    _size_servers,
    command_line,
    escape,
)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("aiperf")
    def aiperf_cmd(
        workload: str = typer.Option("agentic", help="agentic: our agent cycle as AIPerf sessions (hints per "
                                                     "--hints); multi-turn: AIPerf's own synthetic multi-turn "
                                                     "conversations behind a shared system prompt (no hints)."),
        hints: str = typer.Option("on", help=_HINTS_HELP + " (agentic only; multi-turn sends none)."),
        hint_lag: int = typer.Option(2, min=1, help="--hints stale: STE map from this many requests earlier."),
        agents: int = typer.Option(10, min=1, help="agentic: agents in the cycle."),
        fixed: int = typer.Option(1024, min=1, help="agentic: fixed prompt tokens per agent."),
        dynamic: int = typer.Option(32, min=1, help="agentic: dynamic tokens per call."),
        output: int = typer.Option(16, min=1, help="Output tokens per call (both workloads)."),
        rounds: int = typer.Option(2, min=1, help="agentic: measured rounds per workflow (AIPerf's)."),
        warmup_rounds: int = typer.Option(1, min=0, help="agentic: warm-up rounds sent by our client first."),
        workflows: int = typer.Option(2, min=1, help="Concurrent sessions (AIPerf --concurrency)."),
        conversations: int = typer.Option(8, min=1, help="multi-turn: conversations in all."),
        turns: int = typer.Option(5, min=1, help="multi-turn: turns per conversation."),
        system_prompt: int = typer.Option(1024, min=1, help="multi-turn: shared system prompt tokens."),
        isl: int = typer.Option(64, min=1, help="multi-turn: new user tokens per turn."),
        trials: int = typer.Option(1, min=1, help="AIPerf runs per policy (policies interleaved)."),
        policies: str = typer.Option(_DEFAULT_POLICIES, help="Comma-separated: lru,hicache,kvflow,oracle."),
        policy_variant: Optional[List[str]] = typer.Option(None, help=_VARIANT_HELP),
        other_python: Optional[str] = typer.Option(None, help=_OTHER_PYTHON_HELP),
        model: str = typer.Option("tiny-random", help="Model preset for the embedded servers."),
        device_tokens: Optional[int] = typer.Option(None, help="Device KV pool (tokens)."),
        device_fraction: float = typer.Option(0.4, help="Default device pool as a fraction of the fixed prompts "
                                                        "(multi-turn: of all conversations' contexts)."),
        host_tokens: Optional[int] = typer.Option(None, help="Host KV pool (tokens)."),
        page_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
        host_link_gbps: Optional[float] = typer.Option(None, help="Emulated host link (GB/s); default calibrated."),
        load_fraction: float = typer.Option(1 / 3, show_default="1/3", help="Calibration: load / recompute."),
        max_batch: int = typer.Option(16, min=1, help="Server max batch."),
        server_threads: Optional[int] = typer.Option(None, min=0, help=_SERVER_THREADS_HELP),
        aiperf_bin: Optional[str] = typer.Option(None, help="The aiperf executable (default: on PATH, else "
                                                            "<--aiperf-venv>/bin/aiperf)."),
        aiperf_venv: str = typer.Option(".venv-aiperf", help="AIPerf's own virtualenv (created when missing)."),
        install: bool = typer.Option(True, help="Create --aiperf-venv with aiperf in it when aiperf is missing."),
        keep: Optional[str] = typer.Option(None, help="Keep AIPerf's artifacts (per policy) in this directory."),
        seed: int = typer.Option(0, help="Seed of the prompts (and AIPerf's --random-seed)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        markdown: bool = typer.Option(False, help="Print the table as Markdown."),
    ) -> None:
        """NVIDIA AIPerf (a client we did not write) against `kvflow serve`, one server per policy:
        AIPerf's own metrics next to ours."""
        import dataclasses
        import tempfile
        from pathlib import Path

        from rich.console import Console

        from kvflow_agents.bench import aiperf as ap
        from kvflow_agents.bench import report
        from kvflow_agents.bench.workload import WorkloadSpec, token_counter

        if workload not in ap.WORKLOADS:
            raise typer.BadParameter(f"choose one of {', '.join(ap.WORKLOADS)}", param_hint="--workload")
        _hint_mode(hints)
        pols, variants = _policy_variants(policy_variant, _policies(policies))
        pols, variants, commands = _other_checkout(other_python, pols, variants)
        threads = _server_threads(server_threads)
        console = Console(stderr=json_out == "-")
        try:
            exe = ap.ensure_aiperf(aiperf_bin, aiperf_venv, install=install,
                                   log=lambda s: console.print(f"[dim]{escape(s)}[/]"))
        except ap.AIPerfUnavailable as e:
            console.print(f"[red]error:[/] {escape(str(e))}")
            raise typer.Exit(2) from None
        counter = token_counter(model)
        meta: dict = {"bench": "aiperf", "workload_kind": workload, "policies_run": pols, "aiperf": exe,
                      "aiperf_version": ap.AIPERF_VERSION}
        if workload == "agentic":
            spec = WorkloadSpec(agents=agents, fixed=fixed, dynamic=dynamic, output=output, rounds=rounds,
                                warmup_rounds=warmup_rounds, workflows=workflows, seed=seed, hints=hints,
                                hint_lag=hint_lag)
            spec.validate()
            meta["workload"] = spec.as_dict()
            server = _size_servers(spec, counter, model=model, pols=pols, device_tokens=device_tokens,
                                   device_fraction=device_fraction, host_tokens=host_tokens,
                                   page_size=page_size, host_link_gbps=host_link_gbps,
                                   load_fraction=load_fraction, lookahead=1, max_batch=max_batch,
                                   console=console, meta=meta, torch_threads=threads, variants=variants,
                                   commands=commands)
            title = (f"kvflow bench aiperf: cycle of {agents} agents, {fixed}/{dynamic}/{output} tokens, "
                     f"{workflows} session(s) x {rounds} round(s), {model}, hints: {hints}")
        else:
            # the "fixed prompt" is the shared system prompt; contexts grow with each turn
            spec = WorkloadSpec(agents=1, fixed=system_prompt, dynamic=isl, output=output, rounds=turns,
                                warmup_rounds=0, workflows=conversations, seed=seed, hints="none",
                                share_prompts=True)
            ctx = conversations * (system_prompt + turns * (isl + output + 16))
            meta["workload"] = {"conversations": conversations, "turns": turns, "system_prompt": system_prompt,
                                "isl": isl, "osl": output, "concurrency": workflows, "context_tokens": ctx}
            server = _size_servers(spec, counter, model=model, pols=pols,
                                   device_tokens=device_tokens or max(
                                       _round_page(device_fraction * ctx, page_size),
                                       workflows * _round_page(system_prompt + turns * (isl + output + 16) + 64,
                                                               page_size)),
                                   device_fraction=device_fraction, host_tokens=host_tokens or max(8192, 2 * ctx),
                                   page_size=page_size, host_link_gbps=host_link_gbps,
                                   load_fraction=load_fraction, lookahead=1, max_batch=max_batch,
                                   console=console, meta=meta, fixed_total=ctx,
                                   torch_threads=threads, variants=variants,
                                   commands=commands)
            title = (f"kvflow bench aiperf: AIPerf multi-turn, {conversations} conversations x {turns} turns, "
                     f"system {system_prompt} + {isl}/{output} tokens per turn, concurrency {workflows}, {model}")
        # (the work folder after sizing: a bad flag above leaves no temp folder behind)
        work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="kvflow-aiperf-"))
        work.mkdir(parents=True, exist_ok=True)
        tok_dir = ap.write_tokenizer(model, work / "tokenizer")
        run = ap.AIPerfRun(model=model, tokenizer=str(tok_dir), concurrency=workflows, workload=workload,
                           conversations=conversations, turns=turns, system_prompt_tokens=system_prompt,
                           isl=isl, osl=output, seed=seed)
        shown = ap.AIPerfRun(**{**dataclasses.asdict(run), "input_dir": str(work / "data-POLICY-tTRIAL"),
                                "request_count": workflows * rounds * agents if workload == "agentic" else None})
        meta["aiperf_command"] = " ".join(shown.argv(exe, "http://127.0.0.1:PORT", str(work / "aiperf-POLICY-tTRIAL")))
        meta["command"] = command_line("aiperf")
        from kvflow_agents.bench.server import ServerStartError

        try:
            with console.status("running …") as status:
                results = ap.run_aiperf_bench(
                    aiperf_bin=exe, spec=spec, counter=counter, policies=pols, server=server, run=run,
                    workdir=work, trials=trials, log=lambda s: console.print(f"[dim]{escape(s)}[/]"),
                    progress=(lambda s: status.update(f"{s} …")) if json_out != "-" else None)
        except ServerStartError as e:
            console.print(f"[red]error: a server did not start[/]\n{escape(str(e))}")
            raise typer.Exit(3) from None
        except RuntimeError as e:
            console.print(f"[red]error:[/] {escape(str(e))}")
            raise typer.Exit(1) from None
        finally:
            if not keep:
                import shutil

                shutil.rmtree(work, ignore_errors=True)
        doc = report.to_json(meta, results, ())
        if json_out == "-":
            sys.stdout.write(json.dumps(report.stamp(doc), indent=2, default=str) + "\n")
        else:
            if markdown:
                console.print(ap.markdown(results), highlight=False, soft_wrap=True)
            else:
                console.print(ap.render_table(results, title))
            console.print(f"[dim]AIPerf command (per policy; the paths are a temporary directory unless "
                          f"--keep): {escape(meta['aiperf_command'])}[/]")
            if keep:
                console.print(f"[dim]AIPerf artifacts kept in {keep}[/]")
            if json_out:
                report.write_json(doc, json_out)
                console.print(f"[dim]JSON written to {json_out}[/]")
        if plot_out:
            from kvflow_agents.bench.report_plot import plot

            plot(results, plot_out, title=title)
        if any(r.workload.get("errors") for r in results):
            raise typer.Exit(1)
