"""Tool gaps (serving/policy/toolgap.py): an agent waiting on a tool keeps the start of its
resumed turn — its whole last turn — with a time plan from the tool's expected duration."""

from __future__ import annotations

import math

from policy_driver import make_manager

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.policy.hints import workflow_key
from kvflow_agents.serving.policy.toolgap import RESUME

F, H, OUT = 10, 20, 6  # fixed prompt, dynamic history, generated tokens (page size 1)


def turn(m, tokens, wf, agent, ste, fixed=F, out=(), app=None):
    """One request through the session protocol; returns (session, poll at arrival)."""
    s = m.arrive(tokens, Hints(workflow=wf, agent=agent, ste=ste, app=app), fixed_len=fixed,
                 kv_tokens=len(tokens) + len(out))
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


def pressure(m, n, size=24, start=10_000, ste=1):
    """Other workflows' agents come and go (each 24 tokens, STE 1 = they run again soon)."""
    for i in range(n):
        toks = list(range(start + i * 100, start + i * 100 + size))
        turn(m, toks, f"other-{i}", "B", {"B": 0}, fixed=8)
        m.apply_hints(Hints(workflow=f"other-{i}", agent="B", ste={"B": ste}))


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
    s = m.arrive(last + [4000, 4001], Hints(workflow="w", agent="A", ste={"A": 0, "T": 1}), fixed_len=F)
    assert m.tags.effective_ste(("w", "A" + RESUME)) == math.inf and not m.gaps.gaps
    assert m.gaps.closed_by_request == 1
    p = s.poll()
    assert p.ready and s.admit()
    s.commit()
    assert p.device_len == len(last) and s.reused == len(last)
    # that request extended A's last turn past its fixed prompt: A is learned, and when it
    # finishes its turn stays tagged at A's own STE (a turn gap), not as a tool gap
    s.finish(last + [4000, 4001], len(last) + 2)
    [gap] = m.gaps.open_gaps("w", "A")
    assert gap.kind == "turn" and m.tags.effective_ste(("w", "A" + RESUME)) == 0
    assert m.gaps.turns_opened == 1 and m.gaps.opened == 1


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


# ---------------------------------------------------------------- turn gaps (no tool hint)
def app_turn(m, tokens, wf, agent, ste, out=(), app="peer"):
    """:func:`turn` in an app's workflow, then a scheduler tick; returns (session, written)."""
    s, _ = turn(m, tokens, wf, agent, ste, out=out, app=app)
    m.tick(m.clock.t)
    return s, list(tokens) + list(out)


def reviewer_round(m, wf, *, extends=True, pressure_n=6):
    """PEER's reviewer in a group chat: its first turn, then the expresser runs (others fill the
    device meanwhile), then its second turn: the first one plus the expresser's new answer (or,
    ``extends=False``, a fresh history after the same fixed prompt). Returns the second turn's
    session (where its reused tokens were when it arrived)."""
    q = 100_000 * (1 + int(wf[1:]))  # each question's own history and answers
    fixed = list(range(1000, 1000 + F))
    first = fixed + list(range(q, q + H))
    _, written = app_turn(m, first, wf, "R", {"R": 0, "E": 1}, out=range(q + 100, q + 100 + OUT))
    m.apply_hints(Hints(workflow=wf, agent="E", ste={"E": 0, "R": 1}, app="peer"))
    for i in range(pressure_n):  # other apps' agents at STE 2: above dynamic suffixes, below R
        base = 50_000 + 1000 * i + 100 * len(wf)
        app_turn(m, list(range(base, base + 24)), f"{wf}-o{i}", "B", {"B": 0}, app=None)
        m.apply_hints(Hints(workflow=f"{wf}-o{i}", agent="B", ste={"B": 2}))
    second = written + [q + 200, q + 201] if extends else fixed + list(range(q + 300, q + 300 + H))
    s, _ = app_turn(m, second, wf, "R", {"R": 0, "E": 1}, out=range(q + 400, q + 400 + OUT))
    assert m.gaps.open_gaps(wf, "R", "peer") or not extends or not m.gaps.turn_gaps
    m.apply_hints(Hints(workflow=wf, agent="R", ste={}, event="end", app="peer"))  # as adapters do
    assert not any(k[0] == workflow_key(wf, "peer") for k in m.gaps.gaps)
    return s, len(written)


