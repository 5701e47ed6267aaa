"""``kvflow bench http``: what the HTTP side of ``kvflow serve`` costs per request, per HTTP
protocol (``--http``) and event loop (``--loop``), and what that does to the engine.

The embedded server runs its HTTP side (uvicorn, FastAPI, the SSE stream) on an event loop in
the same process as the engine thread, so the two share one GIL: every CPU second the event
loop spends parsing a request or framing an SSE chunk in Python is a second the engine thread
waits (bench/RESULTS.md 6.36). This measures that second directly. For each combination one
``kvflow serve`` (tiny-random, kvflow, one torch thread) gets the same load: ``requests``
chat completions, ``concurrency`` at a time, ``tokens`` tokens each (streamed by default);
the server's threads' CPU time is read from ``/proc/<pid>/task/*/stat`` before and after the
load (not the start-up), so the figures are the event loop's CPU per request (the main thread,
where uvicorn runs its loop), the engine thread's CPU (the busiest other thread) and the wall
time of the load. Combinations are measured in turn within each repetition, the order reversed
every other one, and each is compared with the first combination (the baseline, ``asyncio`` +
``h11``: uvicorn's pure-Python path) measured in the same repetition.

By default the servers run the engine on a thread of the HTTP process (``--engine-thread``), the
setting above; with ``engine_process`` (``kvflow bench http --engine-process``) in its own
process, whose threads are counted too (the engine thread is still the busiest one).

Linux only (``/proc``); a thread that ends during the load is not counted (the server's threads
live as long as it does).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

COMBOS: tuple[tuple[str, str], ...] = (("asyncio", "h11"), ("asyncio", "httptools"),
                                       ("uvloop", "h11"), ("uvloop", "httptools"))


def missing_packages(combos: Sequence[tuple[str, str]]) -> list[str]:
    """The packages ``combos`` need that are not installed (asyncio and h11 always are)."""
    import importlib.util

    needed = {p for combo in combos for p in combo if p in ("uvloop", "httptools")}
    return sorted(p for p in needed if importlib.util.find_spec(p) is None)


def installed_combos() -> list[tuple[str, str]]:
    """:data:`COMBOS` whose packages are installed (httptools comes with the serve extra;
    uvloop only if installed by hand)."""
    return [c for c in COMBOS if not missing_packages([c])]


@dataclass
class Sample:
    """One combination's load, once."""
    loop: str
    http: str
    wall_s: float              # the load, first request sent to last response read
    loop_cpu_s: float          # the event loop's thread (the server's main thread)
    engine_cpu_s: float        # the busiest other thread: the engine's
    other_cpu_s: float         # every other thread (request preparation pool, AnyIO workers)
    requests: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class FrontendRow:
    """One combination over every repetition (medians), and against the baseline."""
    loop: str
    http: str
    loop_ms_per_request: float
    engine_cpu_s: float
    wall_s: float
    requests_per_s: float
    loop_cpu_vs_base: float    # median over repetitions of (this loop CPU / the baseline's there)
    wall_vs_base: float        # likewise for the wall time
    engine_cpu_vs_base: float  # likewise for the engine thread's CPU (the same work each time)
    samples: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.loop}/{self.http}"

    def as_dict(self) -> dict:
        return asdict(self)


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of ``pid`` and of the processes below it (the
    engine process of ``--engine-process``), by thread id."""
    from kvflow_agents.serve_process import process_tree

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:  # the process ended meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": comm may hold spaces
            except OSError:  # the thread ended meanwhile
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def split_cpu(pid: int, before: dict[int, float], after: dict[int, float]) -> tuple[float, float, float]:
    """(event loop, engine, the rest) CPU seconds between two :func:`thread_cpu_s` snapshots."""
    delta = {t: after[t] - before.get(t, 0.0) for t in after}
    loop = delta.pop(pid, 0.0)
    engine = max(delta.values(), default=0.0)
    return loop, engine, sum(delta.values()) - engine


def chat_body(k: int, tokens: int, stream: bool) -> dict:
    """Request ``k``: one of four ~400-token agent prompts (cached after the first call, so the
    engine's work per request is small and the HTTP side's share of it large) and a short task."""
    return {"model": "tiny-random", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream,
            "messages": [{"role": "system", "content": f"You are agent {k % 4}. " * 20},
                         {"role": "user", "content": f"task {k}"}]}


def drive(url: str, *, requests: int, concurrency: int, tokens: int, stream: bool) -> float:
    """Send the load (``concurrency`` threads, each with its own connection); returns its wall
    seconds. A failed request raises: a figure over failed requests would measure errors."""
    import httpx

    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                for k in range(w, requests, concurrency):
                    if stream:
                        with client.stream("POST", url + "/v1/chat/completions",
                                           json=chat_body(k, tokens, True)) as r:
                            r.raise_for_status()
                            for _ in r.iter_lines():
                                pass
                    else:
                        client.post(url + "/v1/chat/completions",
                                    json=chat_body(k, tokens, False)).raise_for_status()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall


def measure_once(loop: str, http: str, *, requests: int, concurrency: int, tokens: int,
                 stream: bool, warmup: int = 8, command: Optional[Sequence[str]] = None,
                 engine_process: bool = False) -> Sample:
    """One ``kvflow serve`` with ``--loop loop --http http`` under the load (module doc)."""
    import httpx

    from kvflow_agents.serve_process import ServeProcess

    args = ["--model", "tiny-random", "--policy", "kvflow", "--torch-threads", "1",
            "--log-level", "warning", "--loop", loop, "--http", http,
            "--engine-process" if engine_process else "--engine-thread"]
    with ServeProcess(args, command=command) as srv:
        with httpx.Client(timeout=120) as c:  # the prompts into the cache, the code paths warm
            for k in range(warmup):
                c.post(srv.url + "/v1/chat/completions", json=chat_body(k, tokens, stream=False)).raise_for_status()
        pid = srv.proc.pid
        before = thread_cpu_s(pid)
        wall = drive(srv.url, requests=requests, concurrency=concurrency, tokens=tokens, stream=stream)
        after = thread_cpu_s(pid)
    lp, eng, rest = split_cpu(pid, before, after)
    return Sample(loop, http, wall, lp, eng, rest, requests)


def summarize(samples: Sequence[Sample], combos: Sequence[tuple[str, str]]) -> list[FrontendRow]:
    """Rows in ``combos`` order; ratios are per repetition against ``combos[0]`` (each
    combination's samples in repetition order)."""
    by: dict[tuple[str, str], list[Sample]] = {tuple(c): [] for c in combos}
    for x in samples:
        by[(x.loop, x.http)].append(x)
    base = by[tuple(combos[0])]
    rows = []
    for combo in combos:
        xs = by[tuple(combo)]
        med = lambda f: statistics.median(f(x) for x in xs)  # noqa: E731
        rows.append(FrontendRow(
            loop=combo[0], http=combo[1],
            loop_ms_per_request=med(lambda x: 1000 * x.loop_cpu_s / x.requests),
            engine_cpu_s=med(lambda x: x.engine_cpu_s), wall_s=med(lambda x: x.wall_s),
            requests_per_s=med(lambda x: x.requests / x.wall_s),
            loop_cpu_vs_base=statistics.median(x.loop_cpu_s / b.loop_cpu_s for x, b in zip(xs, base)),
            wall_vs_base=statistics.median(x.wall_s / b.wall_s for x, b in zip(xs, base)),
            engine_cpu_vs_base=statistics.median(x.engine_cpu_s / b.engine_cpu_s for x, b in zip(xs, base)),
            samples=[x.as_dict() for x in xs]))
    return rows


def run_http_bench(*, combos: Optional[Sequence[tuple[str, str]]] = None, requests: int = 320,
                   concurrency: int = 8, tokens: int = 32, reps: int = 3, stream: bool = True,
                   progress: Optional[Callable[[str], None]] = None,
                   command: Optional[Sequence[str]] = None, engine_process: bool = False) -> list[FrontendRow]:
    """Every combination (default: :func:`installed_combos`) ``reps`` times, interleaved
    (module doc)."""
    combos = list(combos) if combos else installed_combos()
    if not os.path.isdir("/proc/self/task"):
        raise RuntimeError("kvflow bench http reads threads' CPU time from /proc: Linux only")
    samples: list[Sample] = []
    for r in range(reps):
        order = list(combos) if r % 2 == 0 else list(combos)[::-1]
        for loop, http in order:
            if progress:
                progress(f"repetition {r + 1}/{reps}: --loop {loop} --http {http}")
            samples.append(measure_once(loop, http, requests=requests, concurrency=concurrency,
                                        tokens=tokens, stream=stream, command=command,
                                        engine_process=engine_process))
    return summarize(samples, combos)


def render_table(rows: Sequence[FrontendRow], title: str):
    from rich.table import Table

    # 80 columns: "x base" is the median ratio to the first row's, measured in the same repetitions
    t = Table(title=title, title_justify="left", caption="loop ms/rq: the event loop's CPU per "
              "request; engine s: the engine thread's CPU (the same work in every row); x base: "
              "median ratio to the first row in the same repetitions", caption_justify="left")
    for name in ("--loop/--http", "loop ms/rq", "x base", "engine s", "wall s", "x base", "req/s"):
        t.add_column(name, justify="left" if name.startswith("--") else "right", no_wrap=True,
                     min_width=len(name))
    for r in rows:
        t.add_row(r.label, f"{r.loop_ms_per_request:.2f}", f"{r.loop_cpu_vs_base:.2f}x",
                  f"{r.engine_cpu_s:.2f}", f"{r.wall_s:.2f}", f"{r.wall_vs_base:.2f}x",
                  f"{r.requests_per_s:.1f}")
    return t


def plot(rows: Sequence[FrontendRow], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = [r.label for r in rows]
    a.barh(labels, [r.loop_ms_per_request for r in rows], color="tab:blue")
    a.set_xlabel("event loop CPU per request (ms)")
    a.invert_yaxis()
    b.barh(labels, [r.wall_vs_base for r in rows], color="tab:orange")
    b.set_xlabel("wall time of the load / the first row's (median)")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
