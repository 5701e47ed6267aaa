"""``kvflow bench workflow``: cache policies measured side by side, and the helpers the other
server-based bench commands share (``bench peer``: :mod:`.bench_peer_cmds`; ``bench aiperf``:
:mod:`.bench_aiperf_cmds`; ``bench engine|layout``: :mod:`.bench_engine_cmds`).

Each policy gets its own ``kvflow serve`` (same model, pools, page size, emulated link; only
``--policy`` differs), started one after the other; see :mod:`kvflow_agents.bench.runner`.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import List, Optional

import typer

_DEFAULT_POLICIES = "lru,hicache,kvflow,oracle"


def _policies(text: str) -> list[str]:
    from kvflow_agents.bench.runner import parse_policies

    try:
        return parse_policies(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--policies") from None


def escape(text: str) -> str:
    """Escape rich markup (log lines start with "[policy]")."""
    from rich.markup import escape as _escape

    return _escape(text)


_HINTS_HELP = ("Hints sent: on (correct) | none | random | reversed | stale (wrong on purpose: "
               "what does the server do with bad hints?).")


def _hint_mode(mode: str) -> str:
    from kvflow_agents.bench.hint_modes import check_mode

    try:
        return check_mode(mode)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--hints") from None


def command_line(bench: str) -> str:
    """``kvflow bench <bench> <its arguments>`` for a result's JSON (the arguments only when this
    process is that command: under a test runner ``sys.argv`` is the runner's)."""
    args = sys.argv[3:] if sys.argv[1:3] == ["bench", bench] else []
    return " ".join(["kvflow", "bench", bench, *args])


def emit_document(console, doc: dict, table, *, json_out: Optional[str], plot=None) -> None:
    """A one-table bench's output: the JSON on stdout (``--json -``) or the table (and the JSON
    file, if asked), then ``plot()`` (``--plot``)."""
    if json_out == "-":
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        console.print(table)
        if json_out:
            from kvflow_agents.bench import report

            report.write_json(doc, json_out)
            console.print(f"[dim]JSON written to {json_out}[/]")
    if plot is not None:
        plot()


def _round_page(n: float, page: int) -> int:
    return int(-(-int(n) // page) * page)


@contextmanager
def _progress(enabled: bool, console):
    """Yields a hook ``(event, n)`` for the runner: one bar per policy."""
    if not enabled:
        yield None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as prog:
        tasks: dict = {}

        def hook(event: str, n: int) -> None:
            kind, _, label = event.partition(":")
            if kind == "start":
                tasks[label] = prog.add_task(f"{label:>8}", total=n)
            elif label in tasks:
                tid = tasks[label]
                prog.advance(tid, n)
                task = next(t for t in prog.tasks if t.id == tid)
                if task.total is not None and task.completed > task.total:
                    # the total is an estimate (PEER: retries add calls): never overfill
                    prog.update(tid, total=task.completed)
        yield hook


def _run_and_report(run, console, meta: dict, *, title: str, targets, progress: bool, raw: bool,
                    json_out: Optional[str], plot_out: Optional[str], wide: bool = False) -> None:
    """Run a bench (``run(progress_hook, log)`` -> results), then table / JSON / plot; exit 3
    when a server did not start, 1 when any request failed."""
    from kvflow_agents.bench.server import ServerStartError

    try:
        with _progress(progress and json_out != "-", console) as hook:
            results = run(hook, lambda s: console.print(f"[dim]{escape(s)}[/]"))
    except ServerStartError as e:
        console.print(f"[red]error: a server did not start[/]\n{escape(str(e))}")
        raise typer.Exit(3) from None
    _emit(console, meta, results, title=title, targets=targets, raw=raw, json_path=json_out,
          plot_path=plot_out, wide=wide)
    if any(r.workload.get("errors") for r in results):
        raise typer.Exit(1)


def _emit(console, meta: dict, results, *, title: str, targets, raw: bool, json_path: Optional[str],
          plot_path: Optional[str], wide: bool = False) -> None:
    """The table (or the JSON on stdout with ``--json -``), the JSON file and the plot, from one
    :class:`~kvflow_agents.bench.report.Figures` (its bootstrap runs once)."""
    from kvflow_agents.bench import report

    fig = report.Figures(results)
    doc = report.to_json(meta, results, targets, raw=raw, figures=fig)
    if json_path == "-":
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    else:
        report.print_report(console, results, title=title, targets=targets, wide=wide, figures=fig)
        if json_path:
            report.write_json(doc, json_path)
            console.print(f"[dim]JSON written to {json_path}[/]")
    if plot_path:
        from kvflow_agents.bench.report_plot import plot

        plot(results, plot_path, title=title)
        if json_path != "-":
            console.print(f"[dim]plot written to {plot_path}[/]")


_SERVER_THREADS_HELP = ("torch threads of each server (kvflow serve --torch-threads). Default: one "
                        "fewer than the CPU cores (the client runs here too); 0: torch's default, "
                        "every core.")


_VARIANT_HELP = ("LABEL=POLICY [--serve-option ...]: one more server, running POLICY with these "
                 "kvflow serve options, measured as its own column beside the others (repeatable; "
                 "e.g. 'kvflow-partial=kvflow --partial-eviction').")


_OTHER_PYTHON_HELP = ("Serve every column a second time with this Python (another checkout's "
                      "venv) as column other-LABEL, beside this checkout's in the same run "
                      "(trials interleaved): two versions of the code side by side.")


def _server_threads(requested: Optional[int]) -> Optional[int]:
    """``--server-threads``: None = one core fewer than the machine's, 0 = torch's default."""
    from kvflow_agents.bench.server import client_core_threads

    if requested is None:
        return client_core_threads()
    return requested or None


def _serve_options(words, hint: str) -> tuple:
    """``kvflow serve`` options as ``--name``, ``--name=value`` or ``--name value`` (a bare
    word only right after an option); anything else is refused under ``hint``."""
    words = tuple(words or ())
    bad = [w for i, w in enumerate(words) if not w.startswith("--")
           and (i == 0 or not words[i - 1].startswith("--"))]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r} is not a kvflow serve option (--name or --name=value)",
                                 param_hint=hint)
    return words