def test_an_agent_that_extends_its_last_turn_keeps_it_at_its_own_ste():
    """Learned in one workflow instance of the app (its second turn extended its first past the
    fixed prompt), the reviewer's last turn is tagged at the reviewer's STE in the next instance,
    so the other agents' prefixes (STE 2) are evicted before it and the second turn finds the
    whole first turn on device. Without that instance, the turn's dynamic part is +inf and goes
    first: the second turn reloads it from host (its wait on the critical path)."""
    learned = make_manager("kvflow", device_pages=96, host_pages=512, link=200.0)
    reviewer_round(learned, "q0")                                    # learns R (app "peer")
    assert learned.gaps.extends == {("app", "peer", "R"): True}
    assert learned.snapshot()["gaps"]["agents_learned"] == 1
    s, turn_len = reviewer_round(learned, "q1")
    assert s.device_hit == turn_len and s.load_wait_s == 0

    fresh = make_manager("kvflow", device_pages=96, host_pages=512, link=200.0)
    s, turn_len = reviewer_round(fresh, "q1")
    assert s.device_hit < turn_len and s.load_wait_s > 0

    off = make_manager("kvflow", device_pages=96, host_pages=512, link=200.0, turn_gaps=False)
    reviewer_round(off, "q0")                                        # (kvflow serve --no-turn-gaps)
    s, turn_len = reviewer_round(off, "q1")
    assert not off.gaps.extends and off.gaps.turns_opened == 0
    assert s.device_hit < turn_len and s.load_wait_s > 0


def test_the_turn_gap_follows_the_agents_ste_and_closes():
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    reviewer_round(m, "q0", pressure_n=0)
    fixed = list(range(1000, 1000 + F))
    _, written = app_turn(m, fixed + list(range(9000, 9000 + H)), "q1", "R", {"R": 0, "E": 1},
                          out=range(9100, 9100 + OUT))
    key = (workflow_key("q1", "peer"), "R")
    tag = (key[0], "R" + RESUME)
    assert [g.kind for g in m.gaps.open_gaps("q1", "R", "peer")] == ["turn"]
    assert m.tags.effective_ste(tag) == 0
    assert m.tags.records[tag].tokens == tuple(written) and m.tags.node_of(tag) is not None
    m.apply_hints(Hints(workflow="q1", agent="E", ste={"E": 0, "R": 1}, app="peer"))
    m.tick(m.clock.t)
    assert m.tags.effective_ste(tag) == 1                            # mirrors R
    m.apply_hints(Hints(workflow="q1", agent="E", ste={"E": 0, "R": None}, app="peer"))
    m.tick(m.clock.t)                                                # R no longer expected
    assert m.tags.effective_ste(tag) == math.inf and not m.gaps.gaps
    assert m.gaps.expired == 0                                       # (tool gaps' counter)


def test_an_agent_that_stops_extending_its_turns_is_unlearned():
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    reviewer_round(m, "q0", pressure_n=0)
    assert ("app", "peer", "R") in m.gaps.extends
    reviewer_round(m, "q1", pressure_n=0, extends=False)            # a fresh history this time
    assert ("app", "peer", "R") not in m.gaps.extends
    app_turn(m, list(range(1000, 1000 + F)) + list(range(9000, 9000 + H)), "q2", "R", {"R": 0})
    assert not m.gaps.open_gaps("q2", "R", "peer")                    # no turn gap any more


def test_without_a_tagged_fixed_prefix_nothing_is_learned():
    """T4: an agent with no fixed prefix (no boundary declared or inferred yet) would read its
    fixed prompt as reuse of its last turn; it is not learned."""
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    fixed = list(range(1000, 1000 + F))
    for k in range(3):
        s = m.arrive(fixed + [2000 + k], Hints(workflow="w", agent="A", ste={"A": 0}), fixed_len=0,
                     kv_tokens=F + 2)
        assert s.poll().ready and s.admit()
        s.commit()
        s.finish(fixed + [2000 + k, 3000], F + 2)
    assert not m.gaps.extends and not m.gaps.gaps and m.gaps.turns_opened == 0


