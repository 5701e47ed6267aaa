"""``kvflow bench engine``, ``layout`` and ``forwards``: the embedded engine measured in-process
(no server, no client): where a decode step's time goes, what the pages' layout in the pool costs
it, and whether a policy's cache work slows the model's forwards."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from .bench_options import _DEFAULT_POLICIES, _policies, command_line, emit_document, escape


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("engine")
    def engine_cmd(
        model: str = typer.Option("tiny-random", help="Model preset of the in-process engines."),
        policies: str = typer.Option(_DEFAULT_POLICIES, help="Comma-separated: lru,hicache,kvflow,oracle."),
        batch: str = typer.Option("1,8,32", help="Batch sizes (comma-separated): requests decoding at once."),
        context: int = typer.Option(1024, min=16, help="Fixed system prompt per request (tokens)."),
        steps: int = typer.Option(64, min=8, help="Decode steps per request."),
        sink: str = typer.Option("asyncio", help="asyncio: stream every token to an event loop as "
                                                 "`kvflow serve` does; direct: no-op sinks."),
        cprofile: bool = typer.Option(False, help="Also cProfile the engine thread; print the top functions."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        markdown: bool = typer.Option(False, help="Print the table as Markdown (every column)."),
    ) -> None:
        """Where a decode step goes: model forward vs the rest (cache, scheduler, sampling,
        detokenise, sinks, engine loop), per policy and batch size, in-process."""
        from rich.console import Console

        from kvflow_agents.bench import engine_step

        pols = _policies(policies)
        try:
            batches = sorted({int(x) for x in batch.split(",") if x.strip()})
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--batch") from None
        if not batches or min(batches) < 1 or max(batches) > 256:
            raise typer.BadParameter("batch sizes must be in [1, 256]", param_hint="--batch")
        if sink not in engine_step.SINKS:
            raise typer.BadParameter(f"choose one of {', '.join(engine_step.SINKS)}", param_hint="--sink")
        console = Console(stderr=json_out == "-")
        with console.status("measuring …") as status:
            res = engine_step.run_engine_bench(
                model=model, policies=pols, batches=batches, context=context, steps=steps,
                cprofile=cprofile, sink_mode=sink,
                progress=lambda s: status.update(f"measuring {s} …") if json_out != "-" else None)
        summ = engine_step.summary(res)
        doc = {"bench": "engine", "model": model, "context": context, "steps": steps, "sink": sink,
               "command": command_line("engine"),
               "results": [r.as_dict() for r in res], "summary": summ}
        title = (f"kvflow bench engine: {model}, {context}-token prompts, ms per decode step "
                 f"(median), sinks: {sink}")
        if json_out == "-":
            from kvflow_agents.bench import report

            sys.stdout.write(json.dumps(report.stamp(doc), indent=2) + "\n")
        else:
            if markdown:
                console.print(engine_step.markdown(res), highlight=False, soft_wrap=True)
            else:
                console.print(engine_step.render_table(res, title))
            if "met" in summ:
                worst = summ["batch1_rest_max_ms"]
                console.print(f"target: rest <= {summ['rest_target_ms']} ms per step at batch 1 under every "
                              f"policy: worst {worst:.3f} ms (spread {summ['batch1_rest_spread_ms']:.3f}) -> "
                              + ("[green]met[/]" if summ["met"] else "[red]MISSED[/]"))
            if cprofile:
                for r in res:
                    console.print(f"[bold]{r.policy} batch {r.batch}[/]: top functions (ms per step, calls)")
                    for name, ms, calls in r.profile_top:
                        console.print(f"  {ms:8.3f} {calls:8.1f}  {escape(name)}", highlight=False)
            if json_out:
                from kvflow_agents.bench import report

                report.write_json(doc, json_out)
                console.print(f"[dim]JSON written to {json_out}[/]")
        if plot_out:
            engine_step.plot(res, plot_out, title)

    @bench_app.command("layout")
    def layout_cmd(
        model: str = typer.Option("tiny-random", help="Model preset (in-process, no server)."),
        batch: int = typer.Option(8, min=1, max=256, help="Sequences decoding at once."),
        context: int = typer.Option(1090, min=16, help="Tokens per sequence."),
        runs: str = typer.Option("1,4,19,0", help="Page runs per sequence to compare (comma-separated; "
                                                  "0 = every page its own run)."),
        reps: int = typer.Option(7, min=1, help="Repetitions (each times every layout once, in turn)."),
        steps: int = typer.Option(40, min=1, help="Decode steps timed per layout and repetition."),
        torch_threads: int = typer.Option(1, min=1, help="torch threads (the benches' servers use 1)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
    ) -> None:
        """What a sequence's page layout costs a decode step: the same batch with its pages in 1, 4,
        19 ... runs, timed side by side (the cost partial eviction's fragments add per token)."""
        from rich.console import Console

        from kvflow_agents.bench import page_layout

        try:
            wanted = [int(x) for x in runs.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--runs") from None
        if not wanted or min(wanted) < 0:
            raise typer.BadParameter("run counts must be >= 0 (0: one run per page)", param_hint="--runs")
        console = Console(stderr=json_out == "-")
        with console.status("measuring …") as status:
            try:
                res = page_layout.measure_layouts(
                    model=model, batch=batch, context=context, runs=wanted, reps=reps, steps=steps,
                    torch_threads=torch_threads,
                    progress=lambda s: status.update(f"measuring: {s} …") if json_out != "-" else None)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--model/--context") from None
        doc = {"bench": "layout", "model": model, "batch": batch, "context": context, "reps": reps,
               "steps": steps, "torch_threads": torch_threads, "command": command_line("layout"),
               "results": [r.as_dict() for r in res]}
        title = (f"kvflow bench layout: {model}, batch {batch} x {context} tokens, decode step by "
                 f"page runs per sequence")
        emit_document(console, doc, page_layout.render_table(res, title), json_out=json_out,
                      plot=(lambda: page_layout.plot(res, plot_out, title)) if plot_out else None)

    @bench_app.command("forwards")
    def forwards_cmd(
        model: str = typer.Option("tiny-random", help="Model preset of the in-process engines."),
        policies: str = typer.Option("hicache,kvflow,oracle", help="Comma-separated, with the oracle "
                                     "(the reference)."),
        agents: int = typer.Option(10, min=2, help="Agents in the cycle."),
        fixed: int = typer.Option(1024, min=16, help="Fixed prompt tokens per agent."),
        dynamic: int = typer.Option(32, min=1, help="Dynamic tokens per call."),
        output: int = typer.Option(16, min=2, help="Output tokens per call."),
        rounds: int = typer.Option(5, min=1, help="Measured rounds of the cycle per repetition."),
        reps: int = typer.Option(7, min=2, help="Repetitions (fresh engines each)."),
        device_fraction: float = typer.Option(0.4, help="Device pool as a fraction of the fixed prompts."),
        host_link_gbps: float = typer.Option(0.07, help="Emulated host link (GB/s; the 2-core box "
                                             "calibrates 0.06-0.08 for tiny-random)."),
        workflows: int = typer.Option(1, min=1, help="Concurrent workflows per engine (one client "
                                      "thread each, prompts of their own); above 1 the engines "
                                      "take turns round by round instead of call by call."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
    ) -> None:
        """Model seconds per decode step and per prefill, wall time per call and the engine's
        busy time beside its forwards per call, under each policy, on engines in this one process with calls (or, with --workflows, rounds)
        interleaved, relative to the oracle's: whether a policy's cache work slows the forwards
        or the engine, free of the machine's drift (the workflow benches' caveat lines)."""
        from rich.console import Console

        from kvflow_agents.bench import forwards

        pols = _policies(policies)
        if forwards.REFERENCE not in pols:
            raise typer.BadParameter("include the oracle (the reference)", param_hint="--policies")
        if not 0 < device_fraction <= 1 or host_link_gbps <= 0:
            raise typer.BadParameter("--device-fraction must be in (0, 1], --host-link-gbps > 0")
        console = Console(stderr=json_out == "-")
        with console.status("measuring …") as status:
            res = forwards.run_forwards_bench(
                model=model, policies=pols, agents=agents, fixed=fixed, dynamic=dynamic,
                output=output, rounds=rounds, reps=reps, device_fraction=device_fraction,
                host_link_gbps=host_link_gbps, workflows=workflows,
                progress=lambda s: status.update(f"measuring: {s} …") if json_out != "-" else None)
        doc = {"bench": "forwards", "model": model, "agents": agents, "fixed": fixed,
               "dynamic": dynamic, "output": output, "rounds": rounds, "reps": reps,
               "device_fraction": device_fraction, "host_link_gbps": host_link_gbps,
               "workflows": workflows, "command": command_line("forwards"),
               "results": [r.as_dict() for r in res], "ratios": forwards.ratios(res)}
        title = (f"kvflow bench forwards: {model}, cycle of {agents} agents, {fixed}/{dynamic}/"
                 f"{output} tokens, {workflows} workflow(s), {reps} x {rounds} rounds, one process, "
                 f"{'calls' if workflows == 1 else 'rounds'} interleaved; model ms per decode step and "
                 f"per call's prefill, wall ms and the engine's ms beside its forwards per call")
        emit_document(console, doc, forwards.render_table(res, title), json_out=json_out,
                      plot=(lambda: forwards.plot(res, plot_out, title)) if plot_out else None)