_SERVER_FLAG_HELP = ("Pass this flag to every embedded server (repeatable; e.g. "
                     "--server-flag=--partial-eviction): compare an engine setting run against "
                     "run; --server-flag=--deterministic makes greedy outputs, hence the work, "
                     "the same under every policy.")


def _server_flags(flags: Optional[List[str]]) -> tuple:
    """``--server-flag`` values: each one ``kvflow serve`` option (``--name`` or ``--name=value``)."""
    for f in flags or ():
        _serve_options([f], "--server-flag")
    return tuple(flags or ())


def _runs_policy(pols, variants: dict, names: tuple) -> bool:
    """Does any column (a policy, or a variant of one) run one of ``names``."""
    return any(variants.get(p, (p,))[0] in names for p in pols)


def _variants_json(variants: dict) -> dict:
    return {k: [p, list(f)] for k, (p, f) in variants.items()}


def _policy_variants(texts: Optional[List[str]], pols: list) -> tuple[list, dict]:
    """``--policy-variant LABEL=POLICY [--serve-option ...]`` values -> (the columns to run,
    ``{label: (policy, flags)}``). A variant's column follows its policy's when that runs."""
    import shlex

    from kvflow_agents.bench.runner import POLICIES

    variants: dict = {}
    for text in texts or ():
        label, sep, rest = text.partition("=")
        label = label.strip()
        try:
            words = shlex.split(rest)
        except ValueError as e:  # an unclosed quote
            raise typer.BadParameter(f"{text!r}: {e}", param_hint="--policy-variant") from None
        if not sep or not label or not words:
            raise typer.BadParameter(f"{text!r}: expected LABEL=POLICY [--serve-option ...]",
                                     param_hint="--policy-variant")
        if label in POLICIES or label in variants or not label.replace("-", "").replace("_", "").isalnum():
            raise typer.BadParameter(f"{label!r}: a variant needs a new name (letters, digits, - or _)",
                                     param_hint="--policy-variant")
        if words[0] not in POLICIES:
            raise typer.BadParameter(f"{words[0]!r} is not a policy ({', '.join(POLICIES)})",
                                     param_hint="--policy-variant")
        variants[label] = (words[0], _serve_options(words[1:], "--policy-variant"))
    cols = list(pols)
    for label, (policy, _) in variants.items():
        after = max((i for i, c in enumerate(cols) if c == policy or variants.get(c, ("",))[0] == policy),
                    default=len(cols) - 1)
        cols.insert(after + 1, label)
    return cols, variants


def _other_checkout(python: Optional[str], cols: list, variants: dict) -> tuple[list, dict, dict]:
    """``--other-python PY`` -> (columns, variants, commands): every column twice, the twin
    ``other-LABEL`` (same policy and options) served by ``PY -P -m kvflow_agents.cli.main serve``
    right after it. ``-P``: the working directory (maybe this checkout) does not shadow the
    other venv's package."""
    import os

    if not python:
        return cols, variants, {}
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise typer.BadParameter(f"{python!r} is not an executable Python", param_hint="--other-python")
    command = [python, "-P", "-m", "kvflow_agents.cli.main", "serve"]
    out, twins, commands = [], dict(variants), {}
    for c in cols:
        label = f"other-{c}"
        if label in variants:
            raise typer.BadParameter(f"a --policy-variant is already named {label!r}",
                                     param_hint="--other-python")
        twins[label] = variants.get(c, (c, ()))
        commands[label] = command
        out += [c, label]
    return out, twins, commands


