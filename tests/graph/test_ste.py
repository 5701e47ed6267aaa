import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow_agents.graph import END, START, AgentStepGraph, GraphError

INF = math.inf


def paper_loop():
    g = AgentStepGraph("peer")
    for a, b in [("Planner", "Executor"), ("Executor", "Expresser"),
                 ("Expresser", "Reviewer"), ("Reviewer", "Planner")]:
        g.add_edge(a, b)
    return g


def test_paper_cycle_executor_running():
    ste = paper_loop().steps_to_execution(running={"Executor"})
    assert ste == {"Planner": 3, "Executor": 0, "Expresser": 1, "Reviewer": 2}


def figure3(kind: str) -> AgentStepGraph:
    # Executor1 is one step away and Executor2 two steps away from the running agent.
    g = AgentStepGraph("fig3" + kind)
    g.add_edge("Current", "Executor1")
    g.add_edge("Executor1", "Executor2")
    if kind == "and":
        g.add_join(["Executor1", "Executor2"], "Expresser")
    else:
        g.add_edge("Executor1", "Expresser")
        g.add_edge("Executor2", "Expresser")
    return g


def test_next_run_puts_entry_agents_one_step_after_the_end():
    """``next_run_ste``: an app run again starts at its entry agents one step after the last
    agent before END (min over END's predecessors); nothing else changes; no END, no change."""
    g = AgentStepGraph("peer")
    g.add_edge(START, "planner").add_edge("planner", "executor").add_edge("executor", "expresser")
    g.add_edge("expresser", "reviewer").add_edge("reviewer", "expresser", conditional=True)
    g.add_edge("reviewer", END, conditional=True)
    ste = g.steps_to_execution(["executor"])
    assert ste == {"planner": INF, "executor": 0, "expresser": 1, "reviewer": 2}
    assert g.next_run_ste(ste) == {**ste, "planner": 3}
    assert g.next_run_ste(g.steps_to_execution(["reviewer"]))["planner"] == 1
    assert g.next_run_ste(g.steps_to_execution(["planner"]))["planner"] == 0  # min with its own
    assert g.next_run_ste({a: INF for a in g.agents}) == {a: INF for a in g.agents}  # run over
    loop = paper_loop()  # a cycle never ends: no next run to predict
    assert loop.next_run_ste(loop.steps_to_execution(["Executor"])) == loop.steps_to_execution(["Executor"])


def test_figure3_and_takes_max_plus_one():
    ste = figure3("and").steps_to_execution(running={"Current"})
    assert (ste["Executor1"], ste["Executor2"], ste["Expresser"]) == (1, 2, 3)


def test_figure3_or_takes_min_plus_one():
    ste = figure3("or").steps_to_execution(running={"Current"})
    assert (ste["Executor1"], ste["Executor2"], ste["Expresser"]) == (1, 2, 2)


def test_arrived_members_no_longer_hold_the_barrier():
    g = AgentStepGraph()
    g.add_edge("plan", "a")
    g.add_edge("plan", "b")
    g.add_edge("b", "b2")
    g.add_join(["a", "b2"], "join")
    # a finished and arrived; b is running: join waits only for b2 (1 away) -> 2.
    ste = g.steps_to_execution(running={"b"}, arrived={"join": {"a"}})
    assert ste["join"] == 2 and ste["a"] == INF and ste["plan"] == INF
    # Without the arrival, a can never run again, so the barrier never fires.
    assert g.steps_to_execution(running={"b"})["join"] == INF
    # All members arrived: the join runs next step.
    assert g.steps_to_execution(running=set(), arrived={"join": {"a", "b2"}})["join"] == 1


def test_or_and_groups_combine_by_min():
    g = AgentStepGraph()
    g.add_edge("r", "x")
    g.add_edge("x", "y")
    g.add_edge("y", "z")
    g.add_join(["x", "y"], "t")  # max(1, 2) + 1 = 3
    g.add_edge("z", "t")         # 3 + 1 = 4
    g.add_edge("r", "u")
    g.add_join(["u", "x"], "t")  # max(1, 1) + 1 = 2
    assert g.steps_to_execution(running={"r"})["t"] == 2


def test_unreachable_is_inf_and_start_seeds_entries():
    g = AgentStepGraph()
    g.add_edge(START, "a")
    g.add_edge("a", "b")
    g.add_edge("b", END)
    g.add_agent("orphan")
    assert g.steps_to_execution(running={START}) == {"a": 1, "b": 2, "orphan": INF}
    assert g.steps_to_execution(running={"b"}) == {"a": INF, "b": 0, "orphan": INF}


def test_parallel_running_agents_share_step_zero():
    g = AgentStepGraph()
    for e in ("e1", "e2"):
        g.add_edge("p", e)
    g.add_join(["e1", "e2"], "x")
    ste = g.steps_to_execution(running={"e1", "e2"})
    assert ste == {"p": INF, "e1": 0, "e2": 0, "x": 1}


