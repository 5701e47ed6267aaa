"""Workloads for the simulator: the paper's synthetic workflows, PEER-style, and trace replay.

A :class:`Workload` is a list of :class:`WorkflowPlan`; a plan is a list of :class:`Step`; a step
is one or more :class:`Call` run in parallel (a barrier ends the step) plus the hint (STE map)
each of its calls sends. The synthetic workflows take that hint from their Agent Step Graph
(``graph/``: the STE of every agent while the step's agents run), as an instrumented app does. Steps run closed loop (``gap_s`` after the previous step ends) unless
``at`` pins an absolute arrival (open-loop trace replay). Token ids are synthesized by the engine:
a fixed prompt is a deterministic id run per ``fixed_key`` (same key = same prefix), dynamic and
output tokens are unique per call.

Trace format (JSONL, one request per line) that ``kvflow serve --record`` should write::

    {"t": 12.345,                 # arrival time, seconds (any origin)
     "workflow": "wf-1", "agent": "planner",
     "fixed_tokens": 1024,        # token length of the agent's fixed prefix (server boundary)
     "prompt_tokens": 1312,       # whole prompt, fixed part included
     "output_tokens": 64,         # completion tokens actually generated
     "ste": {"planner": 0, "executor": 1, "reviewer": null},   # the hint as received
     # optional:
     "step": 3, "app": "peer",    # hint step / app; same step of a workflow = parallel calls
     "fixed_hash": "3f2a…",       # hash of the fixed prefix token ids (shared prompts)
     "done_t": 13.1,              # when the response finished (enables closed-loop replay)
     "cached_tokens": 1024, "ttft_s": 0.21}   # what the real server saw (for comparison)
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from kvflow_agents.graph import END, START, AgentStepGraph
from kvflow_agents.graph.examples import cycle_graph

TRACE_REQUIRED = ("t", "workflow", "agent", "fixed_tokens", "prompt_tokens", "output_tokens", "ste")


@dataclass
class Call:
    agent: str
    fixed_key: str
    fixed: int
    dynamic: int
    output: int
    tag: Optional[int] = None  # tokens the server tags as the fixed prefix (None: ``fixed``);
    # less than ``fixed`` when the shared prefix runs past the tag (chat-template header)


@dataclass
class Step:
    calls: list[Call]
    ste: dict
    round: int = 0
    measured: bool = True
    gap_s: float = 0.0
    at: Optional[float] = None


@dataclass
class WorkflowPlan:
    id: str
    steps: list[Step]
    start_s: float = 0.0


@dataclass
class Workload:
    name: str
    workflows: list[WorkflowPlan]
    page_size: int = 64
    device_tokens: Optional[int] = None      # overrides the profile's pool
    device_fraction: Optional[float] = None  # ... or a fraction of all distinct fixed prompts
    host_tokens: Optional[int] = None
    meta: dict = field(default_factory=dict)

    def fixed_tokens_total(self) -> int:
        seen: dict[str, int] = {}
        for wf in self.workflows:
            for st in wf.steps:
                for c in st.calls:
                    seen[c.fixed_key] = max(seen.get(c.fixed_key, 0), c.fixed)
        return sum(seen.values())

    def max_request_tokens(self) -> int:
        return max(c.fixed + c.dynamic + c.output for wf in self.workflows
                   for st in wf.steps for c in st.calls)

    def num_calls(self) -> int:
        return sum(len(st.calls) for wf in self.workflows for st in wf.steps)


# ------------------------------------------------------------------ the paper's workflows
def _hint(graph: AgentStepGraph, running: Iterable[str]) -> dict:
    """The STE map the step's calls send: the graph's, ``None`` where an agent cannot run."""
    ste = graph.steps_to_execution(set(running))
    return {a: (None if v == float("inf") else int(v)) for a, v in ste.items()}


def _check(**kw) -> None:
    for k, v in kw.items():
        if v is None or v < (0 if k in ("warmup_rounds", "dynamic", "stagger_s") else 1):
            raise ValueError(f"{k} must be >= {0 if k in ('warmup_rounds', 'dynamic', 'stagger_s') else 1}, got {v}")


def cycle(*, agents: int = 10, fixed: int = 4096, dynamic: int = 32, output: int = 32,
          rounds: int = 2, warmup_rounds: int = 1, workflows: int = 1, share_prompts: bool = False,
          stagger_s: float = 0.0, rotate: bool = False, page_size: int = 64,
          name: str | None = None, **kw) -> Workload:
    """KVFlow's Fig. 1 workflow: agent_0 -> ... -> agent_{N-1} -> agent_0, N sequential calls a
    round; STE of agent j while agent i runs = (j - i) mod N (the Agent Step Graph's value).
    ``rotate``: workflow w starts at agent w mod N (concurrent workflows out of phase)."""
    _check(agents=agents, fixed=fixed, dynamic=dynamic, output=output, rounds=rounds,
           warmup_rounds=warmup_rounds, workflows=workflows, stagger_s=stagger_s)
    names = [f"agent_{i}" for i in range(agents)]
    graph = cycle_graph(names=names)
    hint = {a: _hint(graph, [a]) for a in names}
    plans = []
    for w in range(workflows):
        steps = []
        for r in range(warmup_rounds + rounds):
            for k in range(agents):
                a = names[(k + (w if rotate else 0)) % agents]
                key = a if share_prompts else f"wf{w}/{a}"
                steps.append(Step([Call(a, key, fixed, dynamic, output)], dict(hint[a]), r,
                                  r >= warmup_rounds))
        plans.append(WorkflowPlan(f"wf{w}", steps, start_s=w * stagger_s))
    meta = dict(kind="cycle", agents=agents, fixed=fixed, dynamic=dynamic, output=output,
                rounds=rounds, warmup_rounds=warmup_rounds, workflows=workflows,
                share_prompts=share_prompts, rotate=rotate)
    return Workload(name or f"cycle{agents} {fixed}/{dynamic}/{output} x{workflows}", plans,
                    page_size=page_size, meta=meta, **kw)


def fanout(*, agents: int = 6, fixed: int = 2048, dynamic: int = 64, output: int = 64,
           rounds: int = 2, warmup_rounds: int = 1, workflows: int = 1, share_prompts: bool = False,
           page_size: int = 64, **kw) -> Workload:
    """head -> (agents-2) parallel workers -AND-> tail -> head."""
    if agents < 3:
        raise ValueError("fanout needs at least 3 agents")
    _check(fixed=fixed, output=output, rounds=rounds, workflows=workflows)
    workers = [f"worker_{i}" for i in range(agents - 2)]
    groups = [["head"], workers, ["tail"]]
    graph = AgentStepGraph("fanout")
    graph.add_edge(START, "head")
    for wk in workers:
        graph.add_edge("head", wk)
    graph.add_join(workers, "tail")
    graph.add_edge("tail", "head")
    hints = [_hint(graph, g) for g in groups]
    plans = []
    for w in range(workflows):
        steps = []
        for r in range(warmup_rounds + rounds):
            for gi, g in enumerate(groups):
                calls = [Call(a, a if share_prompts else f"wf{w}/{a}", fixed, dynamic, output) for a in g]
                steps.append(Step(calls, dict(hints[gi]), r, r >= warmup_rounds))
        plans.append(WorkflowPlan(f"wf{w}", steps))
    meta = dict(kind="fanout", agents=agents, fixed=fixed, dynamic=dynamic, output=output,
                rounds=rounds, workflows=workflows)
    return Workload(f"fanout{agents} {fixed}/{dynamic}/{output} x{workflows}", plans,
                    page_size=page_size, meta=meta, **kw)


# ------------------------------------------------------------------ PEER-style
# Fixed prompt sizes: the agentUniverse English templates are ~1.58k / 1.42k / 1.84k / 1.39k
# chars (notes/peers_and_peer.md s1.2), ~4 chars a token; ``fixed_mult`` scales them up (the
# notes recommend a large fixed prefix, e.g. a rulebook, before the per-call variables).
PEER_FIXED = {"planning": 400, "executing": 355, "expressing": 460, "reviewing": 350}
# (dynamic lo, hi), (output lo, hi) in tokens; background/knowledge dominates (s1.2), Express
# answers <= 500 words, Review is a short JSON. Our estimates, uniform in the range.
PEER_TOKENS = {"planning": ((100, 300), (120, 300)), "executing": ((800, 2000), (200, 400)),
               "expressing": ((1000, 3000), (300, 700)), "reviewing": ((800, 2000), (40, 120))}


def peer_graph() -> AgentStepGraph:
    """PEER as the simulator runs it: the executors are parallel instances of one agent (one
    fixed prompt); the reviewer sends a failed answer back to the expresser, else the run ends
    (each question is its own run: the planner does not come back within it)."""
    g = AgentStepGraph("peer")
    g.add_edge(START, "planning")
    g.add_edge("planning", "executing")
    g.add_edge("executing", "expressing")
    g.add_edge("expressing", "reviewing")
    g.add_edge("reviewing", "expressing", conditional=True)
    g.add_edge("reviewing", END, conditional=True)
    return g


def peer(*, questions: int = 8, workflows: int = 4, fixed_mult: float = 4.0, retry_p: float = 0.3,
         seed: int = 0, page_size: int = 64, stagger_s: float = 0.5, **kw) -> Workload:
    """PEER (Plan -> 3-5 parallel Execute -AND-> Express -> Review [-> Express -> Review]) with
    ``workflows`` clients each answering ``questions // workflows`` questions back to back;
    the four agents' fixed prompts are shared by every workflow (one app)."""
    _check(questions=questions, workflows=workflows)
    rng = random.Random(seed)
    graph = peer_graph()
    hint = {a: _hint(graph, [a]) for a in PEER_FIXED}
    plans = []
    per = max(1, questions // workflows)
    for w in range(workflows):
        steps = []
        for q in range(per):
            def call(agent: str) -> Call:
                (dl, dh), (ol, oh) = PEER_TOKENS[agent]
                return Call(agent, f"peer/{agent}", int(PEER_FIXED[agent] * fixed_mult),
                            rng.randint(dl, dh), rng.randint(ol, oh))
            seq = [[call("planning")], [call("executing") for _ in range(rng.randint(3, 5))],
                   [call("expressing")], [call("reviewing")]]
            if rng.random() < retry_p:
                seq += [[call("expressing")], [call("reviewing")]]
            for calls in seq:
                steps.append(Step(calls, dict(hint[calls[0].agent]), q, q > 0 or per == 1))
        plans.append(WorkflowPlan(f"peer{w}", steps, start_s=w * stagger_s))
    meta = dict(kind="peer", questions=per * workflows, workflows=workflows, fixed_mult=fixed_mult,
                retry_p=retry_p, seed=seed)
    return Workload(f"peer q{per * workflows} x{workflows}", plans, page_size=page_size, meta=meta, **kw)


# ------------------------------------------------------------------ traces
def load_trace(path: "str | Path") -> list[dict]:
    recs = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not JSON ({e})") from None
            miss = [k for k in TRACE_REQUIRED if k not in r]
            if miss:
                raise ValueError(f"{path}:{ln}: missing {', '.join(miss)}")
            if r["prompt_tokens"] < r["fixed_tokens"]:
                raise ValueError(f"{path}:{ln}: prompt_tokens < fixed_tokens")
            recs.append(r)
    if not recs:
        raise ValueError(f"{path}: empty trace")
    return recs


def from_trace(records: Iterable[dict], *, scale: int = 1, time_scale: float = 1.0,
               distinct_prompts: bool = False, stagger_s: float = 0.0, page_size: int = 16,
               **kw) -> Workload:
    """Replay: one plan per recorded workflow, times ``scale`` copies (ids ``wf#k``). A
    workflow's records sharing ``step`` run in parallel. Closed loop (think time = next arrival
    - previous ``done_t``) when every record has ``done_t``, else open loop at ``t``."""
    if scale < 1 or time_scale <= 0:
        raise ValueError("scale must be >= 1 and time_scale > 0")
    recs = sorted(records, key=lambda r: r["t"])
    t0 = recs[0]["t"]
    by_wf: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_wf[str(r["workflow"])].append(r)
    plans = []
    for k in range(scale):
        for wf, rs in by_wf.items():
            closed = all("done_t" in r for r in rs)
            groups: list[list[dict]] = []
            for r in rs:
                if groups and r.get("step") is not None and groups[-1][0].get("step") == r.get("step"):
                    groups[-1].append(r)
                else:
                    groups.append([r])
            steps, prev_done = [], None
            for g in groups:
                calls = []
                for r in g:
                    app = r.get("app")
                    key = r.get("fixed_hash") or (f"{app}/{r['agent']}" if app else f"{wf}/{r['agent']}")
                    if distinct_prompts or (not r.get("fixed_hash") and not app):
                        key = f"{key}#{k}"
                    calls.append(Call(str(r["agent"]), key, int(r["fixed_tokens"]),
                                      int(r["prompt_tokens"]) - int(r["fixed_tokens"]),
                                      max(1, int(r["output_tokens"]))))
                t = (g[0]["t"] - t0) / time_scale + k * stagger_s
                if closed:
                    gap = 0.0 if prev_done is None else max(0.0, g[0]["t"] - prev_done) / time_scale
                    st = Step(calls, dict(g[0]["ste"]), gap_s=gap)
                    prev_done = max(r["done_t"] for r in g)
                else:
                    st = Step(calls, dict(g[0]["ste"]), at=t)
                steps.append(st)
            start = steps[0].at if steps[0].at is not None else (rs[0]["t"] - t0) / time_scale + k * stagger_s
            plans.append(WorkflowPlan(f"{wf}#{k}" if scale > 1 else wf, steps, start_s=start))
    meta = dict(kind="trace", records=len(recs), workflows=len(by_wf), scale=scale,
                time_scale=time_scale)
    return Workload(f"trace x{scale}", plans, page_size=page_size, meta=meta, **kw)
