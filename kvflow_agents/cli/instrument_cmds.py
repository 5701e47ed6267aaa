"""``kvflow bench instrument``: what ``kvflow.instrument(graph)`` adds to each LLM call.

The same LangGraph graph (every node calls ``ChatOpenAI`` once) runs against a local stub
OpenAI server with and without instrumentation, interleaved run by run so both see the same
machine state. Reported: median time per LLM call for each, the added time per call, their
ratio, and the cost of the hint path alone (provider + hints object) measured inside a node.
"""

from __future__ import annotations

import contextlib
import json
import operator
import statistics
import time
from typing import Annotated, Any, TypedDict

import typer

BUDGET_US = 1000.0  # the budget: < 1 ms added per call


class _State(TypedDict, total=False):
    log: Annotated[list, operator.add]


def _build(nodes: int, shape: str, llm: Any) -> Any:
    from langgraph.graph import END, START, StateGraph

    def node(name: str):
        msgs = [("system", f"You are agent {name}."), ("human", "go")]

        def f(state: dict) -> dict:
            llm.invoke(msgs)
            return {"log": [name]}

        return f

    g = StateGraph(_State)
    names = [f"a{i:02d}" for i in range(nodes)]
    for n in names:
        g.add_node(n, node(n))
    if shape == "chain":
        g.add_edge(START, names[0])
        for a, b in zip(names, names[1:]):
            g.add_edge(a, b)
        g.add_edge(names[-1], END)
    else:  # fanout: first -> middle (parallel) -> AND join -> last
        first, middle, last = names[0], names[1:-1], names[-1]
        g.add_edge(START, first)
        for m in middle:
            g.add_edge(first, m)
        g.add_edge(middle, last)
        g.add_edge(last, END)
    return g


def _hint_path_us(iterations: int = 2000) -> float:
    """Microseconds for one ``current_hints()`` (what each LLM request asks) from inside a
    running node of an instrumented graph."""
    from langgraph.graph import START, StateGraph

    import kvflow_agents as kvflow
    from kvflow_agents.context import current_hints

    out: list[float] = []

    def probe(state: dict) -> dict:
        t0 = time.perf_counter()
        for _ in range(iterations):
            current_hints()
        out.append((time.perf_counter() - t0) / iterations * 1e6)
        return {}

    g = StateGraph(_State)
    g.add_node("probe", probe)
    g.add_edge(START, "probe")
    probe_app = kvflow.instrument(g, app_id="bench-probe", warn=False)
    probe_app.invoke({}, {"configurable": {"thread_id": "probe"}})
    return out[0] if out else float("nan")


_SERVER_SCRIPT = """
import sys
from kvflow_agents.testing import RecordingOpenAIServer
srv = RecordingOpenAIServer(record=False).start()
print(srv.base_url, flush=True)
sys.stdin.read()  # serve until the parent closes our stdin
srv.stop()
"""


