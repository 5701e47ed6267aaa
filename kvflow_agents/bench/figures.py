"""A run's bootstrapped figures, computed once and shared by the report's table, its target lines
and its JSON (:mod:`.report`, :mod:`.report_rows`): the achievable saving (:mod:`.stats`), the
speed adjustment (:mod:`.speed`) and each policy's per-trial latency over the oracle's."""

from __future__ import annotations

from functools import cached_property
from typing import Optional, Sequence

from . import speed
from .runner import PolicyResult
from .stats import saving_ratios


class Figures:
    """The bootstrapped figures of one run (each a seeded 4,000-resample bootstrap per policy
    and baseline), each computed at most once, when first asked for, so the table, the target
    lines and the JSON of a report share them. Seeded: sharing changes no number."""

    def __init__(self, results: Sequence[PolicyResult]):
        self.results = results

    @cached_property
    def saving(self) -> dict:
        """:func:`.stats.saving_ratios` against the oracle."""
        return saving_ratios(self.results)

    @cached_property
    def saving_same_pool(self) -> dict:
        """:func:`.stats.saving_ratios` against the pool oracle (``{}`` without its column)."""
        return saving_ratios(self.results, oracle="oracle-pool")

    @cached_property
    def adjusted(self) -> Optional[speed.AdjustedRun]:
        """:func:`.speed.adjusted_run` (``None`` without per-trial decode speeds)."""
        return speed.adjusted_run(self.results, self.speed_fit)  # (one fit per run)

    @cached_property
    def speed(self) -> Optional[dict]:
        """:func:`.speed.speed_summary` (``None`` without per-trial decode speeds, or a fit too
        imprecise to use: :attr:`speed_fit`)."""
        return speed.speed_summary(self.results, self.adjusted)

    @cached_property
    def speed_fit(self) -> Optional[speed.ElasticityFit]:
        """:func:`.speed.fit_elasticity`, used or not (``None``: no per-trial decode speeds)."""
        return speed.fit_elasticity(self.results)

    @property
    def speed_withheld(self) -> Optional[str]:
        """Why a run with per-trial speeds shows no adjusted figures (``None``: it shows them,
        or it has no speeds)."""
        fit = self.speed_fit
        return fit.withheld_line() if fit is not None and not fit.usable else None

    @cached_property
    def latency_vs_oracle(self) -> dict:
        """Per policy, its per-trial latency over the oracle's, raw and speed-adjusted
        (:func:`.speed.paired_ratio`): ``{"raw": {policy: ...}, "adjusted": {policy: ...}}``."""
        if self.speed:
            return {"raw": self.speed["latency_vs_oracle"],
                    "adjusted": self.speed["latency_vs_oracle_adjusted"]}
        return {"raw": {r.policy: speed.paired_ratio(self.results, r.policy)
                        for r in self.results if r.policy != "oracle"}, "adjusted": {}}
