"""Rich tables and matplotlib (Agg) charts for ``kvflow sim``.

The terminal tables fit 80 columns by default (short cells, one number each; the sweep as one
small table per metric); ``wide=True`` gives every column. ``--json`` has all numbers."""

from __future__ import annotations

import json
from typing import Optional, Sequence

from .state import SimResult


def _f(v: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _table(title: str, caption: Optional[str] = None):
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", caption=caption, caption_justify="left",
                 box=box.SIMPLE_HEAD, pad_edge=False)


def run_table(results: dict[str, SimResult], title: str):
    t = _table(title)
    t.add_column("metric")
    for p in results:
        t.add_column(p, justify="right")
    rows = [("workflow latency (s)", lambda r: _f(r.latency_s, "{:.3f}")),
            ("  p90 (s)", lambda r: _f(r.latency_p90_s, "{:.3f}")),
            ("makespan (s)", lambda r: _f(r.makespan_s, "{:.2f}")),
            ("TTFT mean (ms)", lambda r: _f(r.ttft_mean_s * 1e3, "{:.1f}")),
            ("recomputed tokens", lambda r: str(r.recomputed_tokens)),
            ("cached tokens used", lambda r: str(r.cached_tokens)),
            ("device hit rate", lambda r: _f(r.cache["device_hit_rate"], "{:.1%}")),
            ("link busy (s)", lambda r: _f(r.load_s, "{:.3f}")),
            ("exposed load (s)", lambda r: _f(r.exposed_load_s, "{:.3f}")),
            ("hidden-load fraction", lambda r: _f(r.hidden_fraction, "{:.1%}")),
            ("prefetch issued/used/waste", lambda r: "{}/{}/{}".format(
                r.cache["prefetch_issued"], r.cache["prefetch_used"], r.cache["prefetch_wasted"]))]
    for name, fn in rows:
        t.add_row(name, *(fn(r) for r in results.values()))
    base = {p: r.latency_s for p, r in results.items()}
    for ref in ("lru", "hicache"):
        if ref in base:
            t.add_row(f"speedup vs {ref}", *(_f(base[ref] / r.latency_s if r.latency_s else None, "{:.2f}x")
                                             for r in results.values()))
    return t


def paper_tables(summaries: Sequence[dict], wide: bool = False) -> list:
    """One table per figure. Narrow: config and the ratios (kvflow/hicache, the paper's, kvflow/
    lru, kvflow÷oracle, hidden-load share); wide adds the four policies' latencies (s)."""
    out = []
    for s in summaries:
        t = _table(f"{s['figure']}: {s['title']}",
                   caption=f"paper: up to {s['paper_max']}x ({s['paper_src']}); ours max "
                           f"{_f(s['ours_max'])}x; {s['note']}")
        cols = (["config"] + (["lru s", "hicache s", "kvflow s", "oracle s"] if wide else [])
                + ["kv/hicache", "paper", "kv/lru", "kv÷oracle", "hidden"])
        for c in cols:
            t.add_column(c, justify="left" if c == "config" else "right", no_wrap=True)
        for c in s["configs"]:
            secs = [_f(c.get(p), "{:.2f}") for p in ("lru", "hicache", "kvflow", "oracle")] if wide else []
            t.add_row(c["config"], *secs,
                      _f(c["kvflow_vs_hicache"], "{:.2f}x"), _f(c["paper_ratio"], "{:.2f}x"),
                      _f(c["kvflow_vs_lru"], "{:.2f}x"), _f(c["kvflow_over_oracle"], "{:.3f}"),
                      _f(c["kvflow_hidden"], "{:.0%}"))
        out.append(t)
    return out


_SWEEP_METRICS = (("kvflow_hidden", "kvflow hidden-load share", "{:.0%}"),
                  ("kvflow_vs_hicache", "kvflow/hicache", "{:.2f}"),
                  ("hicache_vs_lru", "hicache/lru", "{:.2f}"))


def sweep_tables(sw: dict, wide: bool = False) -> list:
    """Narrow: one table per metric (rows = workflows, columns = link GB/s); wide: one table
    whose cells hold all three."""
    head = f"sweep on {sw['profile']}: cycle of 10, {sw['fixed']}/{sw['dynamic']}/{sw['output']} tokens"
    specs = [(None, "cells: kvflow hidden-load % | kvflow/hicache | hicache/lru", None)] if wide else _SWEEP_METRICS
    out = []
    for key, name, fmt in specs:
        t = _table(f"{head}; {name}" + ("" if wide else " (columns: host link GB/s)"))
        t.add_column("wf" if not wide else "workflows")
        for bw in sw["bandwidth"]:
            t.add_column(f"{bw:g}" + (" GB/s" if wide else ""), justify="right", no_wrap=True)
        for n in sw["concurrency"]:
            row = [c for c in sw["cells"] if c["concurrency"] == n]
            if key is None:
                cells = ["{}/{}/{}".format(_f(c["kvflow_hidden"], "{:.0%}"), _f(c["kvflow_vs_hicache"]),
                                           _f(c["hicache_vs_lru"])) for c in row]
            else:
                cells = [_f(c[key], fmt) for c in row]
            t.add_row(str(n), *cells)
        out.append(t)
    return out


