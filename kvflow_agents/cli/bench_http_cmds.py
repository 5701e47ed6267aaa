"""``kvflow bench http``: the HTTP side's CPU per request under each ``kvflow serve --http`` /
``--loop`` (:mod:`kvflow_agents.bench.http_side`)."""

from __future__ import annotations

from typing import Optional

import typer

from .bench_options import command_line, emit_document


def _combos(text: str) -> list[tuple[str, str]]:
    from kvflow_agents.bench.http_side import COMBOS

    known = {f"{loop}+{http}": (loop, http) for loop, http in COMBOS}
    out = []
    for word in (w.strip() for w in text.split(",")):
        if word not in known:
            raise typer.BadParameter(f"{word!r}: choose from {', '.join(known)}", param_hint="--combos")
        out.append(known[word])
    if not out:
        raise typer.BadParameter("name at least one combination", param_hint="--combos")
    return out


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("http")
    def http_cmd(
        combos: Optional[str] = typer.Option(
            None, help="LOOP+HTTP combinations (comma-separated; default: every one of asyncio|uvloop "
                       "+ h11|httptools whose packages are installed); the first is the baseline the "
                       "ratios are against."),
        requests: int = typer.Option(320, min=8, help="Requests per combination and repetition."),
        concurrency: int = typer.Option(8, min=1, max=256, help="Requests in flight at once."),
        tokens: int = typer.Option(32, min=1, help="Tokens generated per request."),
        reps: int = typer.Option(3, min=1, help="Repetitions (each measures every combination once)."),
        stream: bool = typer.Option(True, help="Stream the responses (SSE, one event per token)."),
        json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here ('-': stdout only)."),
        plot_out: Optional[str] = typer.Option(None, "--plot", help="Write a PNG chart here."),
        engine_process: bool = typer.Option(
            False, "--engine-process/--engine-thread", help="The servers' engine in a process of "
            "its own (kvflow serve's default) or on a thread beside the event loop, sharing its "
            "GIL (what this bench is for)."),
    ) -> None:
        """What the HTTP side costs per request: one `kvflow serve` (tiny-random) per --loop /
        --http combination under the same load, the event loop's and the engine thread's CPU
        time and the load's wall time, side by side (the event loop shares the GIL with the
        engine thread: its CPU is time the engine waits)."""
        from rich.console import Console

        from kvflow_agents.bench import http_side

        chosen = _combos(combos) if combos else http_side.installed_combos()
        for pkg in http_side.missing_packages(chosen):  # a bad flag here, not a failed server
            raise typer.BadParameter(f"{pkg} is not installed (pip install {pkg})", param_hint="--combos")
        console = Console(stderr=json_out == "-")
        with console.status("measuring …") as status:
            try:
                rows = http_side.run_http_bench(
                    combos=chosen, requests=requests, concurrency=concurrency, tokens=tokens,
                    reps=reps, stream=stream, engine_process=engine_process,
                    progress=lambda s: status.update(f"measuring: {s} …") if json_out != "-" else None)
            except RuntimeError as e:
                raise typer.BadParameter(str(e)) from None
        doc = {"bench": "http", "model": "tiny-random", "requests": requests,
               "concurrency": concurrency, "tokens": tokens, "reps": reps, "stream": stream,
               "engine_process": engine_process, "command": command_line("http"), "results": [r.as_dict() for r in rows]}
        title = (f"kvflow bench http: {requests} {'streamed ' if stream else ''}requests x {tokens} "
                 f"tokens, {concurrency} at a time, medians of {reps}")
        emit_document(console, doc, http_side.render_table(rows, title), json_out=json_out,
                      plot=(lambda: http_side.plot(rows, plot_out, title)) if plot_out else None)
