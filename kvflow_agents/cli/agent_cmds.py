"""Benchmarks of what agents add to serving: ``kvflow bench grammar`` (the cost of the grammar
mask behind tool calls and structured output, per decode step) and ``kvflow bench toolgap``
(the resumed turn after a tool call, per cache policy)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import typer

from .options import positive_list


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("grammar")
    def bench_grammar_cmd(
        model: str = typer.Option("smollm2-135m", help="Model preset or path (as kvflow serve --model)."),
        batches: str = typer.Option("1,4,8", help="Batch sizes (comma-separated)."),
        context: int = typer.Option(512, min=16, max=4096, help="Tokens of KV per sequence in the decode step."),
        reps: int = typer.Option(20, min=3, help="Timed repetitions per cell (medians are reported)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        out: Optional[Path] = typer.Option(None, help="Also write the JSON here."),
    ) -> None:
        """Cost of grammar-constrained decoding (xgrammar token masks) per decode step: a real
        batched decode step, the sampler without and with every request constrained, and the
        ratio of the two step times."""
        from rich.console import Console

        from kvflow_agents.bench.grammar import bench_grammar

        console = Console(stderr=True)
        try:
            res = bench_grammar(model, positive_list(batches, "--batches", integer=True), context, reps,
                                progress=None if as_json else (lambda s: console.print(f"[dim]{s}[/]")))
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        if out is not None:
            out.write_text(json.dumps(res, indent=2) + "\n")
        if as_json:
            typer.echo(json.dumps(res, indent=2))
            return
        from rich.table import Table

        t = Table(title=f"Grammar mask cost per decode step ({res['model']}, {res['context']}-token context, "
                        f"vocab {res['vocab']}, median of {res['reps']})")
        for c in ("batch", "constraint", "decode ms", "sample ms plain", "sample ms masked",
                  "mask ms", "fill µs/row", "step masked/plain", "compile ms"):
            t.add_column(c, justify="left" if c == "constraint" else "right")
        for r in res["rows"]:
            t.add_row(str(r["batch"]), r["case"], f"{r['decode_ms']:.1f}", f"{r['sample_plain_ms']:.2f}",
                      f"{r['sample_masked_ms']:.2f}", f"{r['mask_ms']:.2f}", f"{r['fill_us_per_row']:.0f}",
                      f"×{r['step_ratio']:.3f}", f"{r['compile_ms']:.1f}")
        Console(width=max(Console().width, 150)).print(t)

    @bench_app.command("toolgap")
    def bench_toolgap_cmd(
        model: str = typer.Option("tiny-random", help="Model preset or path (as kvflow serve --model)."),
        gaps: str = typer.Option("0.1,0.5,1,2", help="Tool durations to measure, seconds (comma-separated)."),
        trials: int = typer.Option(3, min=1, help="Trials per gap and policy (medians are reported)."),
        fixed: int = typer.Option(512, min=16, help="The agent's fixed prompt (characters; tokens on tiny-random)."),
        history: int = typer.Option(1024, min=16, help="Its task history before the tool call."),
        background_rate: float = typer.Option(8.0, min=0.0, help="Other workflows' requests per second during the gap."),
        device_tokens: int = typer.Option(4096, min=256, help="Device KV pool (tokens)."),
        host_link_gbps: float = typer.Option(0.2, min=0.0, help="Emulated host link, GB/s (0: real copy speed)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        out: Optional[Path] = typer.Option(None, help="Also write the JSON here."),
    ) -> None:
        """The turn after a tool call: resumed-turn TTFT vs a warm hit, per tool duration, for
        lru, hicache, kvflow without the tool's timing and kvflow with it (kvflow_tool_s), side
        by side on one engine per policy while other workflows keep the cache busy."""
        from rich.console import Console

        from kvflow_agents.bench.toolgap import bench_toolgap

        gap_list = positive_list(gaps, "--gaps")
        console = Console(stderr=True)
        res = bench_toolgap(model=model, gaps=gap_list, trials=trials, fixed=fixed, history=history,
                            background_rate=background_rate, device_tokens=device_tokens,
                            host_link_gbps=host_link_gbps or None,
                            progress=None if as_json else (lambda s: console.print(f"[dim]{s}[/]")))
        if out is not None:
            out.write_text(json.dumps(res, indent=2) + "\n")
        if as_json:
            typer.echo(json.dumps(res, indent=2))
            return
        from rich.table import Table

        variants = list(dict.fromkeys(r["variant"] for r in res["rows"]))
        t = Table(title=f"Resumed turn after a tool call: TTFT ms (× a warm hit) \\[prompt tokens recomputed] — "
                        f"{res['model']}, {res['trials']} trials, background {res['background_rate']:g} req/s")
        t.add_column("tool gap", justify="right")
        for v in variants:
            t.add_column(v, justify="right")
        t.add_column("warm hit ms", justify="right")
        by = {(r["variant"], r["gap_s"]): r for r in res["rows"]}
        for g in res["gaps_s"]:
            cells = []
            for v in variants:
                r = by[(v, g)]
                cells.append(f"{r['resumed_ttft_s'] * 1e3:.0f} (×{r['ratio_vs_warm']:.1f}) [{r['recomputed_tokens']:.0f}]")
            warm = statistics.median(by[(v, g)]["warm_ttft_s"] for v in variants)
            t.add_row(f"{g:g} s", *cells, f"{warm * 1e3:.0f}")
        Console(width=max(Console().width, 150)).print(t)
