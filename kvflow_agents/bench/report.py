"""The side-by-side report: a rich table (one column per policy), ratios vs lru / hicache /
oracle, target checks and ``--json``; ``--plot out.png`` is :mod:`.report_plot`'s. The numbers
(ratios, the achievable saving and its interval, the cache cost) are :mod:`.stats`'s; targets
are judged on the median-based ones (the mean-based ratios are printed too).

Each saving column and target line shows the achievable saving pooled, its spread over trials
(per PEER question) and its paired-bootstrap interval (90 %), which says whether a run resolved
the target at all; the same ratio on the counter-based **cache cost** is printed beside it: it
does not move with the machine's load, so on a shared box it says what the policy achieved.

With an ``oracle-pool`` column (``--policies ...,oracle-pool``; ``serving/policy/policies.py``)
the same ratio is also taken against it (``saving vs hicache, pool``; JSON
``saving_same_pool``): that oracle keeps every prefix cached for free but gives running requests
the other policies' pool, so it leaves out what only more memory buys (in a tight pool, parallel
calls that every bounded policy runs one after another), and its own column's ``saving vs
hicache`` is the share of the unbounded oracle's saving any policy could take with this pool.

Where the servers reported their model's seconds per decode step per trial, the table adds
speed-adjusted rows (:mod:`.speed`): each policy's per-trial latency over the oracle's and the
achievable saving with every trial moved to the run's mean process speed, which removes most
of what one server process's luck does to a trial (JSON ``speed_adjusted``; targets stay
judged on the raw figures).

The bootstrapped figures are computed once per report (:class:`~.figures.Figures`) and handed
to the table (its rows: :mod:`.report_rows`), the target lines and the JSON alike.

The terminal table fits 80 columns (short row names, one number per cell); ``wide=True`` adds
every row (per-tier match split, tokens, mean-based ratios). ``--json`` has all of them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from .figures import Figures
from .link_floor import floor_lines, link_floor
from .report_rows import rows
from .runner import PolicyResult
from .stats import CI_LEVEL, LATENCY_KEY, MEAN_KEY, annotate_cache_cost, cost_saving, ratios


@dataclass
class Target:
    policy: str
    baseline: str
    op: str          # ">=" speedup vs baseline, "<=" latency ratio vs baseline (oracle), or
                     # "saving>=" share of the oracle's saving over the baseline
    value: float

    def describe(self) -> str:
        if self.op == "saving>=":
            return f"{self.policy} saves >= {self.value:g} of the oracle's saving over {self.baseline}"
        return (f"{self.policy} >= {self.value:g}x {self.baseline}" if self.op == ">=" else
                f"{self.policy} <= {self.value:.2f}x {self.baseline} latency")


SAVING_TARGETS = (Target("kvflow", "lru", "saving>=", 0.95), Target("kvflow", "hicache", "saving>=", 0.95))
WORKFLOW_TARGETS = (Target("kvflow", "lru", ">=", 3.0), Target("kvflow", "hicache", ">=", 1.3),
                    Target("kvflow", "oracle", "<=", 1.10), *SAVING_TARGETS)
PAPER_TARGETS = (Target("kvflow", "hicache", ">=", 1.8), *SAVING_TARGETS)   # paper: 1.83x hicache
PEER_TARGETS = (Target("kvflow", "lru", ">=", 1.15), Target("kvflow", "hicache", ">=", 1.0),
                *SAVING_TARGETS)


# ------------------------------------------------------------------------------ targets
def check_targets(results: Sequence[PolicyResult], targets: Sequence[Target], *,
                  figures: Optional[Figures] = None) -> list[dict]:
    """Each target judged on the median-based figure, with the mean-based one beside it (and
    for a saving target its spread, interval and speed-adjusted value). ``figures``: the
    report's :class:`Figures` of ``results`` (made here when left out)."""
    fig = figures if figures is not None else Figures(results)
    rat, mrat = ratios(results), ratios(results, MEAN_KEY)
    sav = fig.saving
    asav = fig.adjusted.saving if fig.adjusted else {}
    key = lambda t: f"speedup_vs_{t.baseline}" if t.op == ">=" else f"latency_vs_{t.baseline}"  # noqa: E731
    out = []
    for t in targets:
        extra: dict = {}
        if t.op == "saving>=":
            s = sav.get(t.policy, {}).get(t.baseline, {})
            v, vm = s.get("ratio"), s.get("ratio_mean")
            extra = {"trial_min": s.get("min"), "trial_max": s.get("max"), "ci": s.get("ci")}
            a = asav.get(t.policy, {}).get(t.baseline)
            if a:  # the same target on speed-adjusted trials (.speed); judged on the raw one
                # the decode steps of the policies compared that ran slower or faster than the
                # oracle's by more than the processes' luck (an interval that excludes 1): the
                # adjustment credits a policy's own effect on its forwards as if it were luck
                steps = (fig.speed or {}).get("speed_vs_oracle_ci") or {}
                credited = [{"policy": p, **{k: steps[p][k] for k in ("ratio", "lo", "hi")}}
                            for p in (t.baseline, t.policy)
                            if steps.get(p) and not steps[p]["lo"] <= 1.0 <= steps[p]["hi"]]
                extra["speed_adjusted"] = {"measured": a["ratio"], "measured_mean": a.get("ratio_mean"),
                                           "ci": a["ci"], "steps_unlike_oracle": credited}
        else:
            v = rat.get(t.policy, {}).get(key(t))
            vm = mrat.get(t.policy, {}).get(key(t))
        ok = (lambda x: x <= t.value) if t.op == "<=" else (lambda x: x >= t.value)
        out.append({"target": t.describe(), "kind": "saving" if t.op == "saving>=" else "ratio",
                    "value": t.value,
                    "measured": v, "met": None if v is None else ok(v), "measured_mean": vm,
                    "met_on_mean": None if vm is None else ok(vm), **extra})
    return out