@pytest.mark.parametrize("bad", [
    lambda g: g.add_join(["only"], "x"),
    lambda g: g.add_join(["a", "a"], "x"),
    lambda g: g.add_join(["a", "x"], "x"),
    lambda g: g.add_agent(""),
    lambda g: g.add_edge("a", ""),
    lambda g: g.add_edge(END, "a"),
    lambda g: g.add_agent(START),
    lambda g: g.steps_to_execution(running={"ghost"}),
    lambda g: g.steps_to_execution(running=set(), arrived={"ghost": {"a"}}),
    lambda g: g.steps_to_execution(running=set(), arrived={"b": {"a"}}),  # b has no join with a
])
def test_bad_graphs_and_states_raise_graph_error(bad):
    g = AgentStepGraph()
    g.add_edge("a", "b")
    with pytest.raises(GraphError):
        bad(g)


def test_json_round_trip_keeps_joins_and_llm_flags():
    g = AgentStepGraph("rt")
    g.add_edge(START, "p")
    g.add_edge("p", "e1")
    g.add_edge("p", "e2", conditional=True)
    g.add_join(["e1", "e2"], "x")
    g.add_agent("tool", llm=False)
    g.add_edge("x", "tool")
    g.add_edge("tool", END)
    h = AgentStepGraph.from_json(g.to_json())
    assert h.name == "rt" and h.agents == g.agents
    assert h.joins("x") == [["e1", "e2"]] and not h.is_llm("tool")
    for running in ({START}, {"p"}, {"e1"}, {"tool"}):
        assert h.steps_to_execution(running) == g.steps_to_execution(running)
    with pytest.raises(GraphError, match="^not an Agent Step Graph JSON document"):
        AgentStepGraph.from_json('{"not": "a graph"}')
    # a JSON list or a document without its graph: a GraphError, never an AttributeError
    for bad in ("[1, 2]", "{", '{"kvflow_asg": 1}', '{"kvflow_asg": 1, "graph": 3}'):
        with pytest.raises(GraphError, match="Agent Step Graph"):
            AgentStepGraph.from_json(bad)


def test_mermaid_and_dot_exports_name_every_agent_and_join():
    g = AgentStepGraph("x")
    g.add_edge("p", "e1")
    g.add_edge("p", "e2", conditional=True)
    g.add_join(["e1", "e2"], "j")
    mm, dot = g.to_mermaid(), g.to_dot()
    assert mm.startswith("flowchart TD") and '{"AND"}' in mm and "-.->" in mm
    assert dot.startswith('digraph "x"') and "AND0" in dot and "style=dashed" in dot
    for a in g.agents:
        assert f'"{a}"' in mm and f'"{a}"' in dot


def reference_fixpoint(g: AgentStepGraph, running, arrived):
    """Naive least fixpoint straight from the definition (Bellman-Ford style)."""
    E = {a: (0 if a in running else INF) for a in g.agents}
    changed = True
    while changed:
        changed = False
        for a in g.agents:
            if a in running:
                continue
            cands = [E[p] + 1 for p in g.or_predecessors(a)]
            for grp in g.joins(a):
                waiting = [E[m] for m in grp if m not in arrived.get(a, set())]
                cands.append(max(waiting, default=0) + 1)
            v = min(cands, default=INF)
            if v < E[a]:
                E[a] = v
                changed = True
    return E


@st.composite
def graphs_and_states(draw):
    n = draw(st.integers(3, 9))
    names = [f"n{i}" for i in range(n)]
    g = AgentStepGraph("h")
    for a in names:
        g.add_agent(a)
    for _ in range(draw(st.integers(0, 3 * n))):
        a, b = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        g.add_edge(a, b)  # self-loops allowed: an agent may repeat
    for _ in range(draw(st.integers(0, 3))):
        dst = draw(st.sampled_from(names))
        members = draw(st.lists(st.sampled_from([x for x in names if x != dst]), min_size=2, max_size=3, unique=True))
        g.add_join(members, dst)
    running = set(draw(st.lists(st.sampled_from(names), max_size=3)))
    arrived = {}
    for dst in names:
        allowed = sorted({m for grp in g.joins(dst) for m in grp})
        if allowed:
            got = draw(st.lists(st.sampled_from(allowed), max_size=2, unique=True))
            if got:
                arrived[dst] = set(got)
    return g, running, arrived


@settings(max_examples=300, deadline=None)
@given(graphs_and_states())
def test_bfs_equals_the_definitions_least_fixpoint(case):
    g, running, arrived = case
    assert g.steps_to_execution(running, arrived) == reference_fixpoint(g, running, arrived)
