"""How the concurrent workflows' calls lined up, step by step: a ``kvflow bench workflow --raw``
run read back (``kvflow bench timeline RESULT.json``).

At several workflows the oracle's calls of one step arrive together, prefill together and
decode as one batch, so they also end together and the next step's calls arrive together
again. A call that waits for its prefix to load breaks that: under the ``all`` skip scope it
joins the batch late and ends out of phase, and so do all its workflow's later calls (more,
smaller decode batches); under ``workflow`` the younger workflows' ready calls wait with it
while the older ones run in a smaller batch. The aggregate counters show the cost (decode
steps a call, queueing); this view shows where it comes from: the steps whose calls waited,
how long, and how far apart the calls of each step arrived from then on (RESULTS.md §6.63).

Rows group the measured calls by (trial, round, workflow step); a step's *spread* is the time
from its first call's arrival to its last's (0 when they arrive together), its *waited* the
calls whose server-side load wait exceeded ``WAITED_S``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

WAITED_S = 0.01   # a load wait below this is a tick's latency, not a wait for the link


@dataclass(frozen=True)
class StepRow:
    trial: int
    round: int
    step: int
    calls: int
    spread_s: float        # first to last arrival of the step's calls
    waited: int            # calls that waited for a load (> WAITED_S)
    load_wait_max_s: float
    queue_max_s: float     # server: arrival -> prefill start, the longest of the step
    latency_max_s: float


def step_rows(calls: Iterable[Mapping]) -> list[StepRow]:
    """One row per (trial, round, step) of the measured calls (``--raw`` records: dicts with
    ``measured``, ``trial``, ``round``, ``step``, ``start``, ``latency_s`` and the server's
    ``load_wait_s`` / ``queue_s``, None where the server reports none)."""
    groups: dict[tuple, list[Mapping]] = {}
    for c in calls:
        if c.get("measured") and c.get("ok", True):
            groups.setdefault((c.get("trial", 0), c["round"], c["step"]), []).append(c)
    rows = []
    for (trial, rnd, step), cs in sorted(groups.items()):
        starts = [c["start"] for c in cs]
        waits = [c.get("load_wait_s") or 0.0 for c in cs]
        rows.append(StepRow(trial, rnd, step, len(cs), max(starts) - min(starts),
                            sum(w > WAITED_S for w in waits), max(waits),
                            max(c.get("queue_s") or 0.0 for c in cs),
                            max(c["latency_s"] for c in cs)))
    return rows


def summary(rows: Sequence[StepRow]) -> Optional[dict]:
    """A policy's steps in one line: how far apart its steps' calls arrived (median, mean,
    max), how many steps and calls waited for a load, the longest wait. None without rows."""
    if not rows:
        return None
    spreads = [r.spread_s for r in rows]
    return {"steps": len(rows), "calls": sum(r.calls for r in rows),
            "spread_p50_s": statistics.median(spreads), "spread_mean_s": statistics.fmean(spreads),
            "spread_max_s": max(spreads),
            "steps_waited": sum(r.waited > 0 for r in rows),
            "calls_waited": sum(r.waited for r in rows),
            "load_wait_max_s": max(r.load_wait_max_s for r in rows)}


def from_result(doc: Mapping) -> dict[str, list[StepRow]]:
    """Per policy of a stored ``kvflow bench workflow --json`` document, its step rows.
    ValueError when the run kept no per-call records (made without ``--raw``)."""
    out = {}
    for name, p in (doc.get("policies") or {}).items():
        raw = p.get("raw") if isinstance(p, Mapping) else None
        if raw and raw.get("calls"):
            out[name] = step_rows(raw["calls"])
    if not out:
        raise ValueError("no per-call records in this result: run the bench with --raw")
    return out


def summary_table(per_policy: Mapping[str, Sequence[StepRow]]):
    """A rich table, one row per policy (fits 80 columns)."""
    from rich import box
    from rich.table import Table

    t = Table(title="Calls of one step, concurrent workflows: arrival spread and load waits",
              title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("policy", no_wrap=True)
    for name in ("steps", "spread p50 (s)", "mean", "max", "steps waited", "calls waited",
                 "longest wait (s)"):
        t.add_column(name, justify="right")
    for name, rows in per_policy.items():
        s = summary(rows)
        if s is None:
            continue
        t.add_row(name, str(s["steps"]), f"{s['spread_p50_s']:.2f}", f"{s['spread_mean_s']:.2f}",
                  f"{s['spread_max_s']:.2f}", str(s["steps_waited"]),
                  f"{s['calls_waited']} / {s['calls']}", f"{s['load_wait_max_s']:.2f}")
    return t


def step_table(policy: str, rows: Sequence[StepRow]):
    """A rich table of one policy's steps (fits 80 columns)."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"{policy}: each step's calls", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("trial", "round", "step", "calls", "spread (s)", "waited",
                 "max wait (s)", "max queue (s)", "max latency (s)"):
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(str(r.trial), str(r.round), str(r.step), str(r.calls), f"{r.spread_s:.2f}",
                  str(r.waited), f"{r.load_wait_max_s:.2f}", f"{r.queue_max_s:.2f}",
                  f"{r.latency_max_s:.2f}")
    return t


def to_json(per_policy: Mapping[str, Sequence[StepRow]]) -> dict:
    from dataclasses import asdict

    return {name: {"summary": summary(rows), "steps": [asdict(r) for r in rows]}
            for name, rows in per_policy.items()}