# ------------------------------------------------------------------------------ JSON
def from_json(doc: dict) -> tuple[dict, list[PolicyResult], list[Target]]:
    """A saved ``--json`` document back as ``(meta, results, targets)``: what ``to_json`` was
    given, so a stored run can be reported again (``kvflow bench show``) with today's ratios."""
    if not isinstance(doc, dict) or not isinstance(doc.get("policies"), dict) or not doc["policies"]:
        raise ValueError("not a kvflow bench result: no 'policies' object")
    results = []
    for name, d in doc["policies"].items():
        if not isinstance(d, dict) or not isinstance(d.get("workload"), dict):
            raise ValueError(f"policy {name!r}: no 'workload' object")
        results.append(PolicyResult(d.get("policy", name), d["workload"], d.get("server"),
                                    d.get("serve_argv") or [], d.get("startup_s") or 0.0, d.get("raw")))
    targets = [Target(**t) for t in doc.get("target_specs") or []]
    derived = set(to_json({}, []))  # the keys to_json adds to meta (it is their one list)
    meta = {k: v for k, v in doc.items() if k not in derived}
    meta.setdefault("code", None)  # written again, a run made before the record stays unknown
    return meta, results, targets


def to_json(meta: dict, results: Sequence[PolicyResult], targets: Sequence[Target] = (),
            raw: bool = False, figures: Optional[Figures] = None) -> dict:
    spt = annotate_cache_cost(results, meta)
    fig = figures if figures is not None else Figures(results)
    return {**meta, "policies": {r.policy: r.as_dict(raw=raw) for r in results},
            "cache_cost_recompute_s_per_token": spt, "saving_cache_cost": cost_saving(results),
            "ratio_basis": LATENCY_KEY,
            "ratios": ratios(results), "ratios_mean": ratios(results, MEAN_KEY),
            "ttft_ratios": ratios(results, "ttft_mean_s"),
            "saving": fig.saving,
            "saving_same_pool": fig.saving_same_pool,
            "speed_adjusted": fig.speed,
            "speed_fit": fig.speed_fit.as_dict() if fig.speed_fit else None,
            "targets": check_targets(results, targets, figures=fig),
            "work_differences": work_differences(results),
            "link_floor": _floor_dict(meta),
            "target_specs": [dataclasses.asdict(t) for t in targets]}


def _floor_dict(meta: dict) -> Optional[dict]:
    f = link_floor(meta)
    return f.as_dict() if f is not None else None


def stamp(doc: dict) -> dict:
    """``doc`` with the code that made it (``code``: :mod:`.provenance`); a document re-written
    from a stored one keeps its own record (None: the run had none, see :func:`from_json`)."""
    from .provenance import code_version

    doc.setdefault("code", code_version())
    return doc


def write_json(doc: dict, path: str) -> None:
    """Write a bench's document, stamped with its code (:func:`stamp`)."""
    stamp(doc)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def results_from_json(doc: dict) -> list[PolicyResult]:
    """The :class:`PolicyResult` list of a ``--json`` file (:func:`from_json`'s results)."""
    return from_json(doc)[1]


# ------------------------------------------------------------------------------ table

_RANGE = re.compile(r"(-?[0-9][0-9.]*)-(-?[0-9][0-9.]*)")


