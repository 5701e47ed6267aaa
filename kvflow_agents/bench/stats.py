"""The bench report's statistics: latency ratios between policies, the achievable saving with
its per-trial spread and bootstrap interval, and the counter-based cache cost. Numbers only;
:mod:`.report` renders them (table, ``--json``, targets).

Ratios use the workflow latency (one round of the workflow, or one PEER question):
``speedup vs X = latency(X) / latency(policy)`` (higher is better) and
``vs oracle = latency(policy) / latency(oracle)`` (1.0 = the physical limit; lower is better).
They are given for the median (p50) and the mean; targets are judged on the median, which a
noisy neighbour on a shared machine moves least.

**Achievable saving** (:func:`saving_ratios`): ``(baseline - policy) / (baseline - oracle)`` of
the workflow latency, i.e. the share of the time the oracle saves over a baseline (lru or
hicache) that the policy saves too (1.0 = all of it). Besides the pooled value it is computed per
trial (per PEER question), pairing the policies' runs of the same trial, and the spread (min,
median, max) is reported: a ratio of differences is noisy, and the spread says how much. The
mean-based ratio also gets a paired-bootstrap interval over trials (:func:`saving_interval`,
90 %), which says whether a run resolved the target at all. The same ratio on the **cache
cost** (:func:`annotate_cache_cost`: recomputed tokens x the calibrated recompute time per token
+ exposed load time, from counters) does not move with the machine's load, so on a shared box it
says what the policy achieved.
"""

from __future__ import annotations

import math
import random
from statistics import median
from typing import Callable, Optional, Sequence

from .runner import PolicyResult

LATENCY_KEY = "workflow_latency_p50_s"     # what targets are judged on
MEAN_KEY = "workflow_latency_mean_s"
BASELINES = ("lru", "hicache")
CI_LEVEL = 0.90
CI_RESAMPLES = 4000


# ------------------------------------------------------------------------------ ratios
def _lat(results: dict[str, PolicyResult], p: str, key: str = LATENCY_KEY) -> Optional[float]:
    r = results.get(p)
    v = r.workload.get(key) if r is not None else None
    return v if v else None


def ratios(results: Sequence[PolicyResult], key: str = LATENCY_KEY) -> dict[str, dict[str, Optional[float]]]:
    """Per policy: ``speedup_vs_lru`` / ``speedup_vs_hicache`` and ``latency_vs_oracle`` on
    ``key`` (``None`` where a latency is missing)."""
    by = {r.policy: r for r in results}
    out = {}
    for r in results:
        me = _lat(by, r.policy, key)
        row = {}
        for base in BASELINES:
            b = _lat(by, base, key)
            row[f"speedup_vs_{base}"] = b / me if (b and me) else None
        o = _lat(by, "oracle", key)
        row["latency_vs_oracle"] = me / o if (o and me) else None
        out[r.policy] = row
    return out


# ------------------------------------------------------------------------------ the paired bootstrap
def paired_bootstrap(stat: Callable[[list[int]], Optional[float]], n_trials: int, *,
                     level: float = CI_LEVEL, resamples: int = CI_RESAMPLES, seed: int = 0,
                     max_void: float = 0.0, strata: Optional[Sequence[int]] = None
                     ) -> Optional[tuple[float, float]]:
    """A percentile-bootstrap interval ``(lo, hi)`` of ``stat`` over trials resampled whole
    (``stat`` gets the resample's trial indices; whole trials keep the policies' runs of a trial
    paired, so what hit them alike cancels).

    ``strata``: the sizes of consecutive groups of trials (stored runs pooled by ``kvflow bench
    pool``, each on its own box and day); each resample then draws every group's trials from
    that group only, so each run keeps its weight and no resample is all one run's.

    The draws are fixed, and stored figures depend on them: ``random.Random(seed)``, each
    resample drawing its ``n_trials`` indices with ``randrange(n_trials)`` in turn (with
    ``strata``: group after group, ``offset + randrange(size)`` for each of its trials; one
    group is the same draws), resample after resample. A resample whose ``stat`` is ``None`` is
    left out; ``None`` when more than ``max_void`` of them were. The bounds are the sorted kept
    values at ``int(tail * (kept - 1))`` and ``int((1 - tail) * (kept - 1))``,
    ``tail = (1 - level) / 2``."""
    groups = [(0, n_trials)] if strata is None else _groups(strata, n_trials)
    rng, vals, void = random.Random(seed), [], 0
    for _ in range(resamples):
        v = stat([off + rng.randrange(size) for off, size in groups for _ in range(size)])
        if v is None:
            void += 1
        else:
            vals.append(v)
    if void > max_void * resamples:
        return None
    vals.sort()
    tail = (1 - level) / 2
    return vals[int(tail * (len(vals) - 1))], vals[int((1 - tail) * (len(vals) - 1))]


