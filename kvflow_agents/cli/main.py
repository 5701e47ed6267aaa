"""``kvflow`` — the command line.

Each feature area owns one module in this package with a ``register(app, bench_app)`` function
that adds its commands. Modules import their heavy dependencies (torch, langgraph, …) inside the
command bodies, so ``kvflow --help`` stays fast and works on a core install.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvflow",
    help="kvflow-agents: workflow-aware KV-cache management for multi-agent LLM apps (KVFlow).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(
    help="Benchmarks. Each prints ratios measured side by side in one run.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

# Commands that only re-read stored runs: their JSON keeps the run's own code record.
_REREADING_BENCH_COMMANDS = frozenset({"show", "pool"})


@bench_app.callback()
def _bench_started(ctx: typer.Context) -> None:
    """Record the checkout now: a result's ``code`` (``bench/provenance.py``) names the code the
    run imported, not a commit made while it ran (the JSON is written at its end)."""
    if ctx.invoked_subcommand not in _REREADING_BENCH_COMMANDS:
        from kvflow_agents.bench.provenance import code_version

        code_version()

# One line per feature module; keep the list sorted by area.
_COMMAND_MODULES = [
    "kvflow_agents.cli.agent_cmds",
    "kvflow_agents.cli.graph_cmds",
    "kvflow_agents.cli.instrument_cmds",
    "kvflow_agents.cli.predict_cmds",
    "kvflow_agents.cli.serve_cmds",
    "kvflow_agents.cli.policy_cmds",
    "kvflow_agents.cli.bench_cmds",
    "kvflow_agents.cli.bench_peer_cmds",
    "kvflow_agents.cli.bench_aiperf_cmds",
    "kvflow_agents.cli.bench_engine_cmds",
    "kvflow_agents.cli.bench_http_cmds",
    "kvflow_agents.cli.reliability_cmds",
    "kvflow_agents.cli.cluster_cmds",
    "kvflow_agents.cli.sim_cmds",
]


def _register() -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app, bench_app)


_register()


def main() -> None:  # console-script entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