@contextlib.contextmanager
def _stub_server():
    """The stub OpenAI server in its own process (as a real server would be), so its threads
    do not compete with the client for this process's GIL. Yields its base URL."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.startswith("http"):
            raise RuntimeError("the stub server did not start")
        yield line
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def _self_timer():
    """Accumulate the time spent inside kvflow's hooks (request patch, hint provider, Pregel
    step hooks, callbacks) while the block runs. Yields a one-element list (seconds)."""
    from kvflow_agents import autopatch
    from kvflow_agents.adapters import langgraph as lg

    spent = [0.0]
    targets = [(autopatch, "_inject")] + [
        (lg.LangGraphInstrumentation, name)
        for name in ("_on_tick", "_on_after_tick", "_on_loop_exit", "_on_chain_start", "_on_chain_end")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    for obj, name, fn in saved:
        setattr(obj, name, timed(fn))
    try:
        yield spent
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def bench_instrument(nodes: int = 20, runs: int = 30, shape: str = "chain", warmup: int = 3) -> dict[str, Any]:
    """Run the comparison; returns the figures (also used by the tests, with tiny sizes)."""
    from langchain_openai import ChatOpenAI

    import kvflow_agents as kvflow
    from kvflow_agents import autopatch

    if shape not in ("chain", "fanout"):
        raise ValueError(f"shape must be 'chain' or 'fanout', got {shape!r}")
    if nodes < 3:
        raise ValueError("a bench graph needs at least 3 nodes")
    was_enabled = autopatch.is_enabled()
    with _stub_server() as base_url:
        llm = ChatOpenAI(model="stub", base_url=base_url, api_key="x", max_retries=0)
        builder = _build(nodes, shape, llm)
        plain = builder.compile()
        inst = kvflow.instrument(builder, warn=False)

        times: dict[str, list[float]] = {"plain": [], "instrumented": []}
        cpu: dict[str, list[float]] = {"plain": [], "instrumented": []}

        def one(kind: str, i: int) -> float:
            if kind == "plain":
                autopatch.disable()  # the baseline pays nothing: no patch, no provider
                app, cfg = plain, {"configurable": {"thread_id": f"p{i}"}}
            else:
                autopatch.enable()
                app, cfg = inst, {"configurable": {"thread_id": f"i{i}"}}
            c0, t0 = time.process_time(), time.perf_counter()
            app.invoke({}, cfg)
            wall = time.perf_counter() - t0
            cpu[kind].append(time.process_time() - c0)  # the client process only
            return wall

        for i in range(warmup):
            one("plain", -1 - i)
            one("instrumented", -1 - i)
        for i in range(runs):
            order = ("plain", "instrumented") if i % 2 == 0 else ("instrumented", "plain")
            for kind in order:
                times[kind].append(one(kind, i))
        cpu = {k: v[warmup:] for k, v in cpu.items()}
        # kvflow's own time: every hook, timed while the instrumented graph runs again
        with _self_timer() as spent:
            for i in range(runs):
                one("instrumented", runs + i)
        self_us = spent[0] / (runs * nodes) * 1e6
        autopatch.enable()
        hint_us = _hint_path_us()
    if not was_enabled:
        autopatch.disable()
    calls = nodes  # one LLM call per node
    per_call = {k: statistics.median(v) / calls * 1e6 for k, v in times.items()}
    best = {k: min(v) / calls * 1e6 for k, v in times.items()}
    # Paired differences (each pair ran back to back) cancel slow drift of a shared machine.
    paired = statistics.median(i - p for p, i in zip(times["plain"], times["instrumented"])) / calls * 1e6
    return {
        "graph": {"nodes": nodes, "shape": shape, "llm_calls_per_run": calls},
        "runs": runs,
        "per_call_us": per_call,
        "best_per_call_us": best,
        "added_us_per_call": paired,
        "added_us_per_call_best": best["instrumented"] - best["plain"],
        "added_cpu_us_per_call": (statistics.median(cpu["instrumented"][:runs])
                                  - statistics.median(cpu["plain"][:runs])) / calls * 1e6,
        "ratio": per_call["instrumented"] / per_call["plain"],
        "hint_path_us": hint_us,
        "kvflow_self_us_per_call": self_us,
        "budget_us": BUDGET_US,
        # min-of-runs is the noise-robust estimate (as timeit); the medians are reported too
        "within_budget": best["instrumented"] - best["plain"] < BUDGET_US,
    }


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("instrument")
    def bench_instrument_cmd(
        nodes: int = typer.Option(20, min=3, max=500, help="Nodes in the graph (one LLM call each)."),
        runs: int = typer.Option(30, min=1, help="Timed runs of each variant (interleaved pairs)."),
        shape: str = typer.Option("chain", help="chain | fanout (first -> parallel -> AND join -> last)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Per-call time added by kvflow.instrument() on a LangGraph graph calling ChatOpenAI
        against a local stub server (target: < 1 ms per call)."""
        try:
            res = bench_instrument(nodes, runs, shape)
        except ValueError as e:
            raise typer.BadParameter(str(e))
        if as_json:
            typer.echo(json.dumps(res, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        pc = res["per_call_us"]
        t = Table(title=f"kvflow.instrument() overhead: {nodes}-node {shape}, {runs} runs each, "
                        "median per LLM call")
        for c in ("variant", "µs / call"):
            t.add_column(c, justify="right")
        best = res["best_per_call_us"]
        t.add_column("best run, µs / call", justify="right")
        t.add_row("plain graph", f"{pc['plain']:.0f}", f"{best['plain']:.0f}")
        t.add_row("instrumented", f"{pc['instrumented']:.0f}", f"{best['instrumented']:.0f}")
        t.add_row("added (median of paired runs)", f"{res['added_us_per_call']:+.0f}",
                  f"{res['added_us_per_call_best']:+.0f}")
        t.add_row("ratio", f"×{res['ratio']:.3f}", f"×{best['instrumented'] / best['plain']:.3f}")
        t.add_row("added CPU time (median)", f"{res['added_cpu_us_per_call']:+.0f}", "")
        t.add_row("kvflow's own code, per call", f"{res['kvflow_self_us_per_call']:.0f}", "")
        t.add_row("hint lookup alone (current_hints)", f"{res['hint_path_us']:.1f}", "")
        console = Console()
        console.print(t)
        verdict = "met" if res["within_budget"] else "MISSED"
        console.print(f"added per call (best runs): {res['added_us_per_call_best']:.0f} µs, ratio "
                      f"×{best['instrumented'] / best['plain']:.3f}; median of pairs "
                      f"{res['added_us_per_call']:.0f} µs, ratio ×{res['ratio']:.3f} "
                      f"(target < {BUDGET_US:.0f} µs: {verdict})")