def _groups(strata: Sequence[int], n_trials: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each stratum; they must cover the ``n_trials`` trials exactly."""
    if any(int(k) < 1 for k in strata) or sum(strata) != n_trials:
        raise ValueError(f"strata {list(strata)} do not partition {n_trials} trials")
    out, off = [], 0
    for k in strata:
        out.append((off, int(k)))
        off += int(k)
    return out


def geometric_mean_interval(ratios: Sequence[float], *, level: float = CI_LEVEL,
                            resamples: int = CI_RESAMPLES, seed: int = 0,
                            strata: Optional[Sequence[int]] = None) -> dict:
    """The geometric mean of per-trial ratios (a policy's trial latency over the reference's)
    with its percentile-bootstrap interval over trials (:func:`paired_bootstrap`; ``strata`` as
    there): ``{"ratio", "lo", "hi", "level", "trials"}``. A mean of logs is never void, so
    there is always an interval (the ratio itself for one trial)."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    if not n:
        raise ValueError("no trials")
    lo, hi = paired_bootstrap(lambda idx: sum(logs[i] for i in idx) / n, n, level=level,
                              resamples=resamples, seed=seed, strata=strata)
    return {"ratio": math.exp(sum(logs) / n), "lo": math.exp(lo), "hi": math.exp(hi),
            "level": level, "trials": n}


# ------------------------------------------------------------------------------ achievable saving
def _saving(base: Optional[float], me: Optional[float], oracle: Optional[float]) -> Optional[float]:
    """``(base - me) / (base - oracle)``; ``None`` when a value is missing or the oracle saves
    nothing over the baseline (then there is no saving to capture)."""
    if not (base and me and oracle) or base - oracle <= 0:
        return None
    return (base - me) / (base - oracle)


def _trials(r: Optional[PolicyResult]) -> dict:
    return {int(t): v for t, v in ((r.workload.get("workflow_latency_trials_s") or []) if r else [])}


def _spread(xs: Sequence[float]) -> dict:
    xs = sorted(xs)
    return {"min": xs[0], "median": median(xs), "max": xs[-1]} if xs else {"min": None, "median": None,
                                                                             "max": None}


def saving_interval(trials: Sequence[tuple[float, float, float]], *, level: float = CI_LEVEL,
                    resamples: int = CI_RESAMPLES, seed: int = 0,
                    strata: Optional[Sequence[int]] = None) -> Optional[dict]:
    """A paired percentile-bootstrap interval (:func:`paired_bootstrap`) for the mean-based
    saving ratio ``(sum(base) - sum(me)) / (sum(base) - sum(oracle))`` over trials given as
    ``(base, me, oracle)`` latencies of the same trial (a PEER question, a workflow trial).

    Why: the per-trial ratios' spread overstates the uncertainty (a trial whose oracle saves
    little divides by almost nothing) and the pooled ratio alone hides it. Resampling whole
    trials keeps each trial's three policies paired, so the machine's drift, which hits them
    alike, cancels. Deterministic (seeded). ``None`` with fewer than 3 trials, or when more than
    5 % of the resamples have no saving to capture (the oracle's lead is not resolved).
    ``strata``: trials of several runs, resampled within each (:func:`paired_bootstrap`)."""
    if len(trials) < 3:
        return None

    def mean_ratio(idx: list[int]) -> Optional[float]:
        b = m = o = 0.0
        for i in idx:   # summed in draw order, as the stored intervals were
            tb, tm, to = trials[i]
            b, m, o = b + tb, m + tm, o + to
        return (b - m) / (b - o) if b - o > 0 else None

    ci = paired_bootstrap(mean_ratio, len(trials), level=level, resamples=resamples, seed=seed,
                          max_void=0.05, strata=strata)
    if ci is None:
        return None
    return {"level": level, "lo": ci[0], "hi": ci[1], "resamples": resamples}


def saving_ratios(results: Sequence[PolicyResult], oracle: str = "oracle") -> dict[str, dict[str, dict]]:
    """Per policy (not lru, not the reference) and baseline (lru, hicache; not itself):
    ``ratio`` (pooled p50s), ``ratio_mean`` (pooled means), ``trials`` ([trial, ratio] from each
    trial's p50s, policies paired per trial) and their ``min`` / ``median`` / ``max``, and
    ``ci`` (:func:`saving_interval` over the paired trials: ``lo`` / ``hi``, or ``None``).
    ``oracle``: the reference (``"oracle-pool"``: the best latency with the same pool for
    running requests; the ``oracle-pool`` column against ``"oracle"`` is the share of the
    unbounded oracle's saving that any policy could take with this pool).

    One bootstrap per policy and baseline: a report computes this once per reference and hands
    it on (:class:`.figures.Figures`)."""
    by = {r.policy: r for r in results}
    if oracle not in by:
        return {}
    out: dict[str, dict[str, dict]] = {}
    o_tr = _trials(by[oracle])
    for r in results:
        # lru is the floor every baseline improves on; the unbounded oracle is no contender
        if r.policy in (oracle, "oracle", "lru"):
            continue
        row = {}
        for base in BASELINES:
            if base not in by or base == r.policy:
                continue
            b_tr, me_tr = _trials(by[base]), _trials(r)
            paired = sorted(set(b_tr) & set(me_tr) & set(o_tr))
            per = [[t, v] for t in paired if (v := _saving(b_tr[t], me_tr[t], o_tr[t])) is not None]
            row[base] = {"ratio": _saving(_lat(by, base), _lat(by, r.policy), _lat(by, oracle)),
                         "ratio_mean": _saving(_lat(by, base, MEAN_KEY), _lat(by, r.policy, MEAN_KEY),
                                               _lat(by, oracle, MEAN_KEY)),
                         "trials": per, **_spread([v for _, v in per]),
                         "ci": saving_interval([(b_tr[t], me_tr[t], o_tr[t]) for t in paired])}
        if row:
            out[r.policy] = row
    return out


# ------------------------------------------------------------------------------ cache cost
def annotate_cache_cost(results: Sequence[PolicyResult], meta: dict) -> Optional[float]:
    """Set each policy's ``cache_cost_s``: the time its cache decisions cost, from counters
    rather than clocks (so a noisy neighbour does not move it): recomputed prompt tokens x the
    calibrated recompute seconds per token + load time requests were exposed to (the server's
    ``load_exposed_s``). Returns the seconds per token used (``None``: no calibration)."""
    cal = meta.get("calibration") or {}
    if not cal.get("recompute_s") or not cal.get("prefix_tokens"):
        return None
    spt = cal["recompute_s"] / cal["prefix_tokens"]
    for r in results:
        w = r.workload
        if w.get("miss_rate") is None or not w.get("prompt_tokens"):
            continue
        exposed = (r.server or {}).get("load_exposed_s") or 0.0
        w["cache_cost_s"] = w["miss_rate"] * w["prompt_tokens"] * spt + exposed
    return spt


def cost_saving(results: Sequence[PolicyResult]) -> dict[str, dict[str, Optional[float]]]:
    """The achievable saving on ``cache_cost_s`` (counter-based; see :func:`annotate_cache_cost`).
    The reference is the oracle, else the pool oracle: neither evicts, so their cache costs are
    the same (only compulsory misses)."""
    by = {r.policy: r.workload.get("cache_cost_s") for r in results}
    ref = next((o for o in ("oracle", "oracle-pool") if by.get(o) is not None), None)
    if ref is None:
        return {}
    out: dict = {}
    for r in results:
        if r.policy in ("oracle", "oracle-pool", "lru") or by.get(r.policy) is None:
            continue
        out[r.policy] = {b: (None if by.get(b) is None or by[b] - by[ref] <= 0 else
                             (by[b] - by[r.policy]) / (by[b] - by[ref]))
                         for b in BASELINES if b != r.policy and b in by}
    return out
