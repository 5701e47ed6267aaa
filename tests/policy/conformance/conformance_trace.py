"""One trace of requests + hints, and what every engine must make of it.

The conformance suite runs this trace on every engine adapter and compares each engine's
observations with the policy core's own answer (:func:`run_reference`, the session protocol
over a bare :class:`KVCacheManager`):

- ``test_conformance.py`` (main venv): the embedded engine on tiny-random and the simulator;
- ``tests/sglang/test_conformance.py`` (.venv-sglang): SGLang's real ``UnifiedRadixCache``
  with HiCache, driven the way SGLang's scheduler drives it.

The workload: one workflow cycling through four agents (A -> B -> C -> D -> A ...), each prompt
= the agent's 16-token fixed prefix + a unique 4-token page, STE hints as the Agent Step Graph
gives them (``graph.examples.cycle_graph``), page size 4, a 16-page device pool (three prefixes
and their suffixes fit, four do not), an ample host pool, instant host links (so a started
load has landed by the next request on every engine), whole-node eviction (SGLang evicts whole
leaves), the ``kvflow`` policy, lookahead 1. The last two requests break the cycle (C again
right after D evicted it, then B): an on-demand host load and a device hit out of order.

Observed after every request (all sizes in tokens):

- ``device_hit`` / ``host_hit``: the request's prompt tokens readable on device / cached on
  host when it was first matched (hit counts);
- ``residency``: every agent's fixed prefix: ``device`` / ``host`` / ``none`` (eviction order:
  the step at which each prefix leaves the device);
- ``prefetched``: how many prefetches the engine had started so far (prefetch decisions; which
  ones shows in ``residency``: a prefix back on device before its agent's request).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow_agents.graph.examples import cycle_graph

PAGE = 4
FIXED = 16              # tokens of each agent's fixed prefix (4 pages)
DYNAMIC = 4             # a unique page per request
DEVICE_PAGES = 16
HOST_PAGES = 256
AGENTS = ["A", "B", "C", "D"]
WORKFLOW = "wf"


@dataclass(frozen=True)
class TraceRequest:
    index: int
    agent: str
    ste: dict               # the hint: {agent: steps, None = never}
    step: int

    @property
    def tokens(self) -> list[int]:
        """Token ids (< 259: tiny-random's vocabulary): the agent's fixed prefix, then a page of
        ids unique to this request."""
        a = AGENTS.index(self.agent)
        fixed = [1 + a * FIXED + i for i in range(FIXED)]
        return fixed + [100 + self.index * DYNAMIC + i for i in range(DYNAMIC)]


@dataclass(frozen=True)
class Observation:
    agent: str
    device_hit: int
    host_hit: int
    residency: tuple        # ((agent, residency), ...) sorted by agent
    prefetched: int

    def row(self) -> str:  # readable diffs in assertion messages
        res = " ".join(f"{a}:{r[0]}" for a, r in self.residency)
        return f"{self.agent} dev={self.device_hit:>2} host={self.host_hit:>2} [{res}] pf={self.prefetched}"


def trace() -> list[TraceRequest]:
    """Three rounds of the cycle, then C (just evicted) and B out of order."""
    graph = cycle_graph(names=AGENTS)
    order = AGENTS * 3 + ["C", "B"]
    out = []
    for i, agent in enumerate(order):
        ste = graph.steps_to_execution({agent})
        out.append(TraceRequest(i, agent, {a: (None if v == float("inf") else int(v))
                                           for a, v in ste.items()}, i))
    return out


def hints(req: TraceRequest):
    """The request's hints as the client library sends them."""
    from kvflow_agents.protocol import Hints

    return Hints(workflow=WORKFLOW, agent=req.agent, step=req.step, ste=req.ste)


def residency(agents: list[dict]) -> tuple:
    """``snapshot()["agents"]`` (any engine) -> ((agent, residency), ...) for this workflow."""
    got = {a["agent"]: a["residency"] for a in agents if a["workflow"] == WORKFLOW}
    return tuple((a, got.get(a, "none")) for a in AGENTS)


def observe(req: TraceRequest, device_hit: int, host_hit: int, agents: list[dict],
            prefetched: int) -> Observation:
    return Observation(req.agent, int(device_hit), int(host_hit), residency(agents), int(prefetched))


def run_reference() -> list[Observation]:
    """The policy core's own answer: the session protocol over a bare manager, instant link."""
    from kvflow_agents.serving.policy import KVCacheManager

    mgr = KVCacheManager("kvflow", page_size=PAGE, device_pages=DEVICE_PAGES,
                         host_pages=HOST_PAGES, partial_eviction=False)
    out = []
    for req in trace():
        s = mgr.arrive(req.tokens, hints(req), fixed_len=FIXED, kv_tokens=len(req.tokens))
        s.poll()
        mgr.tick()
        assert s.poll().ready and s.admit()
        s.commit()
        s.finish(req.tokens, len(req.tokens))
        out.append(observe(req, s.device_hit, s.host_hit, mgr.snapshot()["agents"],
                           mgr.metrics.prefetch_issued))
    return out


def compare(name: str, got: list[Observation], want: list[Observation]) -> None:
    """Assert the engine saw what the policy core says, with a side-by-side table if not."""
    if got == want:
        return
    lines = [f"{name} differs from the policy core (request: engine | core):"]
    for i, (g, w) in enumerate(zip(got, want)):
        mark = "  " if g == w else "!!"
        lines.append(f"{mark} {i:>2} {g.row()} | {w.row()}")
    if len(got) != len(want):
        lines.append(f"{len(got)} observations vs {len(want)}")
    raise AssertionError("\n".join(lines))
