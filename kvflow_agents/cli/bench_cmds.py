"""``kvflow bench workflow`` and ``kvflow bench show``: cache policies measured side by side on
the paper's synthetic workflow, and a stored result reported again. What the server-based bench
commands share lives in :mod:`.bench_options`.

Each policy gets its own ``kvflow serve`` (same model, pools, page size, emulated link; only
``--policy`` differs), started one after the other; see :mod:`kvflow_agents.bench.runner`.
"""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from .bench_options import (
    _DEFAULT_POLICIES,
    _HINTS_HELP,
    _OTHER_PYTHON_HELP,
    _SERVER_FLAG_HELP,
    _SERVER_THREADS_HELP,
    _VARIANT_HELP,
    _emit,
    _hint_mode,
    _other_checkout,
    _policies,
    _policy_variants,
    _run_and_report,
    _server_flags,
    _server_threads,
    _size_servers,
    command_line,
    emit_document,
    escape,
)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("show")
    def show(
        result: str = typer.Argument(..., help="A `kvflow bench workflow|peer --json` file."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the re-derived numbers here "
                                               "('-': stdout)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Draw it (matplotlib PNG)."),
        wide: bool = typer.Option(False, "--wide/--no-wide", help="Every row, not only the 80-column ones."),
    ):
        """Report a saved `kvflow bench workflow` or `peer` result again: the table, the ratios
        (with the achievable saving's confidence interval), the targets and the plot, derived
        from its per-policy numbers by this version's report."""
        from pathlib import Path

        from rich.console import Console

        from kvflow_agents.bench import report

        try:
            doc = json.loads(Path(result).read_text())
            meta, results, targets = report.from_json(doc)
        except (OSError, ValueError, TypeError) as e:
            raise typer.BadParameter(str(e), param_hint="RESULT") from None
        title = f"{meta.get('command') or 'kvflow bench ' + str(meta.get('bench', ''))} ({Path(result).name})"
        if isinstance(doc.get("experiment"), str):  # a run made under a script, as it says
            Console().print(f"[yellow]{doc['experiment']}[/]", highlight=False)
        _emit(Console(), meta, results, title=title, targets=targets, raw=True, json_path=json_out,
              plot_path=plot_out, wide=wide)

    @bench_app.command("timeline")
    def timeline(
        result: str = typer.Argument(..., help="A `kvflow bench workflow --raw --json` file."),
        policy: Optional[List[str]] = typer.Option(
            None, "--policy", help="Also list this column's steps one by one (repeatable)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the rows here "
                                               "('-': stdout)."),
    ):
        """How the concurrent workflows' calls of each step lined up in a stored run: per
        policy, how far apart each step's calls arrived and which of them waited for a load
        (the run must keep its per-call records: `kvflow bench workflow --raw`)."""
        from pathlib import Path

        from rich.console import Console, Group

        from kvflow_agents.bench import timeline as tl

        try:
            per_policy = tl.from_result(json.loads(Path(result).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise typer.BadParameter(str(e), param_hint="RESULT") from None
        unknown = [p for p in policy or () if p not in per_policy]
        if unknown:
            raise typer.BadParameter(f"no column {unknown[0]!r} with per-call records; "
                                     f"choose from {sorted(per_policy)}", param_hint="--policy")
        shown = Group(tl.summary_table(per_policy),
                      *(tl.step_table(p, per_policy[p]) for p in policy or ()))
        emit_document(Console(), tl.to_json(per_policy), shown, json_out=json_out)

    @bench_app.command("pool")
    def pool_runs(
        results: List[str] = typer.Argument(..., help="`kvflow bench workflow|peer --json` files "
                                            "of one workload (the same command, run again)."),
        policy: str = typer.Option("kvflow", help="The column whose share is pooled."),
        reference: str = typer.Option("oracle", help="The bound it is measured against."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the figures here "
                                               "('-': stdout)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Draw them (matplotlib PNG)."),
    ):
        """Pool stored runs of one workload into one sample: per run and over all their trials,
        the policy's latency over the reference's and its share of the reference's saving over
        lru / hicache on the trials' sums, with 90 % intervals that resample trials within each
        run."""
        from rich.console import Console, Group
        from rich.text import Text

        from kvflow_agents.bench import pool

        try:
            out = pool.pool([pool.load_run(p) for p in results], policy=policy, reference=reference)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="RESULTS") from None
        out["command"] = command_line("pool")
        shown = Group(pool.render_table(out), *(Text(line) for line in pool.verdict_lines(out)))
        emit_document(Console(), out, shown, json_out=json_out,
                      plot=(lambda: pool.plot(out, plot_out)) if plot_out else None)

    @bench_app.command("workflow")
    def workflow(
        preset: Optional[str] = typer.Option(
            None, help="paper: the paper's regime on this machine: 10-agent cycle, 32 dynamic / 32 "
                       "output tokens, and the fixed prompt as long as it takes for recomputing it to "
                       "weigh against a call as for Llama-3.1-8B on an A10G at 8,192 fixed tokens "
                       "(calibrated on a served oracle; overrides --fixed/--dynamic/--output/--agents); "
                       "link at load = 1/3 of that recompute."),
        agents: int = typer.Option(10, min=1, help="Agents in the workflow."),
        variant: str = typer.Option("cycle", help="cycle (agent_0 -> ... -> agent_N-1 -> agent_0) or "
                                                  "fanout (head -> N-2 parallel workers -AND-> tail -> head)."),
        fixed: int = typer.Option(1024, min=1, help="Fixed prompt tokens per agent (its system message)."),
        dynamic: int = typer.Option(32, min=1, help="Dynamic tokens per call (the user message)."),
        output: int = typer.Option(16, min=1, help="Output tokens per call (max_tokens + ignore_eos)."),
        rounds: int = typer.Option(3, min=1, help="Measured rounds per workflow and trial."),
        warmup_rounds: int = typer.Option(1, min=0, help="Unmeasured warm-up rounds first (as the paper)."),
        trials: int = typer.Option(2, min=1, help="Repetitions per policy; the policies' servers run side "
                                                  "by side and trials interleave them (noise robustness)."),
        stream: bool = typer.Option(True, help="Stream responses (client-side TTFT); --no-stream uses "
                                               "the server-reported TTFT."),
        fresh_servers: bool = typer.Option(False, help="Start every policy's server again for each trial "
                                                       "(~2 s per server and trial): what one process "
                                                       "drew is drawn again each trial."),
        interleave: str = typer.Option("trial", help="What one policy runs before the next: 'trial' "
                                                     "(its warm-up and every measured round) or "
                                                     "'round' (every policy's warm-up at once, then round 1 "
                                                     "of each, round 2 of each, ...; each round a "
                                                     "barrier across the workflows)."),
        workflows: int = typer.Option(1, min=1, help="Concurrent workflow instances."),
        share_prompts: bool = typer.Option(False, help="All workflows share the same fixed prompts (one app)."),
        policies: str = typer.Option(_DEFAULT_POLICIES, help="Comma-separated: lru,hicache,kvflow,oracle."),
        model: str = typer.Option("tiny-random", help="Model preset for the embedded servers."),
        device_tokens: Optional[int] = typer.Option(
            None, help="Device KV pool (tokens). Default: --device-fraction of all fixed prompts."),
        device_fraction: float = typer.Option(0.4, help="Default device pool as a fraction of the fixed prompts."),
        host_tokens: Optional[int] = typer.Option(None, help="Host KV pool (tokens). Default: 2x the working set."),
        page_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
        host_link_gbps: Optional[float] = typer.Option(
            None, help="Emulated host link (GB/s) for every server. Default: calibrated so that "
                       "loading a fixed prompt costs --load-fraction of recomputing it."),
        load_fraction: float = typer.Option(1 / 3, show_default="1/3",
                                            help="Calibration target: load time / recompute time."),
        lookahead: int = typer.Option(1, min=0, help="Server prefetch lookahead (STE)."),
        max_batch: int = typer.Option(16, min=1, help="Server max batch."),
        server_threads: Optional[int] = typer.Option(None, min=0, help=_SERVER_THREADS_HELP),
        server_flag: Optional[List[str]] = typer.Option(None, help=_SERVER_FLAG_HELP),
        policy_variant: Optional[List[str]] = typer.Option(None, help=_VARIANT_HELP),
        other_python: Optional[str] = typer.Option(None, help=_OTHER_PYTHON_HELP),
        base_url: Optional[str] = typer.Option(None, help="Measure this running server (…/v1) instead."),
        served_model: Optional[str] = typer.Option(None, help="Model name sent with --base-url."),
        api_key: Optional[str] = typer.Option(None, envvar="KVFLOW_API_KEY", help="API key for the server(s)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        raw: bool = typer.Option(False, help="Include every request's record in the JSON."),
        seed: int = typer.Option(0, help="Seed of the generated prompts."),
        hints: str = typer.Option("on", help=_HINTS_HELP),
        hint_lag: int = typer.Option(2, min=1, help="--hints stale: STE map from this many requests earlier."),
        wide: bool = typer.Option(False, help="Every table row (the default table fits 80 columns)."),
        progress: bool = typer.Option(True, help="Progress bars."),
        engine: str = typer.Option("embedded", help="embedded (kvflow serve) or sglang (stock SGLang "
                                   "0.5.23: lru = radix cache, hicache = + host tier, kvflow = + the "
                                   "plugin, oracle = a device pool that holds everything)."),
        model_path: Optional[str] = typer.Option(None, help="sglang engine: a HF model folder "
                                                 "(default: --model's preset written as one)."),
        sglang_python: Optional[str] = typer.Option(
            None, envvar="KVFLOW_SGLANG_PYTHON", help="sglang engine: the SGLang environment's python "
            "(default: .venv-sglang/bin/python of this checkout)."),
        sglang_device: str = typer.Option("cpu", help="sglang engine: cpu (under the test shims of "
                                          "tests/sglang/support) or cuda."),
    ) -> None:
        """The paper's synthetic workflow (fixed/dynamic/output tokens), one server per policy."""
        from rich.console import Console

        from kvflow_agents.bench import report
        from kvflow_agents.bench.runner import INTERLEAVE, run_workflow_bench
        from kvflow_agents.bench.workload import VARIANTS, WorkloadSpec, fixed_prompt_tokens, token_counter

        if variant not in VARIANTS:
            raise typer.BadParameter(f"choose one of {', '.join(VARIANTS)}", param_hint="--variant")
        if variant == "fanout" and agents < 3:
            raise typer.BadParameter("the fanout variant needs at least 3 agents", param_hint="--agents")
        if not 0 < device_fraction <= 10:
            raise typer.BadParameter("must be in (0, 10]", param_hint="--device-fraction")
        if host_link_gbps is not None and host_link_gbps <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--host-link-gbps")
        if not 0 < load_fraction <= 10:
            raise typer.BadParameter("must be in (0, 10]", param_hint="--load-fraction")
        if engine not in ("embedded", "sglang"):
            raise typer.BadParameter("choose embedded or sglang", param_hint="--engine")
        if engine == "sglang" and preset is not None:
            raise typer.BadParameter("--preset paper calibrates embedded servers; not with --engine sglang",
                                     param_hint="--preset")
        _hint_mode(hints)
        pols = _policies(policies)
        threads = _server_threads(server_threads)
        extra_args = _server_flags(server_flag)
        pols, variants = _policy_variants(policy_variant, pols)
        pols, variants, commands = _other_checkout(other_python, pols, variants)
        console = Console(stderr=json_out == "-")
        regime = None
        if preset is not None:
            if preset != "paper":
                raise typer.BadParameter("the only preset is 'paper'", param_hint="--preset")
            if base_url:
                raise typer.BadParameter("--preset paper calibrates embedded servers; not with --base-url",
                                         param_hint="--preset")
            from kvflow_agents.bench.calibrate import (PAPER_REGIME, choose_fixed_for_ratio,
                                                       paper_recompute_ratio)
            from kvflow_agents.bench.workload import token_counter as _tc

            target = paper_recompute_ratio()
            console.print(f"paper regime: on {target['profile']} recomputing {target['fixed']} fixed tokens "
                          f"takes {target['recompute_s']:.2f} s, a call with them cached "
                          f"{target['call_s']:.2f} s: ratio {target['ratio']:.2f}; finding the fixed "
                          f"length with that ratio on {model} …")
            agents, variant = 10, "cycle"
            dynamic, output = PAPER_REGIME["dynamic"], PAPER_REGIME["output"]
            regime = choose_fixed_for_ratio(model, _tc(model), target_ratio=target["ratio"], dynamic=dynamic,
                                            output=output, page_size=page_size,
                                            log=lambda t: console.print(f"[dim]{escape(t)}[/]"),
                                            torch_threads=threads)
            console.print(regime.describe())
            fixed = regime.fixed
        spec = WorkloadSpec(agents=agents, variant=variant, fixed=fixed, dynamic=dynamic, output=output,
                            rounds=rounds, warmup_rounds=warmup_rounds, workflows=workflows, seed=seed,
                            share_prompts=share_prompts, hints=hints, hint_lag=hint_lag)
        spec.validate()
        if engine == "sglang" and not base_url:
            from kvflow_agents.bench.sglang_engine import SGLangBenchError, bench_counter

            try:
                counter = bench_counter(model, model_path)
            except SGLangBenchError as e:
                raise typer.BadParameter(str(e), param_hint="--model/--model-path") from None
        else:
            counter = token_counter(model if not base_url else (served_model or model))
        fixed_total = fixed_prompt_tokens(spec, counter)
        meta: dict = {"bench": "workflow", "workload": spec.as_dict(), "policies_run": pols,
                      "tokenizer": counter.name, "fixed_prompt_tokens_total": fixed_total}
        if regime is not None:
            meta["preset"] = {"name": "paper", "target": target, "calibration": regime.as_dict()}
        server = None
        for given, hint in ((extra_args, "--server-flag"), (commands, "--other-python"),
                            (variants, "--policy-variant")):
            if given and (base_url or engine == "sglang"):
                raise typer.BadParameter("passes options to the embedded servers this command starts; "
                                         "not with --base-url or --engine sglang", param_hint=hint)
        if fresh_servers and base_url:
            raise typer.BadParameter("restarts the servers this command starts; not with --base-url",
                                     param_hint="--fresh-servers")
        if interleave not in INTERLEAVE:
            raise typer.BadParameter(f"one of {', '.join(INTERLEAVE)}, not {interleave!r}",
                                     param_hint="--interleave")
        if interleave != "trial" and base_url:
            raise typer.BadParameter("interleaves the servers this command starts; not with "
                                     "--base-url (one column)", param_hint="--interleave")
        meta["interleave"] = interleave
        if base_url:
            console.print(f"measuring the running server at {base_url} (one column, 'external')")
        elif engine == "sglang":
            from kvflow_agents.bench import sglang_engine

            try:
                server = sglang_engine.workflow_server(
                    spec, pols, counter=counter, model=model, model_path=model_path,
                    python=sglang_python, device=sglang_device, device_tokens=device_tokens,
                    device_fraction=device_fraction, host_tokens=host_tokens, page_size=page_size,
                    host_link_gbps=host_link_gbps, load_fraction=load_fraction, lookahead=lookahead,
                    fixed_total=fixed_total, meta=meta, log=lambda m: console.print(escape(m)))
            except sglang_engine.SGLangBenchError as e:
                console.print(f"[red]error:[/] {escape(str(e))}")
                raise typer.Exit(2) from None
        else:
            server = _size_servers(spec, counter, model=model, pols=pols, device_tokens=device_tokens,
                                   device_fraction=device_fraction, host_tokens=host_tokens,
                                   page_size=page_size, host_link_gbps=host_link_gbps,
                                   load_fraction=load_fraction, lookahead=lookahead, max_batch=max_batch,
                                   console=console, meta=meta, regime=regime,
                                   torch_threads=threads, extra_args=extra_args, variants=variants,
                                   commands=commands)
        meta["command"] = command_line("workflow")
        title = (f"kvflow bench workflow: {variant} of {agents} agents, {fixed}/{dynamic}/{output} tokens, "
                 f"{workflows} workflow(s) x {rounds} round(s) x {trials} trial(s), {model}"
                 + (" on stock SGLang 0.5.23" if engine == "sglang" else "")
                 + ("" if hints == "on" else f", hints: {hints}")
                 + (", rounds interleaved" if interleave == "round" else ""))
        _run_and_report(
            lambda hook, log: run_workflow_bench(spec, pols, server, counter=counter, base_url=base_url,
                                                 model=served_model or model, api_key=api_key,
                                                 trials=trials, stream=stream, progress=hook,
                                                 keep_raw=raw, fresh_servers=fresh_servers,
                                                 interleave=interleave, log=log),
            console, meta, title=title,
            targets=() if base_url else report.PAPER_TARGETS if regime is not None else report.WORKFLOW_TARGETS,
            progress=progress, raw=raw, json_out=json_out, plot_out=plot_out, wide=wide)
