"""Speed-adjusted trial latencies: comparing trials that ran on processes of different speed.

Why: on this box one serving process runs up to ~20 % faster or slower than another started
from the same code (RESULTS.md §6.22, §6.25), so even fresh servers per trial leave per-trial
ratios between policies spread by +-7 % (12 trials of 8 workflows), wider than the differences
issue #16 asks about. Each server reports the model's seconds per batched decode step
(``decode_step_trials_s``, from the engine's ``decode_forward_s`` / ``decode_steps``): work
every policy does alike, so it measures how fast that process ran. Over 12 such trials it
explained ~94 % of the variance of kvflow / oracle (correlation 0.97, RESULTS.md §6.32).

The model (a covariate adjustment, as CUPED does for A/B tests), per policy ``p`` and trial
``t``::

    log latency[p, t] = a[p] + b[t] + beta * log speed[p, t] + noise

``beta`` is fitted within trials and policies (both demeaned), then each latency is moved to
the run's mean speed: ``latency * exp(-beta * (log speed - mean log speed))``. The policies'
effects ``a[p]`` are untouched; what the adjustment removes is the part of the spread that
follows the process's speed.

The caveat: whatever moves the model's decode time is taken for the process's speed, including
a policy's own effect on the forwards (copies competing for the two cores, a batch composed
differently). :func:`speed_ratios` (a policy's mean speed over the reference's) shows how far
that goes, and ``speed_summary``'s ``speed_vs_oracle_ci`` whether it is more than luck: the
more memory a policy moves between its decode steps, the slower they run on a CPU. On the
8-workflow cycle hicache's ran 1.07-1.11x the oracle's in three runs and kvflow's 1.01-1.03x,
in the paper regime 1.09x and 1.03x (bench/RESULTS.md §6.48), and the adjustment credits them
for it; kvflow's credit, small as it is, lifts its share of the oracle's saving most, since
kvflow is close to the oracle. The report names under the adjusted saving each policy whose
offset is beyond luck; the raw figures stay beside the adjusted ones, and targets are judged
on the raw ones. A probe timed at each server's start does not replace the decode steps: it
did not follow the trials (§6.48). The bootstrap intervals over adjusted trials hold ``beta``
fixed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import mean, median
from typing import Optional, Sequence

from .runner import PolicyResult
from .stats import CI_LEVEL, CI_RESAMPLES, geometric_mean_interval, saving_ratios

MIN_TRIALS = 3
# The widest standard error of the elasticity whose adjustment is shown: +-1.645 x 0.3 ~ +-0.5
# at 90 %, which on processes ~10 % apart moves an adjusted ratio by up to ~5 %, the size of
# what the runs compare. 16-trial workflow runs fit to 0.03-0.05; PEER's 4 questions to 0.24
# once and to 0.56 (beta 1.83) the next time (RESULTS.md §6.35).
MAX_BETA_SE = 0.3


def _panel(results: Sequence[PolicyResult]) -> tuple[list[str], list[int], dict]:
    """``(policies, trials, {(p, t): (log latency, log speed)})`` over the trials every policy
    has both figures for (a balanced panel)."""
    cells: dict[str, dict[int, tuple[float, float]]] = {}
    for r in results:
        lat = {int(t): v for t, v in r.workload.get("workflow_latency_trials_s") or [] if v}
        spd = {int(t): v for t, v in r.workload.get("decode_step_trials_s") or [] if v}
        cells[r.policy] = {t: (math.log(lat[t]), math.log(spd[t])) for t in lat.keys() & spd.keys()}
    trials = sorted(set.intersection(*(set(c) for c in cells.values()))) if cells else []
    pols = [r.policy for r in results]
    return pols, trials, {(p, t): cells[p][t] for p in pols for t in trials}


@dataclass(frozen=True)
class ElasticityFit:
    """The fitted elasticity ``beta``, its standard error (residuals over the within-trial,
    within-policy degrees of freedom) and the trials it was fitted on."""
    beta: float
    se: float
    trials: int

    @property
    def usable(self) -> bool:
        """Precise enough for adjusted figures to be shown (:data:`MAX_BETA_SE`)."""
        return self.se <= MAX_BETA_SE

    def as_dict(self) -> dict:
        return {"beta": self.beta, "se": self.se, "trials": self.trials, "used": self.usable}

    def withheld_line(self) -> str:
        return (f"speed adjustment withheld: elasticity {self.beta:.2f} +- {self.se:.2f} (standard "
                f"error) over {self.trials} trials; shown when the error is <= {MAX_BETA_SE}")


def fit_beta(results: Sequence[PolicyResult]) -> Optional[float]:
    """:func:`fit_elasticity`'s ``beta`` where it is :attr:`~ElasticityFit.usable`, else
    ``None``."""
    fit = fit_elasticity(results)
    return fit.beta if fit is not None and fit.usable else None


def fit_elasticity(results: Sequence[PolicyResult]) -> Optional[ElasticityFit]:
    """The elasticity of trial latency to the process's speed, within trials and policies;
    ``None`` with fewer than :data:`MIN_TRIALS` common trials or no spread in speed."""
    pols, trials, cell = _panel(results)
    if len(trials) < MIN_TRIALS or len(pols) < 2:
        return None
    n = len(pols) * len(trials)
    grand = [sum(cell[p, t][i] for p in pols for t in trials) / n for i in (0, 1)]
    by_p = {p: [mean(cell[p, t][i] for t in trials) for i in (0, 1)] for p in pols}
    by_t = {t: [mean(cell[p, t][i] for p in pols) for i in (0, 1)] for t in trials}

    def within(p: str, t: int, i: int) -> float:
        return cell[p, t][i] - by_p[p][i] - by_t[t][i] + grand[i]
    xy = [(within(p, t, 1), within(p, t, 0)) for p in pols for t in trials]
    sxx = sum(x * x for x, _ in xy)
    if sxx <= 0:
        return None
    beta = sum(x * y for x, y in xy) / sxx
    df = (len(pols) - 1) * (len(trials) - 1) - 1  # (the effects of policies and trials, beta)
    rss = sum((y - beta * x) ** 2 for x, y in xy)
    se = math.sqrt(rss / df / sxx) if df > 0 else math.inf
    return ElasticityFit(beta, se, len(trials))


def adjusted(results: Sequence[PolicyResult],
             fit: Optional[ElasticityFit] = None) -> Optional[list[PolicyResult]]:
    """Copies of ``results`` whose trial latencies are moved to the run's mean speed (module
    doc), with ``workflow_latency_p50_s`` / ``_mean_s`` the median / mean of those trials and
    ``speed_beta`` / ``speed_beta_se`` set; ``None`` when :func:`fit_beta` has no usable fit.
    Only the trials every policy has a speed for are kept. ``fit``: :func:`fit_elasticity` of
    ``results`` where the caller has it."""
    fit = fit if fit is not None else fit_elasticity(results)
    if fit is None or not fit.usable:
        return None
    beta = fit.beta
    pols, trials, cell = _panel(results)
    mean_log_speed = mean(cell[p, t][1] for p in pols for t in trials)
    out = []
    for r in results:
        per = [[t, math.exp(cell[r.policy, t][0] - beta * (cell[r.policy, t][1] - mean_log_speed))]
               for t in trials]
        vals = [v for _, v in per]
        w = {**r.workload, "workflow_latency_trials_s": per, "workflow_latency_p50_s": median(vals),
             "workflow_latency_mean_s": mean(vals), "speed_beta": beta,
             "speed_beta_se": fit.se}
        out.append(dataclasses.replace(r, workload=w, raw=None))
    return out


def speed_ratios(results: Sequence[PolicyResult], reference: str = "oracle") -> dict[str, float]:
    """Per policy, its geometric-mean decode-step time over the reference's on the common trials
    (1.0: the forwards ran at the same speed; above: slower, whether by the process's luck or
    the policy's own doing)."""
    pols, trials, cell = _panel(results)
    if reference not in pols or not trials:
        return {}
    return {p: math.exp(mean(cell[p, t][1] - cell[reference, t][1] for t in trials)) for p in pols}


def paired_ratio(results: Sequence[PolicyResult], policy: str, reference: str = "oracle", *,
                 level: float = CI_LEVEL, resamples: int = CI_RESAMPLES, seed: int = 0,
                 key: str = "workflow_latency_trials_s") -> Optional[dict]:
    """Geometric mean over trials of ``policy``'s trial latency over ``reference``'s, with a
    percentile-bootstrap interval over trials (:func:`.stats.geometric_mean_interval`): ``{"ratio",
    "lo", "hi", "level", "trials"}``. Give it :func:`adjusted` results for the speed-adjusted
    ratio; ``key="decode_step_trials_s"`` for the decode-step times' (:func:`speed_summary`)."""
    by = {r.policy: {int(t): v for t, v in r.workload.get(key) or [] if v}
          for r in results}
    if policy not in by or reference not in by:
        return None
    ts = sorted(by[policy].keys() & by[reference].keys())
    if len(ts) < MIN_TRIALS:
        return None
    return geometric_mean_interval([by[policy][t] / by[reference][t] for t in ts], level=level,
                                   resamples=resamples, seed=seed)


@dataclass(frozen=True)
class AdjustedRun:
    """A run moved to its mean process speed (:func:`adjusted`) and the achievable saving on
    it (:func:`.stats.saving_ratios`: a seeded bootstrap per policy and baseline, so a report
    computes this once and hands it to each part that shows it)."""
    results: list[PolicyResult]
    saving: dict


def adjusted_run(results: Sequence[PolicyResult],
                 fit: Optional[ElasticityFit] = None) -> Optional[AdjustedRun]:
    """:func:`adjusted` and its saving; ``None`` when :func:`fit_beta` has no usable fit."""
    adj = adjusted(results, fit)
    return None if adj is None else AdjustedRun(adj, saving_ratios(adj))


def speed_summary(results: Sequence[PolicyResult], run: Optional[AdjustedRun] = None) -> Optional[dict]:
    """What this module makes of a run (``None`` without per-trial decode speeds): the fitted
    elasticity, each policy's decode-step time over the oracle's, its per-trial latency over the
    oracle's raw and speed-adjusted (geometric mean, 90 % bootstrap interval), and the
    achievable saving on the adjusted trials. ``run``: :func:`adjusted_run` of ``results`` where
    the caller has it; left out (or ``None``), it is computed here, which without a fit costs
    only the fit."""
    run = run if run is not None else adjusted_run(results)
    if run is None:
        return None
    adj, ref = run.results, "oracle"
    return {"beta": adj[0].workload["speed_beta"], "beta_se": adj[0].workload["speed_beta_se"],
            "trials": len(adj[0].workload["workflow_latency_trials_s"]),
            "speed_vs_oracle": speed_ratios(results, ref),
            # with its interval: one that excludes 1 is more than the processes' luck, and the
            # adjustment credits it all the same (module doc, the caveat)
            "speed_vs_oracle_ci": {r.policy: paired_ratio(results, r.policy, ref, key="decode_step_trials_s")
                                   for r in results if r.policy != ref},
            "latency_vs_oracle": {r.policy: paired_ratio(results, r.policy, ref)
                                  for r in results if r.policy != ref},
            "latency_vs_oracle_adjusted": {r.policy: paired_ratio(adj, r.policy, ref)
                                           for r in adj if r.policy != ref},
            "saving": run.saving}
