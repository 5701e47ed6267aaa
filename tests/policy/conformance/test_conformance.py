"""The conformance suite: one trace (``conformance_trace.py``), every engine, the same answers.

Here: the policy core itself (the reference), the embedded engine (tiny-random, real model
and paged KV pool) and the simulator. SGLang's real ``UnifiedRadixCache`` runs the same trace
in ``tests/sglang/test_conformance.py`` (its own venv; ``make test`` runs both).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from conformance_trace import (AGENTS, DEVICE_PAGES, DYNAMIC, FIXED, HOST_PAGES, PAGE, WORKFLOW,
                               compare, hints, observe, run_reference, trace)


@pytest.fixture(scope="module")
def reference():
    return run_reference()


def test_reference_shows_what_kvflow_promises(reference):
    """The core's answer is worth conforming to: after the first round every request in the
    cycle finds its prefix on device; a prefix leaves the device only when its agent runs
    last of those on device (largest STE); one comes back from host only for the agent that
    runs next (STE 1: a prefetch) or for its own request (a demand load); the out-of-order
    request for C (evicted last) is a host hit."""
    assert all(o.device_hit == FIXED and o.host_hit == 0 for o in reference[4:12])
    reqs = trace()
    for prev, o, r in zip(reference, reference[1:], reqs[1:]):
        before, after = dict(prev.residency), dict(o.residency)
        on_device = [a for a in AGENTS if before[a] == "device" and a != r.agent]
        for a in AGENTS:
            if before[a] == "device" and after[a] == "host":  # evicted during request r
                assert r.ste[a] == max(r.ste[x] for x in on_device), (r, o.row())
            if before[a] == "host" and after[a] == "device" and a != r.agent:
                assert r.ste[a] == 1, (r, o.row())   # prefetched for the next agent
    assert reference[-1].prefetched == 4
    c_again = reference[12]
    assert c_again.agent == "C" and c_again.host_hit == FIXED and c_again.device_hit == 0


def test_simulator_conforms(reference):
    from kvflow_agents.serving.sim import Simulator, load_profile
    from kvflow_agents.serving.sim.workloads import Call, Step, Workload, WorkflowPlan

    steps = [Step([Call(r.agent, r.agent, FIXED, DYNAMIC, 0)], dict(r.ste)) for r in trace()]
    wl = Workload("conformance", [WorkflowPlan(WORKFLOW, steps)], page_size=PAGE,
                  device_tokens=DEVICE_PAGES * PAGE, host_tokens=HOST_PAGES * PAGE)
    # instant host link, like the other engines here: a started load lands at once
    prof = dataclasses.replace(load_profile("llama-3.1-8b-a10g"), link_gbps=None, link_alpha_s=0.0)
    reqs = iter(trace())
    seen = []

    class Observed(Simulator):
        def _finish(self, r):  # observed before the last one ends the workflow (tags dropped)
            s, mgr = r.session, self.mgr
            seen.append(observe(next(reqs), s.device_hit, s.host_hit, mgr.snapshot()["agents"],
                                mgr.metrics.prefetch_issued))
            super()._finish(r)

    sim = Observed(prof, wl, "kvflow")
    sim.mgr.store.partial_eviction = False  # whole nodes, as SGLang evicts
    sim.run()
    sim.mgr.check_invariants()
    compare("simulator", seen, reference)


def _observe_after_loads_land(e):
    """On the engine thread: the reference's link is instant (a started load lands at once);
    here a prefetch started in the step that finished the request is still copying, and lands
    at the next step's tick, which the observation could otherwise beat (a race CI once lost:
    C "loading" where the core says "device"). Land it as that tick would, then look."""
    e.pool.synchronize()
    e.manager.tick(e.pool.now(), prefetch=False)
    return e.manager.snapshot(), e.manager.metrics.prefetch_issued


def test_embedded_engine_conforms(reference):
    pytest.importorskip("torch")
    from kvflow_agents.serving.embedded.engine import Engine, SamplingParams

    with Engine(model="tiny-random", policy="kvflow", page_size=PAGE,
                device_tokens=DEVICE_PAGES * PAGE, host_tokens=HOST_PAGES * PAGE) as eng:
        eng.call(lambda e: setattr(e.manager.store, "partial_eviction", False))
        seen = []
        for r in trace():
            done = threading.Event()
            box = []

            def sink(ev, box=box, done=done):
                if ev.done is not None:
                    box.append(ev.done)
                    done.set()
            req = eng.make_request(prompt_ids=r.tokens, hints=hints(r), sink=sink,
                                   params=SamplingParams(max_tokens=1, ignore_eos=True))
            req.fixed_len = FIXED  # what kvflow_fixed_messages gives a chat request
            eng.submit(req)
            assert done.wait(60), f"request {r.index} did not finish"
            comp = box[0]
            assert comp.finish_reason == "length", comp
            snap = eng.call(_observe_after_loads_land)
            seen.append(observe(r, comp.device_hit_tokens, comp.host_hit_tokens, snap[0]["agents"],
                                snap[1]))
        eng.call(lambda e: e.manager.check_invariants())
    compare("embedded engine", seen, reference)
