"""``kvflow bench reliability``: the server's fault suite (see :mod:`kvflow_agents.bench.reliability`)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("reliability")
    def reliability(
        quick: bool = typer.Option(False, "--quick", help="Every row with small counts (seconds, "
                                   "tiny-random only; what `make test` runs)."),
        seed: int = typer.Option(0, help="Seed of the fuzz corpus (same seed, same cases)."),
        fuzz_cases: Optional[int] = typer.Option(None, min=1, help="Fuzz cases (full: 5200)."),
        soak_s: Optional[float] = typer.Option(None, min=1, help="Soak duration in seconds (full: 600)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the rows as JSON here ('-': stdout)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Draw soak RSS and hint-memory rounds (PNG)."),
        markdown_out: Optional[str] = typer.Option(None, "--markdown", help="Write the table as Markdown here."),
        progress: bool = typer.Option(True, help="Show progress bars."),
    ) -> None:
        """Fault suite of `kvflow serve` on 127.0.0.1: fuzz, isolation, /health under load,
        disconnects, slow clients, tenants, hint memory, soak, kill -9, determinism.

        Prints one row per check (tried / failed / target / figure); exits 1 if any row failed
        or missed its target.
        """
        from rich.console import Console

        from kvflow_agents.bench import reliability as rel
        from kvflow_agents.bench.server import ServerStartError
        from kvflow_agents.cli.bench_options import _progress, command_line, escape

        plan = rel.Plan.quick() if quick else rel.Plan()
        if fuzz_cases:
            plan.fuzz_cases = fuzz_cases
        if soak_s:
            plan.soak_s = soak_s
        console = Console(stderr=json_out == "-")
        try:
            with _progress(progress and json_out != "-", console) as hook:
                suite = rel.Suite(plan, seed=seed, progress=hook,
                                  log=lambda s: console.print(f"[dim]{escape(s)}[/]"))
                rows = suite.run()
        except ServerStartError as e:
            console.print(f"[red]error: a server did not start[/]\n{escape(str(e))}")
            raise typer.Exit(3) from None
        meta = {"command": command_line("reliability"), "quick": quick,
                "seed": seed, "plan": plan.__dict__}
        doc = rel.to_json(rows, meta, suite.series)
        if json_out == "-":
            sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        else:
            console.print(rel.table(rows, "kvflow bench reliability" + (" --quick" if quick else "")))
            if json_out:
                with open(json_out, "w") as f:
                    json.dump(doc, f, indent=1)
        if plot_out:
            rel.plot(suite.series, plot_out)
        if markdown_out:
            with open(markdown_out, "w") as f:
                f.write(rel.markdown(rows) + "\n")
        if not doc["all_ok"]:
            raise typer.Exit(1)