def _size_servers(spec, counter, *, model: str, pols, device_tokens: Optional[int], device_fraction: float,
                  host_tokens: Optional[int], page_size: int, host_link_gbps: Optional[float],
                  load_fraction: float, lookahead: int, max_batch: int, console, meta: dict, regime=None,
                  fixed_total: Optional[int] = None, calib_fixed: Optional[int] = None,
                  torch_threads: Optional[int] = None, extra_args: tuple = (), variants=None,
                  commands=None):
    """The servers' pools and link for a synthetic workload (``meta`` gets them): device pool
    ``device_fraction`` of the fixed prompts (at least one request), host 2x the working set,
    link calibrated so a load costs ``load_fraction`` of a recompute."""
    from kvflow_agents.bench.runner import ServerConfig
    from kvflow_agents.bench.workload import fixed_prompt_tokens, request_tokens

    fixed_total = fixed_total or fixed_prompt_tokens(spec, counter)
    need = _round_page(request_tokens(spec), page_size) + page_size
    dev = device_tokens if device_tokens is not None else max(
        _round_page(device_fraction * fixed_total, page_size), need)
    if dev < need:
        raise typer.BadParameter(f"{dev} tokens cannot hold one request (~{need} tokens with "
                                 f"fixed+dynamic+output)", param_hint="--device-tokens")
    ws = fixed_total + spec.workflows * spec.calls_per_round * (spec.dynamic + spec.output + 32)
    host = host_tokens if host_tokens is not None else max(8192, _round_page(2 * ws, page_size))
    link = host_link_gbps
    variants = dict(variants or {})
    if link is None and _runs_policy(pols, variants, ("hicache", "kvflow")):
        from kvflow_agents.bench.calibrate import calibrate_link

        console.print(f"[dim]calibrating the emulated host link on {model} …[/]")
        cal = calibrate_link(model, calib_fixed or spec.fixed, counter=counter, dynamic=spec.dynamic,
                             page_size=page_size, load_fraction=load_fraction,
                             torch_threads=torch_threads)
        console.print(cal.describe())
        meta["calibration"] = cal.as_dict()
        link = cal.link_gbps
        if regime is not None:  # the served recompute (what the bench's calls pay), not in-process
            link = cal.prefix_tokens * cal.kv_bytes_per_token / (regime.recompute_fit_s * load_fraction) / 1e9
            meta["calibration"]["link_gbps_served"] = link
            console.print(f"paper regime: link from the served recompute "
                          f"({regime.recompute_fit_s * 1e3:.0f} ms, fit over every probe): "
                          f"--host-link-gbps {link:.4g}")
    console.print(f"device pool {dev} tokens = {dev / fixed_total:.0%} of the {fixed_total} "
                  f"fixed-prompt tokens; host pool {host} tokens; host link "
                  + (f"{link:.4g} GB/s (EMULATED)" if link else "real copy speed"))
    meta["server"] = {"model": model, "device_tokens": dev, "host_tokens": host,
                      "page_size": page_size, "host_link_gbps": link, "lookahead": lookahead,
                      "max_batch": max_batch, "device_fraction_of_fixed": dev / fixed_total,
                      "torch_threads": torch_threads, "extra_args": list(extra_args),
                      "variants": _variants_json(variants), "commands": dict(commands or {})}
    return ServerConfig(model=model, device_tokens=dev, host_tokens=host, page_size=page_size,
                        host_link_gbps=link, lookahead=lookahead, max_batch=max_batch,
                        torch_threads=torch_threads, extra_args=extra_args, variants=variants,
                        commands=commands or {})


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
            meta, results, targets = report.from_json(json.loads(Path(result).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise typer.BadParameter(str(e), param_hint="RESULT") from None
        title = f"{meta.get('command') or 'kvflow bench ' + str(meta.get('bench', ''))} ({Path(result).name})"
        _emit(Console(), meta, results, title=title, targets=targets, raw=True, json_path=json_out,
              plot_path=plot_out, wide=wide)

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
        from kvflow_agents.bench.runner import run_workflow_bench
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
                 + ("" if hints == "on" else f", hints: {hints}"))
        _run_and_report(
            lambda hook, log: run_workflow_bench(spec, pols, server, counter=counter, base_url=base_url,
                                                 model=served_model or model, api_key=api_key,
                                                 trials=trials, stream=stream, progress=hook,
                                                 keep_raw=raw, fresh_servers=fresh_servers, log=log),
            console, meta, title=title,
            targets=() if base_url else report.PAPER_TARGETS if regime is not None else report.WORKFLOW_TARGETS,
            progress=progress, raw=raw, json_out=json_out, plot_out=plot_out, wide=wide)