def test_parallel_instances_of_an_agent_open_no_turn_gap_until_the_last_one_ends():
    """T5: LangGraph's Send fan-out runs several executors under one name; while one is still
    in flight the agent is at STE 0, which says nothing about a finished instance's turn, so
    only the last one to end leaves its turn tagged."""
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    reviewer_round(m, "q0", pressure_n=0)                            # R is learned
    fixed = list(range(1000, 1000 + F))
    sessions = []
    for i in range(3):                                               # three R's at once
        s = m.arrive(fixed + list(range(9000 + 100 * i, 9000 + 100 * i + H)),
                     Hints(workflow="q1", agent="R", ste={"R": 0}, app="peer"), fixed_len=F,
                     kv_tokens=F + H + OUT)
        assert s.poll().ready and s.admit()
        s.commit()
        sessions.append(s)
    for i, s in enumerate(sessions):
        seq = list(s.tokens) + list(range(9500 + 10 * i, 9500 + 10 * i + OUT))
        s.finish(seq, len(seq))
        assert len(m.gaps.open_gaps("q1", "R", "peer")) == (i == 2)


def test_a_shared_message_header_past_the_fixed_prompt_is_not_a_history():
    """Every call's user message starts with the same template tokens after the fixed prompt
    (``<|im_start|>user\\nRound``): that is not the last turn extended, nothing is learned."""
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    fixed, header = list(range(1000, 1000 + F)), [7, 8, 9]
    for k in range(4):
        app_turn(m, fixed + header + list(range(20_000 + 100 * k, 20_000 + 100 * k + H)), "w", "A",
                 {"A": 0}, out=range(30_000 + 100 * k, 30_000 + 100 * k + OUT))
    assert not m.gaps.extends and m.gaps.turns_opened == 0


# ---------------------------------------------------------------- parallel instances
def fan_out_with_tools(m, ste, tool_ste, tool_s):
    """Three instances of agent X at once (a ``Send`` fan-out) with hints ``ste``; each ends in
    turn and its tool step starts (a transition with ``tool_ste`` and ``kvflow_tool_s = {X:
    tool_s}``). Returns their turns (prompt + generated)."""
    fixed = list(range(1000, 1000 + F))
    sessions = []
    for i in range(3):
        s = m.arrive(fixed + list(range(9000 + 100 * i, 9000 + 100 * i + H)),
                     Hints(workflow="w", agent="X", ste=ste), fixed_len=F, kv_tokens=F + H + OUT)
        assert s.poll().ready and s.admit()
        s.commit()
        sessions.append(s)
    turns = []
    for i, s in enumerate(sessions):
        seq = list(s.tokens) + list(range(9500 + 10 * i, 9500 + 10 * i + OUT))
        s.finish(seq, len(seq))
        turns.append(seq)
        m.apply_hints(Hints(workflow="w", agent="T", ste=tool_ste, event="transition",
                            tool_s={"X": tool_s}))
    return turns


def test_parallel_instances_waiting_on_their_tools_each_keep_their_own_turn():
    """LangGraph's ``Send`` fan-out of ReAct executors: three instances of one agent each call
    a tool and resume with their own last turn. Each tool hint keeps the turn of the instance
    that just finished (the most recent one without a gap), so under pressure every resumed
    request finds its whole last turn, not only the last instance to have called its tool."""
    m = make_manager("kvflow", device_pages=112, host_pages=512, link=200.0)
    turns = fan_out_with_tools(m, {"X": 0, "T": 1}, {"T": 0, "X": 1}, 1.0)
    assert len(m.gaps.gaps) == 3 and m.gaps.opened == 3
    gaps = m.gaps.open_gaps("w", "X")
    assert [g.tag_agent for g in gaps] == ["X" + RESUME, "X" + RESUME + "2", "X" + RESUME + "3"]
    assert {m.tags.records[("w", g.tag_agent)].tokens for g in gaps} == {tuple(t) for t in turns}
    pressure(m, 6, ste=3)                                            # they run after X resumes
    resume_at = 1.0
    while (t := m.next_event_at) is not None and t <= resume_at:    # an idle engine wakes then
        m.clock.t = max(m.clock.t, t)
        m.tick(m.clock.t)
    m.clock.t = resume_at                                            # the tools return
    m.tick(m.clock.t)
    for i in (1, 0, 2):                                              # in any order
        s, _ = turn(m, turns[i] + [4000 + i], "w", "X", {"X": 0, "T": 1})
        assert s.device_hit == len(turns[i]) and s.load_wait_s == 0, i
    assert m.gaps.closed_by_request == 3                             # each by its own instance
    assert [g.kind for g in m.gaps.gaps.values()] == ["turn"] * 3     # (learned: X extends them)


