"""Tool gaps (serving/policy/toolgap.py): an agent waiting on a tool keeps the start of its
resumed turn — its whole last turn — with a time plan from the tool's expected duration."""

from __future__ import annotations

import math

from policy_driver import make_manager

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.policy.toolgap import RESUME

F, H, OUT = 10, 20, 6  # fixed prompt, dynamic history, generated tokens (page size 1)


def turn(m, tokens, wf, agent, ste, fixed=F, out=()):
    """One request through the session protocol; returns (session, poll at arrival)."""
    s = m.arrive(tokens, Hints(workflow=wf, agent=agent, ste=ste), fixed_len=fixed, kv_tokens=len(tokens) + len(out))
    p = s.poll()
    while not p.ready:  # a load in flight on its prefix: let the virtual clock run to it
        m.clock.t = max(m.clock.t, p.ready_at or m.clock.t)
        m.tick(m.clock.t)
        p = s.poll()
    assert s.admit()
    s.commit()
    seq = list(tokens) + list(out)
    s.finish(seq, len(seq))
    return s, p


def agent_a_first_turn(m):
    prompt = list(range(1000, 1000 + F)) + list(range(2000, 2000 + H))
    out = list(range(3000, 3000 + OUT))
    turn(m, prompt, "w", "A", {"A": 0, "T": 1}, out=out)
    return prompt + out


def tool_starts(m, secs):
    m.apply_hints(Hints(workflow="w", agent="T", ste={"T": 0, "A": 1}, event="transition",
                        tool_s={"A": secs} if secs is not None else {}))


def pressure(m, n, size=24, start=10_000):
    """Other workflows' agents come and go (each 24 tokens, STE 1 = they run again soon)."""
    for i in range(n):
        toks = list(range(start + i * 100, start + i * 100 + size))
        turn(m, toks, f"other-{i}", "B", {"B": 0}, fixed=8)
        m.apply_hints(Hints(workflow=f"other-{i}", agent="B", ste={"B": 1}))


def test_resume_tag_follows_its_plan_and_closes_on_the_next_request():
    m = make_manager("kvflow", device_pages=128, host_pages=256, link=100.0)  # 0.01 s per page
    last = agent_a_first_turn(m)
    tool_starts(m, 2.0)
    node = m.agent_node("w", "A" + RESUME)
    assert node is not None and len(node.key) + sum(len(n.key) for n in node.path()[:-1]) == len(last)
    assert m.tags.effective_ste(("w", "A" + RESUME)) == 2           # hold: kept, not brought back yet
    assert m.next_event_at == 2.0 - 0.05                               # on device: lead = margin only
    m.clock.t = 1.96
    m.tick(m.clock.t)
    assert m.tags.effective_ste(("w", "A" + RESUME)) == 1           # near: in time for the resume
    # the agent's next request closes the gap; its own request pins the path from now on
    m.clock.t = 2.0
    s, p = turn(m, last + [4000, 4001], "w", "A", {"A": 0, "T": 1})
    assert p.device_len == len(last) and s.reused == len(last)
    assert m.tags.effective_ste(("w", "A" + RESUME)) == math.inf and not m.gaps.gaps
    assert m.gaps.closed_by_request == 1


def test_a_tool_far_slower_than_measured_releases_the_tag():
    m = make_manager("kvflow", device_pages=128, host_pages=256)
    agent_a_first_turn(m)
    tool_starts(m, 0.5)
    m.clock.t = 2 * 0.5 + 1.0 + 0.01  # past 2 x expected + min grace
    m.tick(m.clock.t)
    assert m.tags.effective_ste(("w", "A" + RESUME)) == math.inf and m.gaps.expired == 1


def test_no_tool_hint_changes_nothing():
    a, b = make_manager("kvflow", device_pages=64), make_manager("kvflow", device_pages=64)
    agent_a_first_turn(a)
    agent_a_first_turn(b)
    tool_starts(a, None)
    assert a.agent_node("w", "A" + RESUME) is None and not a.gaps.gaps
    assert a.snapshot()["pools"] == b.snapshot()["pools"] and a.snapshot()["nodes"] == b.snapshot()["nodes"]


def resumed_session(tool_s):
    """A's last turn (36 tokens), then other workflows fill the device during the tool call;
    A's resumed request (its session: where its reused tokens were when it arrived)."""
    m = make_manager("kvflow", device_pages=96, host_pages=512, link=200.0)
    last = agent_a_first_turn(m)
    tool_starts(m, tool_s)
    pressure(m, 6)
    resume_at = m.clock.t + 1.0
    while (t := m.next_event_at) is not None and t <= resume_at:  # an idle engine wakes then
        m.clock.t = max(m.clock.t, t)
        m.tick(m.clock.t)
    m.clock.t = resume_at  # the tool returns
    m.tick(m.clock.t)
    return turn(m, last + [4000], "w", "A", {"A": 0, "T": 1})[0]


def test_under_pressure_the_resumed_turn_finds_its_whole_last_turn_on_device():
    """Without the tool hint the agent's dynamic part is +inf priority (the first to go: the
    resumed turn waits for a load from host); with it, the whole last turn is kept or brought
    back in time, and the resumed turn waits for nothing."""
    without, with_hint = resumed_session(None), resumed_session(1.0)
    assert with_hint.device_hit == F + H + OUT and with_hint.load_wait_s == 0
    assert without.device_hit < F + H + OUT and without.load_wait_s > 0
