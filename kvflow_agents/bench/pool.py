"""Stored runs of one workload pooled into one sample (``kvflow bench pool``).

One run of `kvflow bench workflow` or `peer` resolves a policy's share of the oracle's saving
to a few hundredths at best: on this box one server process runs a few per cent faster or
slower than the next, and a run has 4-24 trials. Runs of the same command on the same code
are more trials of the same experiment, so their paired trials (every policy's latency in
one trial, or one PEER question) pool into one sample:

- per run: its trials, the policy's per-trial latency over the reference's (geometric mean)
  and its achievable saving over each baseline on the trials' sums (a trial's latency is its
  median workflow latency): the statistic whose interval ``kvflow bench show`` prints
  (:func:`.stats.saving_interval`; a run pooled alone gets the same interval). It can differ
  from the mean over every round and workflow that ``bench show`` prints beside that interval;
- pooled: the same figures over every run's trials, with intervals from a bootstrap that
  resamples trials within each run (``strata``, :func:`.stats.paired_bootstrap`), so each run
  keeps its weight and a run on a faster box does not stand in for one on a slower box.

Invariant: only runs of one workload shape pool (:data:`SHAPE`: the workload, the model, the
device and host pools' sizes); a difference is an error naming the keys and both files.
The code a run was made with is not part of the shape, since pooling the runs of several
versions that left the policy alone is legitimate: each run's recorded version
(:mod:`.provenance`; none before 2026-12-07) is listed, and a line says when they differ.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from . import report
from .provenance import label
from .report import SAVING_TARGETS, ci_verdict
from .runner import PolicyResult
from .stats import BASELINES, geometric_mean_interval, saving_interval

SAVING_TARGET = SAVING_TARGETS[0].value  # the issue's >= 0.95 of the oracle's saving

# (where in a stored document, keys) that make two runs the same experiment
SHAPE = {
    "workflow": (("workload", ("agents", "variant", "fixed", "dynamic", "output", "rounds",
                               "warmup_rounds", "workflows", "share_prompts", "hints")),
                 ("server", ("model", "device_tokens", "host_tokens", "page_size"))),
    "peer": (("options", ("framework", "warmup_questions", "jump", "max_rounds", "max_tokens",
                          "hints")),
             ("server", ("model", "device_tokens", "host_tokens", "page_size"))),
}


@dataclass(frozen=True)
class StoredRun:
    """One ``--json`` file: its name, bench, shape and per-policy results."""
    name: str
    bench: str
    shape: dict
    results: dict[str, PolicyResult]
    code: Optional[str] = None  # the recorded code version (provenance.label), None: unknown

    def trials(self, policy: str) -> dict[int, float]:
        """Trial -> latency (a trial with no latency, all of its calls failed, is left out)."""
        r = self.results.get(policy)
        return {int(t): v for t, v in (r.workload.get("workflow_latency_trials_s") or []) if v} if r else {}


def load_run(path: str) -> StoredRun:
    """A stored result; ``ValueError`` naming the file if it is not one this can pool."""
    try:
        doc = json.loads(Path(path).read_text())
        _, results, _ = report.from_json(doc)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    bench = doc.get("bench")
    if bench not in SHAPE:
        raise ValueError(f"{path}: a {bench!r} result; pool `kvflow bench workflow` or `peer` runs")
    shape = {}
    for part, keys in SHAPE[bench]:
        d = doc.get(part) or {}
        shape.update({f"{part}.{k}": d.get(k) for k in keys})
    return StoredRun(Path(path).name, bench, shape, {r.policy: r for r in results},
                     label(doc.get("code")))


def check_same_shape(runs: Sequence[StoredRun]) -> None:
    """``ValueError`` unless every run is of the first's bench and shape (module invariant)."""
    first = runs[0]
    for r in runs[1:]:
        if r.bench != first.bench:
            raise ValueError(f"{first.name} is a {first.bench} run, {r.name} a {r.bench} run")
        diff = [f"{k} ({v!r} against {r.shape.get(k)!r})" for k, v in first.shape.items()
                if r.shape.get(k) != v]
        if diff:
            raise ValueError(f"{first.name} and {r.name} differ in {', '.join(diff)}; "
                             "pool runs of one workload")