def sweep_table(sw: dict):
    """The wide sweep table (all three metrics per cell)."""
    return sweep_tables(sw, wide=True)[0]


def markdown_paper(summaries: Sequence[dict]) -> str:
    lines = []
    for s in summaries:
        lines += [f"### {s['figure']}: {s['title']}", "",
                  f"Paper: up to **{s['paper_max']}x** ({s['paper_src']}). Ours, max kvflow/hicache: "
                  f"**{_f(s['ours_max'])}x**. {s['note']}.", "",
                  "| config | lru s | hicache s | kvflow s | oracle s | kvflow/hicache | paper | kvflow/lru | kvflow÷oracle | kvflow hidden |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in s["configs"]:
            lines.append("| " + " | ".join([c["config"], *(_f(c.get(p)) for p in ("lru", "hicache", "kvflow", "oracle")),
                                              _f(c["kvflow_vs_hicache"], "{:.2f}x"), _f(c["paper_ratio"], "{:.2f}x"),
                                              _f(c["kvflow_vs_lru"], "{:.2f}x"), _f(c["kvflow_over_oracle"], "{:.3f}"),
                                              _f(c["kvflow_hidden"], "{:.0%}")]) + " |")
        lines.append("")
    return "\n".join(lines)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(results: dict[str, SimResult], path: str, title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(results)
    ax[0].bar(names, [results[p].latency_s for p in names], color="#4c72b0")
    ax[0].set_title("workflow latency (s)")
    ax[1].bar(names, [results[p].exposed_load_s for p in names], color="#dd8452")
    ax[1].set_title("exposed load time (s)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paper(summaries: Sequence[dict], path: str) -> None:
    plt = _plt()
    n = len(summaries)
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.9 * n), squeeze=False)
    for ax, s in zip(axes[:, 0], summaries):
        labels = [c["config"] for c in s["configs"]]
        x = range(len(labels))
        w = 0.27
        for k, (key, col) in enumerate((("kvflow_vs_lru", "#55a868"), ("kvflow_vs_hicache", "#4c72b0"),
                                        ("hicache_vs_lru", "#c44e52"))):
            ax.bar([i + (k - 1) * w for i in x], [c[key] or 0 for c in s["configs"]], w, label=key, color=col)
        if s["paper_max"]:
            ax.axhline(s["paper_max"], ls="--", color="k", lw=1, label=f"paper up to {s['paper_max']}x (kvflow/hicache)")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xticks(list(x), labels, rotation=30, fontsize=7, ha="right")
        ax.set_title(f"{s['figure']}: {s['title']}", fontsize=8)
        ax.set_ylabel("speedup (x)")
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sw: dict, path: str) -> None:
    plt = _plt()
    import numpy as np

    conc, bws = sw["concurrency"], sw["bandwidth"]
    grid = {k: np.full((len(conc), len(bws)), np.nan) for k in ("kvflow_hidden", "kvflow_vs_hicache", "hicache_vs_lru")}
    for c in sw["cells"]:
        i, j = conc.index(c["concurrency"]), bws.index(c["link_gbps"])
        for k in grid:
            if c[k] is not None:
                grid[k][i, j] = c[k]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    specs = (("kvflow_hidden", "kvflow: hidden-load fraction", "viridis", 0, 1),
             ("kvflow_vs_hicache", "kvflow speedup over hicache", "magma", 1, None),
             ("hicache_vs_lru", "hicache speedup over lru (<1: slower than recompute)", "coolwarm_r", None, None))
    for ax, (k, title, cmap, lo, hi) in zip(axes, specs):
        im = ax.imshow(grid[k], cmap=cmap, vmin=lo, vmax=hi, aspect="auto", origin="lower")
        ax.set_xticks(range(len(bws)), [f"{b:g}" for b in bws], fontsize=7)
        ax.set_yticks(range(len(conc)), [str(c) for c in conc])
        ax.set_xlabel("host link (GB/s)")
        ax.set_ylabel("concurrent workflows")
        ax.set_title(title, fontsize=9)
        for i in range(len(conc)):
            for j in range(len(bws)):
                v = grid[k][i, j]
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"sweep on {sw['profile']}: cycle of 10, {sw['fixed']}/{sw['dynamic']}/{sw['output']} tokens",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(doc, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