def test_a_tool_gap_moves_when_the_engine_wakes_for_it_and_stays_near():
    """An engine that sleeps until ``next_event_at`` finds the gap moved when it wakes (one
    formula for both: a rounding difference once woke it at the same instant forever), and,
    T2, once near a gap stays near: the prefetch that lands shrinks its lead, which used to put
    it back on hold (STE 2) for pressure to evict again before the tool returned."""
    m = make_manager("kvflow", device_pages=64, host_pages=512, link=200.0)
    agent_a_first_turn(m)
    tool_starts(m, 1.0)
    pressure(m, 6)                                                   # A's turn goes to host
    tag = ("w", "A" + RESUME)
    assert m.tags.effective_ste(tag) == 2 and m.store.host_pages(m.tags.node_of(tag)) > 0
    seen = []
    while (t := m.next_event_at) is not None and t <= 1.0:
        m.clock.t = max(m.clock.t, t)
        m.tick(m.clock.t)
        assert not seen or seen[-1] != (m.clock.t, m.tags.effective_ste(tag)), "woke for nothing"
        seen.append((m.clock.t, m.tags.effective_ste(tag)))
        if m.tags.effective_ste(tag) == 1:
            break
    m.clock.t = 1.0
    for _ in range(3):                                               # the prefetch lands
        m.tick(m.clock.t)
        assert m.tags.effective_ste(tag) == 1


def test_finished_turns_tracked_are_bounded_in_all():
    """Every agent's unresumed turns count against one bound (``max_tracked``): a server with
    many workflows whose agents never resume keeps the most recently finished turns only."""
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    m.gaps.max_tracked = 8
    fixed = list(range(1000, 1000 + F))
    for w in range(5):
        for i in range(3):                                           # 3 instances each
            turn(m, fixed + list(range(20_000 + 1000 * w + 100 * i, 20_000 + 1000 * w + 100 * i + H)),
                 f"w{w}", "X", {"X": 0}, out=range(9000, 9000 + OUT))
    kept = [(k[0], t.tokens[F]) for k, ts in m.gaps.last.items() for t in ts]
    assert m.gaps.num_turns == len(kept) == 8 == m.snapshot()["gaps"]["turns_tracked"]
    assert [wf for wf, _ in kept] == ["w2"] * 2 + ["w3"] * 3 + ["w4"] * 3 and kept[0][1] == 22_100


def test_waiting_instances_rank_above_the_fan_ins_next_agent_while_a_sibling_runs():
    """T2: a near tool gap takes the agent's own STE when that is lower. LangGraph PEER's
    executors: while one instance's resumed call runs (the agent at STE 0), the others' turns,
    still in their tools, rank above the expresser (STE 1 by the graph: it runs once they all
    end) instead of level with it, so its prefetch does not take their pages."""
    m = make_manager("kvflow", device_pages=256, host_pages=512)
    turns = fan_out_with_tools(m, {"X": 0, "E": 1}, {"T": 0, "X": 1, "E": 2}, 0.0)  # back at once
    m.tick(m.clock.t)
    assert [g.ste for g in m.gaps.open_gaps("w", "X")] == [1, 1, 1]  # near, the agent's 1
    m.arrive(turns[0] + [4000], Hints(workflow="w", agent="X", ste={"X": 0, "E": 1}), fixed_len=F,
             kv_tokens=len(turns[0]) + 1 + OUT)                     # the first resume: in flight
    m.tick(m.clock.t)
    waiting = m.gaps.open_gaps("w", "X")
    assert len(waiting) == 2 and {m.tags.effective_ste(("w", g.tag_agent)) for g in waiting} == {0}
    assert m.tags.effective_ste(("w", "E")) == 1
    m.apply_hints(Hints(workflow="w", agent="T", ste={"T": 0, "X": 1, "E": 2}, event="transition"))
    m.tick(m.clock.t)                                                # the agent back at 1: so are they
    assert {m.tags.effective_ste(("w", g.tag_agent)) for g in m.gaps.open_gaps("w", "X")} == {1}
