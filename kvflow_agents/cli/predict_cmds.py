"""``kvflow bench predict``: how well STE predicts the next agent, before and after learning.

Traces come from a file (``--traces``), a synthetic Selector-like workflow (``--app selector``,
the default) or a real ``langgraph-supervisor`` app run in process with scripted LLMs whose
routing has a seeded structure (``--app supervisor``, :mod:`kvflow_agents.bench.predict_apps`):
its runs are recorded by the LangGraph adapter's own tracker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("predict")
    def bench_predict(
        traces: Optional[Path] = typer.Option(
            None, "--traces", exists=True, dir_okay=False,
            help="JSONL traces to replay (graph + run lines, see kvflow_agents.graph.learned). "
                 "Default: seeded runs of a synthetic Selector-like workflow."),
        app_kind: str = typer.Option("selector", "--app",
                                     help="Without --traces: selector (synthetic Selector-like runs) or "
                                          "supervisor (a real langgraph-supervisor app, scripted LLMs)."),
        agents: int = typer.Option(5, min=2, max=64, help="Synthetic: agents the router chooses among."),
        runs: int = typer.Option(400, min=2, help="Synthetic: number of runs."),
        skew: float = typer.Option(0.7, min=0.0, max=1.0,
                                   help="Synthetic: probability the router picks each agent's favourite successor."),
        seed: int = typer.Option(0, help="Synthetic: random seed."),
        train_fraction: float = typer.Option(0.5, min=0.0, max=0.95,
                                             help="Leading fraction of the runs used to learn; the rest is scored."),
        prior: float = typer.Option(1.0, min=1e-6, help="Dirichlet prior of the transition model."),
        write_traces: Optional[Path] = typer.Option(None, "--write-traces", dir_okay=False,
                                                    help="Also write the replayed traces as JSONL."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Replay recorded runs: at each step where the next agent is chosen at run time, does the
        agent that really ran next have the lowest STE? (Ties split the credit.) Compares the
        exact best-case STE, the learned STE before learning (prior only), after learning on the
        first part of the runs, and learning online over every run."""
        from rich.console import Console
        from rich.table import Table

        from kvflow_agents.graph.errors import GraphError
        from kvflow_agents.graph.learned import TransitionModel, read_traces
        from kvflow_agents.graph.prediction import evaluate_predictions, synthetic_selector_traces, train
        from kvflow_agents.graph.learned import write_traces as _write

        if app_kind not in ("selector", "supervisor"):
            raise typer.BadParameter("must be selector or supervisor", param_hint="--app")
        try:
            if traces is not None:
                graphs, all_runs = read_traces(traces)
                source = str(traces)
            elif app_kind == "supervisor":
                try:
                    from kvflow_agents.bench.predict_apps import supervisor_traces
                except ImportError as e:
                    raise typer.BadParameter(f"needs the [langgraph] extra ({e})", param_hint="--app") from None
                from rich.progress import Progress

                with Progress(transient=True) as prog:
                    task = prog.add_task("running the supervisor app", total=runs)
                    graphs, all_runs = supervisor_traces(runs, seed=seed, skew=skew,
                                                         progress=lambda n: prog.advance(task, n))
                source = (f"langgraph-supervisor app (3 ReAct workers, scripted LLMs): {runs} runs, "
                          f"routing skew {skew}, seed {seed}")
            else:
                graphs, all_runs = synthetic_selector_traces(agents, runs, seed=seed, skew=skew)
                source = f"synthetic selector: {agents} agents, {runs} runs, skew {skew}, seed {seed}"
        except GraphError as e:
            raise typer.BadParameter(str(e))
        if not all_runs:
            raise typer.BadParameter("no runs to replay")
        if write_traces is not None:
            _write(write_traces, graphs, all_runs)
        cut = int(len(all_runs) * train_fraction)
        train_runs, test_runs = all_runs[:cut], all_runs[cut:]
        try:
            before = evaluate_predictions(graphs, test_runs, TransitionModel(prior), learn=False)
            model = TransitionModel(prior)
            train(model, graphs, train_runs)
            after = evaluate_predictions(graphs, test_runs, model, learn=False)
            online = evaluate_predictions(graphs, all_runs, TransitionModel(prior), learn=True)
        except GraphError as e:
            raise typer.BadParameter(str(e))
        rows = [
            ("exact STE (best case)", "held-out", before.decisions, before.exact_accuracy, before.exact_unique),
            ("learned STE, before learning", "held-out", before.decisions, before.learned_accuracy,
             before.learned_unique),
            (f"learned STE, after {len(train_runs)} runs", "held-out", after.decisions, after.learned_accuracy,
             after.learned_unique),
            ("learned STE, online", "all runs", online.decisions, online.learned_accuracy, online.learned_unique),
        ]
        if as_json:
            typer.echo(json.dumps({
                "source": source, "train_runs": len(train_runs), "test_runs": len(test_runs),
                "results": [{"predictor": p, "scored_on": s, "decisions": d, "accuracy": round(a, 4),
                             "unique_lowest_hits": u} for p, s, d, a, u in rows]}, indent=2))
            return
        t = Table(title="Next-agent prediction: is the true next agent the lowest STE?")
        for c in ("predictor", "scored on", "decisions", "accuracy (ties split)", "unique-lowest hits"):
            t.add_column(c, justify="left" if c in ("predictor", "scored on") else "right")
        for p, s, d, a, u in rows:
            t.add_row(p, s, str(d), f"{a:.1%}", f"{u / d:.1%}" if d else "-")
        con = Console(width=max(Console().width, 110))
        con.print(f"traces: {source}")
        con.print(t)
        if before.decisions and before.learned_accuracy > 0:
            con.print(f"after learning / before: x{after.learned_accuracy / before.learned_accuracy:.2f} "
                      f"(the value sent as kvflow_ste is the learned one)")
