"""Hint trust: a workflow whose hints do not predict its next agent is treated as sending none
(every agent +inf: LRU order, no prefetch); correct hints are never distrusted."""

from __future__ import annotations

import pytest

from kvflow_agents.serving.policy.hints import HintRegistry
from policy_driver import make_manager, put

INF = float("inf")
AGENTS = [f"a{i}" for i in range(5)]


def _cycle(i: int, reverse: bool = False) -> dict:
    """The STE map when agent i runs in a 5-cycle (reversed: the order turned around)."""
    ste = {a: float((j - i) % 5) for j, a in enumerate(AGENTS)}
    return {a: 4 - v for a, v in ste.items()} if reverse else ste


def test_correct_hints_stay_trusted_wrong_ones_are_distrusted_and_recover():
    reg = HintRegistry()
    for k in range(30):  # correct cycle hints, also a self-loop (same agent twice)
        i = k % 5
        reg.update("good", _cycle(i), now=k, agent=AGENTS[i])
        reg.update("good", _cycle(i), now=k, agent=AGENTS[i])
    w = reg.workflows["good"]
    assert w.trusted and w.trust == pytest.approx(1.0) and w.missed == 0 and w.scored == 59
    assert reg.ste("good", "a1") < INF
    flips = []
    for k in range(6):  # reversed: the agent that runs was predicted farthest away
        i = k % 5
        _, flipped = reg.update("bad", _cycle(i, reverse=True), now=k, agent=AGENTS[i])
        flips.append(flipped)
    w = reg.workflows["bad"]
    assert not w.trusted and flips.count(True) == 1 and w.missed >= 3
    assert all(reg.ste("bad", a) == INF for a in AGENTS)       # hints count as absent
    changed, _ = reg.update("bad", _cycle(1, reverse=True), now=9, agent="a1")
    assert changed == {}                                       # nothing reported while distrusted
    for k in range(10):  # the client is fixed: predictions are right again -> trusted again
        i = (k + 2) % 5
        reg.update("bad", _cycle(i), now=10 + k, agent=AGENTS[i])
    assert reg.workflows["bad"].trusted and reg.ste("bad", AGENTS[(11 + 2) % 5]) < INF
    # parallel agents of one step and out-of-band transitions (no agent) are not misses
    reg.update("fan", {"h": 0, "w1": 1, "w2": 1, "t": 2}, now=0, agent="h")
    reg.update("fan", {"h": 2, "w1": 0, "w2": 0, "t": 1}, now=1, agent="w1")
    reg.update("fan", {"h": 2, "w1": 0, "w2": 0, "t": 1}, now=1, agent="w2")
    reg.update("fan", {"h": 1, "w1": 2, "w2": 2, "t": 0}, now=2)
    reg.update("fan", {"h": 1, "w1": 2, "w2": 2, "t": 0}, now=2, agent="t")
    assert reg.workflows["fan"].missed == 0 and reg.workflows["fan"].scored == 3


def test_distrusted_workflow_pins_nothing_and_prefetches_nothing():
    m = make_manager("kvflow", page_size=1, device_pages=64, host_pages=256, link=1e3)
    for j, a in enumerate(AGENTS):
        put(m, [100 * (j + 1) + t for t in range(4)], "w", a, fixed=4)
    for k in range(8):  # reversed hints on every request
        i = k % 5
        m.update_hints("w", _cycle(i, reverse=True), agent=AGENTS[i], plan=False)
    snap = m.snapshot()["workflows"]["w"]
    assert snap["trusted"] is False and snap["mispredicted"] >= 3
    assert all(m.tags.effective_ste(("w", a)) == INF for a in AGENTS)
    assert not m.tags.near                                    # nothing to prefetch
    m.check_invariants()
