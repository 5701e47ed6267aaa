"""What the server-based bench commands share (``bench workflow``: :mod:`.bench_cmds`; ``bench
peer``: :mod:`.bench_peer_cmds`; ``bench aiperf``: :mod:`.bench_aiperf_cmds`; ``bench
engine|layout|http``, ``bench reliability``): option parsing and help texts (policies, hint modes,
policy variants, ``--other-python``, ``--server-flag``, ``--server-threads``), sizing the servers'
pools and link, the progress bars, and the table / JSON / plot a run ends with. No command is
registered here."""

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
        from kvflow_agents.bench import report

        sys.stdout.write(json.dumps(report.stamp(doc), indent=2) + "\n")
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
    :class:`~kvflow_agents.bench.figures.Figures` (its bootstrap runs once)."""
    from kvflow_agents.bench import report
    from kvflow_agents.bench.figures import Figures

    fig = Figures(results)
    doc = report.to_json(meta, results, targets, raw=raw, figures=fig)
    if json_path == "-":
        sys.stdout.write(json.dumps(report.stamp(doc), indent=2, default=str) + "\n")
    else:
        report.print_report(console, results, title=title, targets=targets, wide=wide, figures=fig,
                            meta=meta)
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
                          f"({regime.recompute_fit_s * 1e3:.0f} ms, fit over the probes near that length): "
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
