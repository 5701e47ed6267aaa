"""``--plot out.png`` of ``kvflow bench workflow`` / ``peer`` / ``aiperf``: one PNG per run
(matplotlib, Agg backend) with the numbers :mod:`.stats` computes: workflow latency with the
speedup vs lru, TTFT, prompt tokens by tier, and the achievable saving (bars: the pooled p50
ratio with min..max over trials; dots: the mean-based ratio with its bootstrap interval)."""

from __future__ import annotations

from typing import Sequence

from .runner import PolicyResult
from .stats import BASELINES, CI_LEVEL, LATENCY_KEY, ratios, saving_ratios


def plot(results: Sequence[PolicyResult], path: str, title: str = "kvflow bench") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    colors = {"lru": "#999999", "hicache": "#4c72b0", "kvflow": "#dd8452", "oracle": "#55a868"}
    col = [colors.get(n, "#8172b3") for n in names]
    sav = saving_ratios(results)
    fig, axes = plt.subplots(1, 4 if sav else 3, figsize=(17 if sav else 13, 4))
    lat = [r.workload.get(LATENCY_KEY) or 0 for r in results]
    ax = axes[0]
    bars = ax.bar(names, lat, color=col)
    ax.set_title("workflow latency (p50, s; x = speedup vs lru)")
    rat = ratios(results)
    for b, n in zip(bars, names):
        sp = rat[n]["speedup_vs_lru"]
        if sp:
            ax.annotate(f"{sp:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    ax.bar(names, [(r.workload.get("ttft_mean_s") or 0) * 1e3 for r in results], color=col)
    ax.set_title("TTFT (mean, ms)")
    ax = axes[2]
    dev = [(r.workload.get("device_hit_rate") or 0) * 100 for r in results]
    host = [(r.workload.get("host_hit_rate") or 0) * 100 for r in results]
    miss = [(r.workload.get("miss_rate") or 0) * 100 for r in results]
    ax.bar(names, dev, color="#55a868", label="device hit")
    ax.bar(names, host, bottom=dev, color="#4c72b0", label="host hit")
    ax.bar(names, miss, bottom=[a + b for a, b in zip(dev, host)], color="#c44e52", label="recomputed")
    ax.set_title("prompt tokens by tier (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="lower right")
    if sav:
        _plot_saving(axes[3], sav)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_saving(ax, sav: dict) -> None:
    """Achievable saving per policy and baseline: bars the pooled p50 ratio with min..max over
    trials, dots the mean-based ratio with its paired-bootstrap interval."""
    pols = list(sav)
    w, labeled = 0.38, False
    for k, base in enumerate(BASELINES):
        xs, ys, lo, hi = [], [], [], []
        for i, p in enumerate(pols):
            x = sav[p].get(base)
            if not x or x["ratio"] is None:
                continue
            xs.append(i + (k - 0.5) * w)
            ys.append(x["ratio"])
            lo.append(x["ratio"] - (x["min"] if x["min"] is not None else x["ratio"]))
            hi.append((x["max"] if x["max"] is not None else x["ratio"]) - x["ratio"])
        if xs:
            ax.bar(xs, ys, w, yerr=[[max(0, v) for v in lo], [max(0, v) for v in hi]], capsize=3,
                   color="#999999" if base == "lru" else "#4c72b0", label=f"vs {base}")
        # the mean-based ratio with its bootstrap interval, beside the bar
        ci = [(i + (k - 0.5) * w + w / 4, sav[p][base]) for i, p in enumerate(pols)
              if (sav[p].get(base) or {}).get("ci") and sav[p][base].get("ratio_mean") is not None]
        if ci:
            ax.errorbar([x for x, _ in ci], [c["ratio_mean"] for _, c in ci],
                        yerr=[[max(0, c["ratio_mean"] - c["ci"]["lo"]) for _, c in ci],
                              [max(0, c["ci"]["hi"] - c["ratio_mean"]) for _, c in ci]],
                        fmt="o", ms=3, color="k", lw=1, capsize=2,
                        label=None if labeled else f"mean, {CI_LEVEL:.0%} CI")
            labeled = True
    ax.axhline(1.0, color="#55a868", lw=1, label="oracle")
    ax.axhline(0.95, color="k", lw=0.8, ls="--", label="target 0.95")
    ax.set_xticks(range(len(pols)), pols)
    ax.set_title(f"oracle's saving taken\n(bars: p50, min..max over trials; dots: mean, {CI_LEVEL:.0%} CI)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
