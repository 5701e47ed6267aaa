"""Benchmarks of what agents add to serving: ``kvflow bench grammar`` (the cost of the grammar
mask behind tool calls and structured output, per decode step) and ``kvflow bench toolgap``
(the resumed turn after a tool call, per cache policy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from None
    if not out or any(x < 1 for x in out):
        raise typer.BadParameter("expected positive integers", param_hint=name)
    return out


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
            res = bench_grammar(model, _ints(batches, "--batches"), context, reps,
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
