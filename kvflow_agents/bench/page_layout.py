"""``kvflow bench layout``: what a sequence's page layout costs the embedded engine's decode step.

The embedded engine's attention gathers every running sequence's KV pages with ``index_select``
at every decode step (``serving/embedded/model/llama.py``), so how the pages lie in the pool is
paid per generated token. Partial eviction (``kvflow serve --partial-eviction``) splits victims
and reloads their tails into free holes, leaving a prefix in many runs (bench/RESULTS.md §6.10);
this measures what that costs with nothing else moving: one model, one pool, ``batch`` sequences of
``context`` tokens, each laid out in 1, 4, 19, ... runs of neighbouring pages (0 = every page
its own run), the runs placed at shuffled positions over the pool. The layouts are timed
interleaved (every repetition times each layout once, in turn), medians over repetitions, and
each layout's step is given as a ratio to the 1-run layout measured in the same repetitions.

The pool is filled with random values first: ``torch.zeros`` of a large tensor leaves its pages
unmapped until written, and reading them maps every page to the kernel's one shared zero page,
which sits in cache and makes any layout look free.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from statistics import median
from typing import Callable, Optional, Sequence

DEFAULT_RUNS = (1, 4, 19, 0)   # 19: what partial eviction left with 8 workflows (RESULTS §6.10)


@dataclass
class LayoutStep:
    runs: int                  # page runs per sequence (as laid out; 0 asked = one per page)
    step_ms: float             # median decode step (model.decode_batch) over repetitions
    step_min_ms: float
    vs_one_run: float          # median over repetitions of (this step / the 1-run step there)

    def as_dict(self) -> dict:
        return asdict(self)


def layout_rows(pages_per_seq: int, batch: int, runs: int, pool_pages: int,
                rng: random.Random) -> list[list[int]]:
    """Page ids for ``batch`` sequences of ``pages_per_seq`` pages each, every sequence in
    ``runs`` runs of neighbouring ids (0: one run per page), no id used twice. The pool is cut
    into blocks of one run's length and the blocks are dealt out in shuffled order, so runs of
    one sequence do not touch (a run's neighbour is another block, or free)."""
    if pages_per_seq < 1 or batch < 1:
        raise ValueError("pages_per_seq and batch must be >= 1")
    runs = pages_per_seq if runs <= 0 else min(runs, pages_per_seq)
    per = -(-pages_per_seq // runs)           # block = the longest run
    sizes = [per] * (pages_per_seq // per) + ([pages_per_seq % per] if pages_per_seq % per else [])
    # the last piece may leave fewer runs than asked (e.g. 70 pages in 19 runs of 4): pad by
    # splitting the longest runs until the count is exact
    while len(sizes) < runs:
        i = max(range(len(sizes)), key=sizes.__getitem__)
        a = sizes[i] // 2
        sizes[i:i + 1] = [a, sizes[i] - a]
    blocks = pool_pages // per
    need = batch * len(sizes)
    if need * 2 > blocks:  # half the blocks stay free, so consecutive blocks are rarely dealt
        raise ValueError(f"pool of {pool_pages} pages too small for {batch} x {pages_per_seq} pages "
                         f"in {runs} runs (needs {need * 2 * per})")
    order = list(range(blocks))
    rng.shuffle(order)
    # never deal a block next to one already dealt: its run would merge with that one
    free = iter(order)
    used: set[int] = set()
    rows = []
    for _ in range(batch):
        row: list[int] = []
        for size in sizes:
            b = next((b for b in free if b - 1 not in used and b + 1 not in used), None)
            if b is None:
                raise ValueError(f"pool of {pool_pages} pages too small to lay out {batch} x "
                                 f"{pages_per_seq} pages in {runs} separate runs")
            used.add(b)
            row.extend(range(b * per, b * per + size))
        rows.append(row)
    return rows


def measure_layouts(*, model: str = "tiny-random", batch: int = 8, context: int = 1024,
                    runs: Sequence[int] = DEFAULT_RUNS, reps: int = 7, steps: int = 40,
                    page_size: int = 16, torch_threads: Optional[int] = 1, seed: int = 0,
                    progress: Callable[[str], None] = lambda s: None) -> list[LayoutStep]:
    """Median decode step per layout (module doc); ``torch_threads`` as ``kvflow serve
    --torch-threads`` (the benches' servers run on one core)."""
    import torch

    from kvflow_agents.serving.embedded.kv_pool import page_runs
    from kvflow_agents.serving.embedded.malloc_tuning import pin_malloc_thresholds
    from kvflow_agents.serving.embedded.model import load_model

    # as the engine does: on this (main) thread glibc's adaptive thresholds made one process
    # page a step's temporaries in afresh and the next not, 2x apart (RESULTS.md 6.53)
    pin_malloc_thresholds()

    threads_before = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        m, _, cfg = load_model(model)
        ps = page_size
        npg = context // ps + 1
        asked = [1] + [r for r in dict.fromkeys(runs) if r != 1]
        pool_pages = 4 * batch * npg + 64
        gen = torch.Generator().manual_seed(seed)
        kv = torch.empty(m.kv_shape(pool_pages, ps), dtype=cfg.torch_dtype)
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))  # touch every page
        rng = random.Random(seed)
        layouts = {r: layout_rows(npg, batch, r, pool_pages, rng) for r in asked}
        seqs = {r: [(1 + b, rows[b], context) for b in range(batch)] for r, rows in layouts.items()}
        times: dict[int, list[float]] = {r: [] for r in asked}
        with torch.inference_mode():
            for rep in range(reps):
                progress(f"repetition {rep + 1}/{reps}")
                for r in asked:
                    for _ in range(3):
                        m.decode_batch(kv, seqs[r])
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        m.decode_batch(kv, seqs[r])
                    times[r].append((time.perf_counter() - t0) / steps * 1e3)
        out = []
        for r in asked:
            actual = len(page_runs(layouts[r][0], layouts[r][0]))
            rel = [t / one for t, one in zip(times[r], times[1])]
            out.append(LayoutStep(runs=actual, step_ms=median(times[r]), step_min_ms=min(times[r]),
                                  vs_one_run=median(rel)))
        return out
    finally:
        torch.set_num_threads(threads_before)


def render_table(results: Sequence[LayoutStep], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("runs / sequence", "decode step (ms)", "min (ms)", "vs 1 run"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(str(r.runs), f"{r.step_ms:.3f}", f"{r.step_min_ms:.3f}", f"{r.vs_one_run:.3f}x")
    return t


def plot(results: Sequence[LayoutStep], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [str(r.runs) for r in results]
    ax.bar(xs, [r.step_ms for r in results], color="#4c72b0")
    for i, r in enumerate(results):
        ax.text(i, r.step_ms, f"{r.vs_one_run:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xlabel("page runs per sequence")
    ax.set_ylabel("decode step, median (ms)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
