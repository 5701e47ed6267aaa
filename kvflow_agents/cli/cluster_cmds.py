"""``kvflow cluster up`` (N workers behind SGLang's gateway) and ``kvflow bench cluster``."""

from __future__ import annotations

from typing import Optional

import typer

cluster_app = typer.Typer(help="Several kvflow workers behind SGLang's gateway (smg).", no_args_is_help=True)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")

    @cluster_app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def up(
        ctx: typer.Context,
        workers: int = typer.Option(2, min=1, help="Number of workers."),
        engine: str = typer.Option("embedded", help="embedded (kvflow serve) or sglang (SGLang + kvflow plugin, GPU)."),
        model: str = typer.Option("smollm2-135m", help="Model preset for embedded workers."),
        model_path: Optional[str] = typer.Option(None, help="Model dir/file (required for --engine sglang)."),
        host: str = typer.Option("127.0.0.1", help="Bind address of the gateway and the workers."),
        port: int = typer.Option(30000, help="Gateway port (workers get free ports)."),
        policy: str = typer.Option("manual", help="Gateway routing policy: manual (sticky on the workflow id, "
                                   "default), consistent_hashing, cache_aware, round_robin, ..."),
        assignment_mode: str = typer.Option("min_group", help="manual policy: how a new workflow picks its "
                                            "worker (min_group = fewest workflows)."),
        gateway: str = typer.Option("smg", help="smg (1.13, default) or sglang-router (0.3.2)."),
        health_interval: int = typer.Option(1, min=1, help="Seconds between the gateway's health probes."),
        health_failures: int = typer.Option(2, min=1, help="Failed probes before a worker leaves the rotation."),
    ) -> None:
        """Start WORKERS workers and SGLang's gateway in front of them; print the URL; Ctrl-C stops all.

        Extra options go to every worker (`kvflow serve ...`, e.g. --policy kvflow --device-tokens 8192).
        The gateway routes on x-smg-routing-key (kvflow clients send the workflow id), so each
        workflow stays on one worker and its agents' cached prefixes are hit; see
        kvflow_agents/cluster.py for why these policy and health-check settings.
        """
        import signal
        import time

        from kvflow_agents.cluster import Cluster, GatewayConfig, GatewayError, gateway_available
        from kvflow_agents.bench.server import ServerStartError

        if engine not in ("embedded", "sglang"):
            raise typer.BadParameter("embedded or sglang", param_hint="--engine")
        if engine == "sglang" and not model_path:
            raise typer.BadParameter("the sglang engine needs --model-path", param_hint="--model-path")
        if not gateway_available(gateway):
            typer.echo(f"error: the {gateway} gateway is not installed: pip install 'kvflow-agents[cluster]'", err=True)
            raise typer.Exit(2)
        args = ["--engine", engine] + (["--model-path", model_path] if model_path else ["--model", model])
        args += list(ctx.args)
        try:
            cfg = GatewayConfig(gateway=gateway, policy=policy, assignment_mode=assignment_mode,
                                health_interval_s=health_interval, health_failure_threshold=health_failures)
            cfg.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--policy / --gateway") from None
        cluster = Cluster(workers, args, cfg, host=host, port=port,
                          worker_timeout_s=900.0 if engine == "sglang" else 300.0)
        typer.echo(f"kvflow cluster: starting {workers} {engine} workers and the {gateway} gateway ({policy}) ...")
        try:
            cluster.start()
        except (ServerStartError, GatewayError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
        typer.echo(f"  OpenAI base URL: {cluster.base_url}")
        for i, u in enumerate(cluster.worker_urls):
            typer.echo(f"  worker {cluster.instance_id(i)}: {u}   (cache: {u}/kvflow/v1/cache)")
        typer.echo(f"  gateway: {cluster.url}/workers, {cluster.url}/engine_metrics   Ctrl-C stops all.")
        stop = {"now": False}

        def on_signal(*_a) -> None:
            stop["now"] = True
        signal.signal(signal.SIGTERM, on_signal)
        try:
            while not stop["now"]:
                time.sleep(0.5)
                dead = [i for i, s in enumerate(cluster.servers) if s.proc is None or s.proc.poll() is not None]
                if dead:
                    typer.echo(f"worker(s) {', '.join(cluster.instance_id(i) for i in dead)} exited", err=True)
                    break
        except KeyboardInterrupt:
            pass
        finally:
            typer.echo("kvflow cluster: stopping")
            cluster.stop()

    @bench_app.command("cluster")
    def bench_cluster(
        workers: int = typer.Option(3, min=2, help="Workers behind the gateway."),
        workflows: int = typer.Option(24, min=1, help="Concurrent workflows."),
        agents: int = typer.Option(10, min=1, help="Agents per workflow (a cycle)."),
        fixed: int = typer.Option(256, min=1, help="Fixed-prompt tokens per agent."),
        dynamic: int = typer.Option(32, min=1, help="Dynamic tokens per call."),
        output: int = typer.Option(8, min=1, help="Output tokens per call."),
        rounds: int = typer.Option(2, min=1, help="Measured rounds per workflow."),
        warmup_rounds: int = typer.Option(1, min=0, help="Warm-up rounds (not measured)."),
        model: str = typer.Option("tiny-random", help="Worker model preset."),
        serve_policy: str = typer.Option("kvflow", help="Cache policy of every worker."),
        device_tokens: int = typer.Option(16384, help="Device KV pool per worker (the single instance too)."),
        host_tokens: int = typer.Option(65536, help="Host KV pool per worker."),
        policies: str = typer.Option(",".join(("cache_aware", "round_robin", "manual", "consistent_hashing")),
                                     help="Gateway policies to compare, comma-separated."),
        fault: bool = typer.Option(True, help="Run the kill-and-restart fault run."),
        fault_policy: str = typer.Option("manual", help="Gateway policy of the fault run."),
        fault_rounds: int = typer.Option(6, min=2, help="Measured rounds of the fault run."),
        kill_at: float = typer.Option(0.3, help="Kill after this fraction of the fault run's measured calls."),
        down_s: float = typer.Option(5.0, min=0.0, help="Seconds the killed worker stays down."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the report here."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG here."),
    ) -> None:
        """One instance vs N workers behind SGLang's gateway: affinity, hit rate, load balance,
        throughput per routing policy, and a kill-and-restart fault run. Side by side in one run."""
        from kvflow_agents.bench.cluster import ClusterBenchConfig, plot, render, run, write_json
        from kvflow_agents.bench.workload import WorkloadSpec
        from kvflow_agents.cluster import gateway_available

        if not gateway_available("smg"):
            typer.echo("error: the smg gateway is not installed: pip install 'kvflow-agents[cluster]'", err=True)
            raise typer.Exit(2)
        spec = WorkloadSpec(agents=agents, fixed=fixed, dynamic=dynamic, output=output, rounds=rounds,
                            warmup_rounds=warmup_rounds, workflows=workflows)
        cfg = ClusterBenchConfig(spec=spec, workers=workers, model=model, serve_policy=serve_policy,
                                 device_tokens=device_tokens, host_tokens=host_tokens,
                                 policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
                                 fault=fault, fault_policy=fault_policy, fault_rounds=fault_rounds,
                                 kill_at=kill_at, down_s=down_s)
        try:
            cfg.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        from rich.console import Console
        con = Console(stderr=True)
        report = run(cfg, progress=lambda m: con.log(m))
        render(report)
        if json_out:
            write_json(report, json_out)
        if plot_out:
            plot(report, plot_out)