def _figures(pairs: dict[str, list[tuple[float, float, float]]], vs_ref: list[float],
             strata: Optional[list[int]]) -> dict:
    """The figures of one run (``strata`` None) or of the pool: latency over the reference and
    the saving over each baseline on the trials' sums, with intervals."""
    out: dict = {"trials": len(vs_ref),
                 "latency_vs_reference": geometric_mean_interval(vs_ref, strata=strata),
                 "saving": {}}
    for base, tr in pairs.items():
        b, m, o = (sum(t[i] for t in tr) for i in range(3))
        out["saving"][base] = {"ratio": (b - m) / (b - o) if b - o > 0 else None,
                               "ci": saving_interval(tr, strata=strata)}
    return out


def pool(runs: Sequence[StoredRun], policy: str = "kvflow", reference: str = "oracle") -> dict:
    """Per run and pooled figures of ``policy`` (module doc). Baselines: those of
    :data:`.stats.BASELINES` that every run has (and that are not ``policy``).
    ``ValueError`` when the runs differ in shape or one lacks ``policy`` or ``reference``."""
    if not runs:
        raise ValueError("no runs to pool")
    check_same_shape(runs)
    for r in runs:
        for p in (policy, reference):
            if p not in r.results:
                raise ValueError(f"{r.name} has no {p!r} column (it ran {', '.join(r.results)})")
    bases = [b for b in BASELINES if b != policy and all(b in r.results for r in runs)]
    rows, all_pairs, all_vs, strata = [], {b: [] for b in bases}, [], []
    for r in runs:
        cols = {p: r.trials(p) for p in (policy, reference, *bases)}
        # one trial set per run for every figure: each stratum is the same trials throughout
        ts = sorted(set.intersection(*(set(c) for c in cols.values())))
        if not ts:
            raise ValueError(f"{r.name}: no trial with a latency in every column")
        mine, ref = cols[policy], cols[reference]
        pairs = {b: [(cols[b][t], mine[t], ref[t]) for t in ts] for b in bases}
        vs = [mine[t] / ref[t] for t in ts]
        rows.append({"run": r.name, "code": r.code, **_figures(pairs, vs, None)})
        for b in bases:
            all_pairs[b].extend(pairs[b])
        all_vs.extend(vs)
        strata.append(len(ts))
    return {"bench": runs[0].bench, "shape": runs[0].shape, "workload": describe(runs[0]),
            "policy": policy, "reference": reference, "baselines": bases, "runs": rows,
            "pooled": _figures(all_pairs, all_vs, strata)}


def describe(run: StoredRun) -> str:
    """The pooled workload in a few words (the table's title)."""
    s = run.shape
    if run.bench == "peer":
        return f"PEER on {s.get('options.framework') or 'langgraph'}, {s.get('server.model')}"
    wf = s.get("workload.workflows")
    return (f"{s.get('workload.variant')} of {s.get('workload.agents')} agents, "
            f"{s.get('workload.fixed')}/{s.get('workload.dynamic')}/{s.get('workload.output')} tokens, "
            f"{wf} workflow{'s' if wf != 1 else ''}, {s.get('server.model')}")


def verdict_lines(out: dict, target: float = SAVING_TARGET) -> list[str]:
    """Per baseline, the pooled share and whether its interval resolves ``>= target``."""
    f = out["pooled"]
    lines = [code_line(out["runs"])]
    for b in out["baselines"]:
        s = f["saving"][b]
        if s["ratio"] is None:
            lines.append(f"pooled vs {b}: the {out['reference']} saves nothing over it")
            continue
        ci = s["ci"]
        tail = (f"; {ci['level']:.0%} CI {ci['lo']:.3f}..{ci['hi']:.3f} {ci_verdict(ci, target)}"
                if ci else "; no interval (fewer than 3 trials)")
        lines.append(f"pooled vs {b}: {s['ratio']:.3f} of the {out['reference']}'s saving "
                     f"over {f['trials']} trials (target >= {target:.2f}){tail}")
    return lines


