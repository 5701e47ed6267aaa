"""The side-by-side report: a rich table (one column per policy), ratios vs lru / hicache /
oracle, target checks, ``--json`` and ``--plot out.png`` (matplotlib, Agg backend).

Ratios use the workflow latency (one round of the workflow, or one PEER question):
``speedup vs X = latency(X) / latency(policy)`` (higher is better) and
``vs oracle = latency(policy) / latency(oracle)`` (1.0 = the physical limit; lower is better).
They are given for the median (p50) and the mean; targets are judged on the median, which a
noisy neighbour on a shared machine moves least (the mean-based ratios are printed too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .runner import PolicyResult

LATENCY_KEY = "workflow_latency_p50_s"     # what targets are judged on
MEAN_KEY = "workflow_latency_mean_s"


@dataclass
class Target:
    policy: str
    baseline: str
    op: str          # ">=" speedup vs baseline, or "<=" latency ratio vs baseline (oracle)
    value: float

    def describe(self) -> str:
        return (f"{self.policy} >= {self.value:g}x {self.baseline}" if self.op == ">=" else
                f"{self.policy} <= {self.value:.2f}x {self.baseline} latency")


WORKFLOW_TARGETS = (Target("kvflow", "lru", ">=", 3.0), Target("kvflow", "hicache", ">=", 1.3),
                    Target("kvflow", "oracle", "<=", 1.10))
PEER_TARGETS = (Target("kvflow", "lru", ">=", 1.15),)


def _lat(results: dict[str, PolicyResult], p: str, key: str = LATENCY_KEY) -> Optional[float]:
    r = results.get(p)
    v = r.workload.get(key) if r is not None else None
    return v if v else None


def ratios(results: Sequence[PolicyResult], key: str = LATENCY_KEY) -> dict[str, dict[str, Optional[float]]]:
    by = {r.policy: r for r in results}
    out = {}
    for r in results:
        me = _lat(by, r.policy, key)
        row = {}
        for base in ("lru", "hicache"):
            b = _lat(by, base, key)
            row[f"speedup_vs_{base}"] = b / me if (b and me) else None
        o = _lat(by, "oracle", key)
        row["latency_vs_oracle"] = me / o if (o and me) else None
        out[r.policy] = row
    return out


def check_targets(results: Sequence[PolicyResult], targets: Sequence[Target]) -> list[dict]:
    rat, mrat = ratios(results), ratios(results, MEAN_KEY)
    key = lambda t: f"speedup_vs_{t.baseline}" if t.op == ">=" else f"latency_vs_{t.baseline}"  # noqa: E731
    out = []
    for t in targets:
        v = rat.get(t.policy, {}).get(key(t))
        vm = mrat.get(t.policy, {}).get(key(t))
        met = None if v is None else (v >= t.value if t.op == ">=" else v <= t.value)
        met_mean = None if vm is None else (vm >= t.value if t.op == ">=" else vm <= t.value)
        out.append({"target": t.describe(), "measured": v, "met": met, "measured_mean": vm,
                    "met_on_mean": met_mean})
    return out


def to_json(meta: dict, results: Sequence[PolicyResult], targets: Sequence[Target] = (),
            raw: bool = False) -> dict:
    return {**meta, "policies": {r.policy: r.as_dict(raw=raw) for r in results},
            "ratio_basis": LATENCY_KEY,
            "ratios": ratios(results), "ratios_mean": ratios(results, MEAN_KEY),
            "ttft_ratios": ratios(results, "ttft_mean_s"),
            "targets": check_targets(results, targets)}


# ------------------------------------------------------------------------------ table
def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "s":
        return f"{v:.3f}"
    if kind == "ms":
        return f"{v * 1e3:.1f}"
    if kind == "%":
        return f"{v * 100:.1f}%"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "int":
        return f"{int(v)}"
    return str(v)


def rows(results: Sequence[PolicyResult]) -> list[tuple[str, list[str]]]:
    rat = ratios(results)
    mrat = ratios(results, MEAN_KEY)
    trat = ratios(results, "ttft_mean_s")

    def w(key, kind):
        return [_fmt(r.workload.get(key), kind) for r in results]

    def s(key, kind):
        return [_fmt((r.server or {}).get(key), kind) for r in results]

    out = [
        ("workflow latency p50 (s)", w("workflow_latency_p50_s", "s")),
        ("workflow latency mean (s)", w("workflow_latency_mean_s", "s")),
        ("workflow latency p90 (s)", w("workflow_latency_p90_s", "s")),
        ("TTFT mean (ms)", w("ttft_mean_s", "ms")),
        ("TTFT p90 (ms)", w("ttft_p90_s", "ms")),
        ("call latency mean (ms)", w("call_latency_mean_s", "ms")),
        ("prompt hit: device (usage)", w("device_hit_rate", "%")),
        ("prompt hit: host (usage)", w("host_hit_rate", "%")),
        ("prompt recomputed (usage)", w("miss_rate", "%")),
        ("match: device / host / loading / miss", [
            " / ".join(_fmt((r.server or {}).get(f"{k}_rate"), "%") for k in ("device", "host", "loading", "miss"))
            if r.server else "-" for r in results]),
        ("load hidden (s)", s("load_hidden_s", "s")),
        ("load exposed (s)", s("load_exposed_s", "s")),
        ("load hidden fraction", s("load_hidden_fraction", "%")),
        ("load wait in requests (s)", w("load_wait_s", "s")),
        ("prefetch used / issued", [f"{_fmt((r.server or {}).get('prefetch_used'), 'int')} / "
                                    f"{_fmt((r.server or {}).get('prefetch_issued'), 'int')}"
                                    if r.server else "-" for r in results]),
        ("demand loads", s("demand_loads", "int")),
        ("requests (errors)", [f"{r.workload.get('calls')} ({r.workload.get('errors')})" for r in results]),
        ("prompt / output tokens", [f"{r.workload.get('prompt_tokens')} / {r.workload.get('completion_tokens')}"
                                    for r in results]),
        ("speedup vs lru (p50)", [_fmt(rat[r.policy]["speedup_vs_lru"], "x") for r in results]),
        ("speedup vs hicache (p50)", [_fmt(rat[r.policy]["speedup_vs_hicache"], "x") for r in results]),
        ("latency vs oracle (p50)", [_fmt(rat[r.policy]["latency_vs_oracle"], "x") for r in results]),
        ("speedup vs lru / hicache (mean)", [
            f"{_fmt(mrat[r.policy]['speedup_vs_lru'], 'x')} / {_fmt(mrat[r.policy]['speedup_vs_hicache'], 'x')}"
            for r in results]),
        ("latency vs oracle (mean)", [_fmt(mrat[r.policy]["latency_vs_oracle"], "x") for r in results]),
        ("TTFT speedup vs lru", [_fmt(trat[r.policy]["speedup_vs_lru"], "x") for r in results]),
    ]
    return out


def render_table(results: Sequence[PolicyResult], title: str):
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    t.add_column("metric")
    for r in results:
        t.add_column(r.policy, justify="right")
    for name, vals in rows(results):
        t.add_row(name, *vals)
    return t


def plain_table(results: Sequence[PolicyResult]) -> str:
    """The same table as Markdown (for RESULTS.md)."""
    head = "| metric | " + " | ".join(r.policy for r in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    body = ["| " + name + " | " + " | ".join(vals) + " |" for name, vals in rows(results)]
    return "\n".join([head, sep, *body])


def print_report(console, results: Sequence[PolicyResult], *, title: str,
                 targets: Sequence[Target] = ()) -> None:
    console.print(render_table(results, title))
    bound = ratios(results).get("oracle", {}).get("speedup_vs_lru")
    if bound:
        console.print(f"bound: oracle (unbounded device memory, no load ever) is {bound:.2f}x lru "
                      f"(p50); no policy on this engine and workload can exceed that")
    for t in check_targets(results, targets):
        if t["met"] is None:
            continue
        mark = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
        mean = (f" (on the mean: {t['measured_mean']:.2f}x, {'met' if t['met_on_mean'] else 'missed'})"
                if t.get("measured_mean") is not None else "")
        console.print(f"target {t['target']}: measured {t['measured']:.2f}x (p50) -> {mark}{mean}")


# ------------------------------------------------------------------------------ plot
def plot(results: Sequence[PolicyResult], path: str, title: str = "kvflow bench") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in results]
    colors = {"lru": "#999999", "hicache": "#4c72b0", "kvflow": "#dd8452", "oracle": "#55a868"}
    col = [colors.get(n, "#8172b3") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def results_from_json(doc: dict) -> list[PolicyResult]:
    """The :class:`PolicyResult` list of a ``--json`` file (to re-render or compare runs)."""
    return [PolicyResult(name, p["workload"], p.get("server"), p.get("serve_argv", []),
                         p.get("startup_s", 0.0)) for name, p in doc["policies"].items()]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m kvflow_agents.bench.report RESULT.json``: the table as Markdown."""
    import sys

    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as f:
            doc = json.load(f)
        print(plain_table(results_from_json(doc)))
        for t in doc.get("targets") or []:
            if t.get("measured") is not None:
                print(f"\n- target {t['target']}: {t['measured']:.2f}x (p50) -> "
                      f"{'met' if t['met'] else 'MISSED'}"
                      + (f"; on the mean {t['measured_mean']:.2f}x" if t.get("measured_mean") else ""))


if __name__ == "__main__":  # pragma: no cover
    main()