def _break_range(v: str) -> str:
    """``lo-hi`` on two lines, broken after its hyphen (other cells as they are)."""
    m = _RANGE.fullmatch(v)
    return f"{m.group(1)}-\n{m.group(2)}" if m else v


def _break_label(label: str) -> str:
    """A column label on one line per hyphenated part (``hicache-always``: ``hicache-`` over
    ``always``), as :func:`_break_range` does for a range."""
    return label.replace("-", "-\n")


def render_table(results: Sequence[PolicyResult], title: str, wide: bool = False, *,
                 figures: Optional[Figures] = None, width: Optional[int] = None):
    """``width``: the terminal's columns. Where the cells do not fit it side by side, every
    ``lo-hi`` range goes on two lines, broken after its hyphen, and so does a hyphenated
    column label (a ``--policy-variant``'s): left to the table, rich folds a word that does
    not fit at any character, and "0.88-1.02" read "0.88-1.0" over "2", "hicache-always"
    "hicache-alway" over "s"."""
    from rich import box
    from rich.table import Table

    body = rows(results, wide=wide, figures=figures)
    cramped = False
    if width and results and body:
        cols = zip(*(vals for _, vals in body))
        # SIMPLE_HEAD's edges and separators are one blank each, and a cell is padded by one
        # on each side but at the table's edges (pad_edge=False): 3 per policy column, 2 more
        need = (max(len("metric"), *(len(name) for name, _ in body)) + 3 * len(results) + 2
                + sum(max(len(r.policy), *(len(v) for v in col)) for r, col in zip(results, cols)))
        cramped = need > width
    t = Table(title=title, show_lines=False, box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("metric", no_wrap=not wide, overflow="fold")
    for r in results:
        t.add_column(_break_label(r.policy) if cramped else r.policy, justify="right",
                     overflow="fold")
    for name, vals in body:
        t.add_row(name, *([_break_range(v) for v in vals] if cramped else vals))
    return t


def plain_table(results: Sequence[PolicyResult], wide: bool = True, *,
                figures: Optional[Figures] = None) -> str:
    """The same table as Markdown (for RESULTS.md)."""
    head = "| metric | " + " | ".join(r.policy for r in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    body = ["| " + name.strip() + " | " + " | ".join(vals) + " |"
            for name, vals in rows(results, wide, figures=figures)]
    return "\n".join([head, sep, *body])


def ci_verdict(ci: dict, value: float) -> str:
    """Whether an interval ``{"lo", "hi"}`` resolves a ``>= value`` target at all."""
    return ("above it" if ci["lo"] >= value else "below it" if ci["hi"] < value
            else "spans it: unresolved")


def target_lines(results: Sequence[PolicyResult], targets: Sequence[Target], *,
                 figures: Optional[Figures] = None) -> list[str]:
    """One plain line per judged target (short enough for an 80-column terminal)."""
    out = []
    for t in check_targets(results, targets, figures=figures):
        if t["met"] is None:
            continue
        unit = "" if t["kind"] == "saving" else "x"
        on_mean = (f"; mean {t['measured_mean']:.2f}{unit} {'met' if t['met_on_mean'] else 'missed'}"
                   if t.get("measured_mean") is not None else "")
        spread = (f"; trials {t['trial_min']:.2f}..{t['trial_max']:.2f}"
                  if t.get("trial_min") is not None else "")
        ci = t.get("ci")
        if ci:  # does this run resolve the target at all?
            spread += (f"; mean's {ci['level']:.0%} CI {ci['lo']:.2f}..{ci['hi']:.2f} "
                       f"{ci_verdict(ci, t['value'])}")
        out.append(f"target {t['target']}: {t['measured']:.2f}{unit} (p50) -> "
                   f"{'met' if t['met'] else 'MISSED'}{on_mean}{spread}")
        a = t.get("speed_adjusted")
        if a and a["measured"] is not None:
            aci = a.get("ci")
            am = a.get("measured_mean")
            # the p50 point and the mean's interval can disagree (0.64 beside 0.65..0.94):
            # the mean the interval is about is printed beside it
            out.append(f"  speed-adjusted (bench.speed): {a['measured']:.2f} (p50)"
                       + (f", mean {am:.2f}" if am is not None else "")
                       + (f"; mean's {aci['level']:.0%} CI {aci['lo']:.2f}..{aci['hi']:.2f}" if aci else ""))
            odd = a.get("steps_unlike_oracle")
            if odd:
                out.extend(f"  caveat: {c['policy']}'s decode steps {c['ratio']:.3f}x the oracle's "
                           f"({CI_LEVEL:.0%} CI {c['lo']:.3f}..{c['hi']:.3f})" for c in odd)
                out.append("    more than the processes' luck; the adjustment credits it as luck")
    return out


def work_differences(results: Sequence[PolicyResult], reference: Optional[str] = None) -> list[dict]:
    """The questions (a PEER run's ``answers``) on which a policy ran other work than the
    reference (the oracle when it ran, else the first column): other calls or other output
    tokens. Greedy decoding in bf16 depends on what shares a batch, so an answer can diverge
    between policies, and that question's latency then compares different work (RESULTS.md
    §6.59). Answers stored before they carried ``calls`` / ``output_tokens`` compare as equal."""
    work = {r.policy: [(a.get("question"), a.get("calls"), a.get("output_tokens"))
                       for a in r.workload.get("answers") or []] for r in results}
    if not results or not any(work.values()):
        return []
    ref = reference or ("oracle" if "oracle" in work else results[0].policy)
    out = []
    for r in results:
        if r.policy == ref:
            continue
        for (q, calls, toks), (q0, calls0, toks0) in zip(work[r.policy], work.get(ref, [])):
            if q != q0 or None in (calls, toks, calls0, toks0) or (calls, toks) == (calls0, toks0):
                continue
            out.append({"policy": r.policy, "question": q, "calls": calls, "output_tokens": toks,
                        "reference": ref, "reference_calls": calls0,
                        "reference_output_tokens": toks0})
    return out


def work_lines(results: Sequence[PolicyResult]) -> list[str]:
    """One line per policy whose answers diverged from the reference's (:func:`work_differences`)."""
    diff = work_differences(results)
    if not diff:
        return []
    by: dict = {}
    for d in diff:
        by.setdefault(d["policy"], []).append(
            f"{d['question']} ({d['output_tokens'] - d['reference_output_tokens']:+d} output tokens"
            + ("" if d["calls"] == d["reference_calls"]
               else f", {d['calls']} calls against {d['reference_calls']}") + ")")
    out = [f"work: {p}'s answers differ from {diff[0]['reference']}'s on {', '.join(qs)}"
           for p, qs in by.items()]
    out.append("  greedy decoding depends on what shares a batch: those questions' latencies "
               "compare other work (--server-flag=--deterministic: the same work)")
    return out


def print_report(console, results: Sequence[PolicyResult], *, title: str,
                 targets: Sequence[Target] = (), wide: bool = False,
                 figures: Optional[Figures] = None, meta: Optional[dict] = None) -> None:
    """The table, the oracle's bound, the host link's floor (with ``meta``: a workflow run's
    workload and pools, :mod:`.link_floor`), the target lines and the caveats."""
    fig = figures if figures is not None else Figures(results)
    console.print(render_table(results, title, wide=wide, figures=fig, width=console.width))
    oracle = ratios(results).get("oracle", {})
    bound = oracle.get("speedup_vs_lru")
    if bound:
        hb = oracle.get("speedup_vs_hicache")
        console.print(f"bound: the oracle (unbounded device memory, no load) is {bound:.2f}x lru"
                      + (f", {hb:.2f}x hicache" if hb else "") + " (p50); no policy on this engine "
                      "and workload can exceed that")
    for line in floor_lines(meta or {}, results):
        console.print(f"[dim]{line}[/]", highlight=False)
    for line in target_lines(results, targets, figures=fig):
        color = "dim" if line.startswith(" ") else "green" if "-> met" in line else "red"
        console.print(f"[{color}]{line}[/]", highlight=False)
    if fig.speed_withheld:
        console.print(f"[dim]{fig.speed_withheld}[/]", highlight=False)
    for line in work_lines(results):
        console.print(f"[{'dim' if line.startswith(' ') else 'yellow'}]{line}[/]", highlight=False)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m kvflow_agents.bench.report RESULT.json``: the table as Markdown."""
    import sys

    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as f:
            doc = json.load(f)
        _, res, targets = from_json(doc)
        fig = Figures(res)
        print(plain_table(res, figures=fig))
        lines = target_lines(res, targets, figures=fig) if targets else [
            f"target {t['target']}: {t['measured']:.2f} (p50) -> {'met' if t['met'] else 'MISSED'}"
            for t in doc.get("targets") or [] if t.get("measured") is not None]
        lines += floor_lines(doc, res)
        for line in lines + ([fig.speed_withheld] if fig.speed_withheld else []):
            print(f"\n- {line}")


if __name__ == "__main__":  # pragma: no cover
    main()