def _runs(n: int) -> str:
    return f"{n} run{'s' if n != 1 else ''}"


def code_line(rows: Sequence[dict]) -> str:
    """Which code versions the pooled runs record (module invariant)."""
    by = Counter(r.get("code") or None for r in rows)
    if len(by) == 1 and None not in by:
        return f"code: every run on {next(iter(by))}"
    parts = [f"{_runs(n)} on {v}" for v, n in sorted((v, n) for v, n in by.items() if v)]
    if by.get(None):
        parts.append(f"{_runs(by[None])} with no record (made before runs recorded it)")
    return (f"code: {'; '.join(parts)}: pooled as one experiment, so the code between them "
            "must leave what is measured alone")


# ------------------------------------------------------------------------------ rendering
def _interval(d: Optional[dict]) -> str:
    if not d or d.get("lo") is None:
        return "-"
    return f"{d['lo']:.2f}-{d['hi']:.2f}"


def render_table(out: dict):
    """A rich table, one row per run and a last one for the pool: trials, the policy's latency
    over the reference's (geometric mean over trials, 90 % interval) and its saving
    over each baseline with its interval. Fits 80 columns with two baselines."""
    from rich.table import Table

    p, ref = out["policy"], out["reference"]
    t = Table(title=f"{p} over {len(out['runs'])} stored runs: {out['workload']}",
              title_justify="left")
    t.add_column("run", overflow="fold", max_width=24)
    t.add_column("trials", justify="right")
    t.add_column(f"x {ref} (90% CI)", justify="right")
    for b in out["baselines"]:
        t.add_column(f"saving vs {b} (CI)", justify="right")

    def row(name: str, f: dict, style: Optional[str] = None) -> None:
        lat = f["latency_vs_reference"]
        cells = [name, str(f["trials"]), f"{lat['ratio']:.3f} ({lat['lo']:.3f}-{lat['hi']:.3f})"]
        for b in out["baselines"]:
            s = f["saving"][b]
            r = "-" if s["ratio"] is None else f"{s['ratio']:.2f}"
            cells.append(f"{r} ({_interval(s['ci'])})")
        t.add_row(*cells, style=style)

    for r in out["runs"]:
        row(r["run"].removesuffix(".json"), r)
    row("pooled", out["pooled"], style="bold")
    return t


def plot(out: dict, path: str) -> None:
    """The saving over each baseline (trials' sums) per run and pooled, with 90 % intervals
    (matplotlib PNG), a dashed line at the target (:data:`SAVING_TARGET`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["run"] for r in out["runs"]] + ["pooled"]
    figs = out["runs"] + [out["pooled"]]
    bases = out["baselines"] or []
    fig, axes = plt.subplots(1, max(1, len(bases)), figsize=(6 * max(1, len(bases)), 1.2 + 0.4 * len(names)),
                             squeeze=False)
    for ax, b in zip(axes[0], bases):
        for i, f in enumerate(figs):
            s = f["saving"][b]
            if s["ratio"] is None:
                continue
            ci = s["ci"] or {"lo": s["ratio"], "hi": s["ratio"]}
            ax.errorbar([s["ratio"]], [i], xerr=[[s["ratio"] - ci["lo"]], [ci["hi"] - s["ratio"]]],
                        fmt="o", color="#dd8452" if i < len(figs) - 1 else "#c44e52", capsize=3)
        ax.axvline(SAVING_TARGET, ls="--", color="#999999", lw=1)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{out['policy']}: share of the {out['reference']}'s saving over {b} (trials, 90% CI)",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
