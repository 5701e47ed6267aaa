"""The async client that drives ``spec.workflows`` instances of the synthetic workflow
(``bench/workload.py``) against one server: :class:`WorkflowDriver` runs it whole,
:class:`DriverSession` in parts (warm-up, one measured round at a time, end), for a runner
that interleaves several servers' rounds (``kvflow bench workflow --interleave round``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from typing import Any, Awaitable, Callable, Optional

from .workload import (CallRecord, Prompts, RoundRecord, TokenCounter, WorkloadResult, WorkloadSpec,
                       build_graph, chat_call, post_end, steps)


class WorkflowDriver:
    """Drives ``spec.workflows`` concurrent workflow instances against one server."""

    def __init__(self, spec: WorkloadSpec, base_url: str, model: str, *, counter: TokenCounter,
                 api_key: Optional[str] = None, hints: bool = True, stream: bool = True,
                 run_id: str = "", trial: int = 0,
                 on_call: Optional[Callable[[CallRecord], None]] = None,
                 extra: Optional[dict] = None) -> None:
        spec.validate()
        self.spec, self.base_url, self.model = spec, base_url, model
        self.prompts = Prompts(spec, counter, trial)
        self.graph = build_graph(spec)
        from .hint_modes import HintMangler

        self.api_key = api_key
        self.send_hints = hints and spec.hints != "none"
        self.mangle = HintMangler(spec.hints, seed=spec.seed, lag=spec.hint_lag)
        self.stream = stream
        self.run_id = run_id or f"{int(time.time() * 1000) % 10**8}"
        self.trial = trial
        self.on_call = on_call
        self.extra = extra    # added to every request body (e.g. an engine's report switches)

    def workflow_id(self, w: int) -> str:
        return f"bench-{self.run_id}-wf{w}"

    def _client(self):
        import kvflow_agents as kvflow
        from kvflow_agents.transport import default_http_library

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits_mod = importlib.import_module(default_http_library())
        n = max(8, 2 * self.spec.workflows * max(len(s) for s in steps(self.spec)))
        return kvflow.async_http_client(headers=headers, trust_env=False,
                                        limits=limits_mod.Limits(max_connections=n,
                                                                 max_keepalive_connections=n))

    async def run(self, between: Optional[Callable[[], Awaitable[None]]] = None,
                  end: bool = True) -> WorkloadResult:
        """Warm-up rounds, then ``between()`` (e.g. snapshot server counters), then the measured
        rounds, all workflows concurrently; a barrier separates the two phases. ``end=False``
        leaves the workflows open (another client continues them)."""
        async with self.session() as s:
            await s.warmup()
            if between is not None:
                await between()
            await s.measured()
            if end:
                await s.end()
        return s.result

    def session(self) -> "DriverSession":
        """The same run in parts, for a runner that interleaves several servers' rounds
        (``kvflow bench workflow --interleave round``)."""
        return DriverSession(self)

    def hints_for(self, tracker, w: int, agent: str):
        """The hints this request carries: the tracker's, or their ``spec.hints`` corruption."""
        from kvflow_agents.protocol import Hints

        return self.mangle(Hints(workflow=self.workflow_id(w), agent=agent, step=tracker.step,
                                 ste=tracker.ste(), next=tracker.next_agents(), app=self.spec.app,
                                 fixed_messages=1))

    async def _rounds(self, client, tracker, w: int, r0: int, r1: int, measured: bool,
                      result: WorkloadResult) -> None:
        for rnd in range(r0, r1):
            t0 = time.perf_counter()
            for group in steps(self.spec):
                for a in group:
                    tracker.start(a)
                hs = [self.hints_for(tracker, w, a) for a in group]
                recs = await asyncio.gather(*(self._call(client, tracker, w, rnd, a, h, measured)
                                              for a, h in zip(group, hs)))
                for a in group:
                    tracker.finish(a)
                result.calls.extend(recs)
            result.rounds.append(RoundRecord(w, rnd, measured, t0, time.perf_counter() - t0,
                                             trial=self.trial))

    async def _call(self, client, tracker, w: int, rnd: int, agent: str, h, measured: bool) -> CallRecord:
        import kvflow_agents as kvflow

        rec = CallRecord(workflow=w, round=rnd, agent=agent, step=tracker.step, measured=measured,
                         start=0.0, ttft_s=0.0, latency_s=0.0, trial=self.trial)
        msgs = self.prompts.messages(w, rnd, agent)
        with kvflow.hints(h) if self.send_hints else contextlib.nullcontext():
            await chat_call(client, self.base_url, self.model, msgs, max_tokens=self.spec.output,
                            stream=self.stream, extra=self.extra, rec=rec)
        if self.on_call is not None:
            self.on_call(rec)
        return rec


class DriverSession:
    """One :class:`WorkflowDriver` run, step by step: its HTTP client and workflow trackers
    live from ``async with`` to its end, so a runner can run the warm-up, then one measured
    round at a time (each a barrier across the driver's workflows), then end the workflows.
    ``result.measured_s`` sums the measured rounds' wall time."""

    def __init__(self, driver: WorkflowDriver) -> None:
        self.driver = driver
        self.result = WorkloadResult()
        self._client_cm: Any = None
        self._client: Any = None
        self._trackers: list = []

    async def __aenter__(self) -> "DriverSession":
        d = self.driver
        self._trackers = [d.graph.tracker(d.workflow_id(w)) for w in range(d.spec.workflows)]
        self._client_cm = d._client()
        self._client = await self._client_cm.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client_cm.__aexit__(*exc)

    async def _span(self, r0: int, r1: int, measured: bool) -> None:
        d = self.driver
        t0 = time.perf_counter()
        await asyncio.gather(*(d._rounds(self._client, self._trackers[w], w, r0, r1, measured,
                                         self.result) for w in range(d.spec.workflows)))
        if measured:
            self.result.measured_s += time.perf_counter() - t0

    async def warmup(self) -> None:
        if self.driver.spec.warmup_rounds:
            await self._span(0, self.driver.spec.warmup_rounds, False)

    async def measured(self) -> None:
        """Every measured round, each workflow running on through them (no barrier between)."""
        w0 = self.driver.spec.warmup_rounds
        await self._span(w0, w0 + self.driver.spec.rounds, True)

    async def measured_round(self, k: int) -> None:
        """Measured round ``k`` (0-based) of every workflow, then a barrier."""
        w0 = self.driver.spec.warmup_rounds
        await self._span(w0 + k, w0 + k + 1, True)

    async def end(self) -> None:
        """End every workflow (``end`` hint to the server)."""
        d = self.driver
        for w, tr in enumerate(self._trackers):
            tr.end()
            if d.send_hints:
                from kvflow_agents.protocol import Hints
                await post_end(self._client, d.base_url,
                               Hints(workflow=d.workflow_id(w), agent=d.spec.agent_names()[-1],
                                     step=tr.step, app=d.spec.app), d.model)
