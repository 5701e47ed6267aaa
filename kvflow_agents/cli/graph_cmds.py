"""``kvflow graph …`` and ``kvflow bench graph``: the Agent Step Graph on its own."""

from __future__ import annotations

import json
import math

import typer


def _fmt(v: float) -> str:
    return "∞" if math.isinf(v) else str(int(v))


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    graph_app = typer.Typer(help="Agent Step Graphs: show a workflow's STE step by step, export it.",
                            no_args_is_help=True)
    app.add_typer(graph_app, name="graph")

    @graph_app.command("demo")
    def demo(
        executors: int = typer.Option(3, min=1, max=16, help="Parallel executors in PEER."),
        jump: str = typer.Option("expressing", help="Where a failed review goes: expressing|planning."),
        rounds: int = typer.Option(2, min=1, max=10, help="Review rounds to simulate."),
        fmt: str = typer.Option("table", "--format", help="table|mermaid|dot|json"),
    ) -> None:
        """Run the PEER workflow's transitions and print every agent's STE at each step."""
        from rich.console import Console
        from rich.table import Table

        from kvflow_agents.graph.examples import peer_graph

        if jump not in ("expressing", "planning"):
            raise typer.BadParameter(f"--jump must be 'expressing' or 'planning', got {jump!r}")
        g = peer_graph(executors, jump=jump)
        if fmt != "table":
            out = {"mermaid": g.to_mermaid, "dot": g.to_dot, "json": g.to_json}.get(fmt)
            if out is None:
                raise typer.BadParameter(f"--format must be table, mermaid, dot or json; got {fmt!r}")
            typer.echo(out())
            return
        tr = g.tracker("demo")
        agents = g.agents
        table = Table(title=f"PEER ({executors} executors, failed review → {jump}): STE per transition")
        table.add_column("step", justify="right")
        table.add_column("event")
        for a in agents:
            table.add_column(a.replace("executor_", "exec"), justify="right")
        table.add_column("next")

        def row(event: str) -> None:
            ste = tr.ste()
            table.add_row(str(tr.step), event, *[_fmt(ste[a]) for a in agents], ",".join(tr.next_agents()))

        row("(before start)")
        execs = [a for a in agents if a.startswith("executor_")]
        back = "expresser" if jump == "expressing" else "planner"
        for r in range(rounds):
            if r == 0 or back == "planner":
                tr.start("planner"); row("planner runs")
                tr.finish("planner")
                for e in execs:
                    tr.start(e)
                row("executors run")
                for e in execs[:-1]:
                    tr.finish(e)
                    row(f"{e} done")
                tr.finish(execs[-1])
            tr.start("expresser"); row("expresser runs"); tr.finish("expresser")
            tr.start("reviewer"); row("reviewer runs"); tr.finish("reviewer")
        tr.end(); row("run ends")
        Console(width=max(Console().width, 150)).print(table)

    @bench_app.command("graph")
    def bench_graph(
        sizes: str = typer.Option("10,100,1000", help="Comma-separated agent counts."),
        transitions: int = typer.Option(2000, min=10, help="Transitions timed per size."),
        seed: int = typer.Option(0),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Microseconds per transition (start/finish + full STE map) on random cyclic graphs
        with joins. Target: < 200 µs at 100 agents, growth no worse than O(V+E)."""
        import random
        import time

        from rich.console import Console
        from rich.progress import track
        from rich.table import Table

        from kvflow_agents.graph.examples import random_graph

        try:
            ns = [int(x) for x in sizes.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--sizes must be comma-separated integers, got {sizes!r}")
        if not ns or any(n < 3 for n in ns):
            raise typer.BadParameter("--sizes: each graph needs at least 3 agents")
        results = []
        for n in track(ns, description="timing transitions"):
            g = random_graph(n, seed=seed)
            edges = g.nx_graph.number_of_edges()
            tr = g.tracker("bench")
            rng = random.Random(seed)
            agents = g.agents
            tr.ste()  # compile once, outside the timing
            t0 = time.perf_counter()
            for _ in range(transitions):
                running = tr.running
                if running and rng.random() < 0.5:
                    tr.finish(rng.choice(sorted(running)))
                else:
                    tr.start(rng.choice(agents))
                tr.ste()
            dt = (time.perf_counter() - t0) / transitions
            results.append({"agents": n, "edges": edges, "us_per_transition": dt * 1e6,
                            "ns_per_vertex_plus_edge": dt * 1e9 / (n + edges)})
        if as_json:
            typer.echo(json.dumps(results, indent=2))
            return
        t = Table(title="Agent Step Graph: one transition + full STE map")
        for c in ("agents", "edges", "µs / transition", "ns per (V+E)"):
            t.add_column(c, justify="right")
        for r in results:
            t.add_row(str(r["agents"]), str(r["edges"]), f"{r['us_per_transition']:.1f}",
                      f"{r['ns_per_vertex_plus_edge']:.0f}")
        Console().print(t)
        at100 = next((r for r in results if r["agents"] == 100), None)
        if at100:
            ok = at100["us_per_transition"] < 200
            Console().print(f"100 agents: {at100['us_per_transition']:.1f} µs per transition "
                            f"(target < 200 µs: {'met' if ok else 'MISSED'})")
