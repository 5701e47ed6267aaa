"""Gaps between an agent's turns: while an agent waits on a tool, or on the other agents of its
workflow, keep (or bring back in time) the start of its next turn.

A ReAct-style agent calls a tool and stops; the tool runs for a while; the agent's next request
is its last one plus what it generated plus the tool's result. So that request's cached prefix
is the agent's *whole last turn* — its dynamic part included, which STE eviction otherwise
treats as the first thing to drop (a dynamic suffix has priority +inf). The client knows the
tool's expected duration (measured per tool) and sends it as ``kvflow_tool_s = {agent:
seconds}`` when the tool step starts; this module turns that into a **resume tag**: a tag
``(workflow, agent + RESUME)`` on the node where the agent's last turn ends, in the same
:class:`~.tags.TagBook` as the fixed prefixes (so the priority index, eviction, write-through
and the prefetcher treat it like any agent prefix), with a time plan
(Continuum-style time-to-live, from the graph's measured tool duration instead of a guess)::

    t0 (tool starts)      resume_at - lead        resume_at = t0 + expected    expires_at
    |--- hold: STE 2 ---------|--- near: STE 1 ---------|--- grace ---------------|  dropped
       kept above dynamic         the prefetcher brings       a slow tool: still
       suffixes (+inf); not       a host copy back to         protected, up to
       loaded back yet            device in time              2 x expected + min_grace_s

``lead`` = the link's estimate for the tag's host pages + ``lead_margin_s``: a long tool call
does not hold device room other agents need now, and the KV is back when the agent resumes.
The tag goes when the agent's next request arrives (its own request pins the path), when the
workflow ends, or at ``expires_at`` (a tool far slower than measured: no plan any more).

**Turn gaps** (no tool, no client hint). In a group chat (AutoGen) or a message-passing graph
(LangGraph), an agent's next prompt is often its last one plus what the others said since: an
AutoGen PEER reviewer's second call reuses 1,264 of the 1,292 tokens of its first, 224 of them
past its fixed prompt. Those 224 are a dynamic suffix (+inf), so while the expresser runs in
between they are the first thing evicted, and the reviewer loads them back on its critical
path (RESULTS.md §6.42). :meth:`arrived` learns, per app and agent (per workflow without an
app), whether the agent's new prompt extends its last turn: whether it reuses at least half of
what that turn added past the agent's tagged fixed prefix (at least a page; the template
tokens every message starts with do not count as a history). For an agent that does,
:meth:`finished` opens a turn gap: the same resume tag on its last turn, whose STE follows the
agent's own effective STE (:meth:`tick`), so the turn is kept exactly as long as the agent's
fixed prompt is and prefetched with it. An agent whose next
prompt stops extending its last turn unlearns it (one turn's protection is what a wrong guess
costs). A tool hint turns a turn gap into a tool gap. No turn gap opens while another request
of the same agent is in flight: parallel instances under one name (LangGraph's ``Send``
fan-out of executors) keep the agent at STE 0 until the last one ends, so that STE says
nothing about when a finished instance's turn is read again, and holding each finished turn
at 0 took the room the next agent's prefetch needed (RESULTS.md §6.42).

Invariants: T1 a resume tag exists only while its gap is open (between the tool hint, or the
end of a learned agent's turn, and the agent's next request, the expiry or the workflow's end);
T2 a tool gap's STE is ``hold_ste`` before ``resume_at - lead`` and ``near_ste`` from then on,
a turn gap's the agent's effective STE as of the last :meth:`tick`; T3 without
``kvflow_tool_s`` and without an agent whose prompts extend its last turn past its fixed prefix
nothing here runs (the policy is exactly the one without gaps); T4 an agent with no fixed
prefix tagged is never learned (its fixed prompt alone would read as reuse); T5 a turn gap
opens only for a request with no other request of its agent in flight.

Pure Python, engine-agnostic: the manager calls :meth:`finished` (a request's written tokens),
:meth:`waiting` (a tool hint), :meth:`arrived` (a request of that agent, with its prompt),
:meth:`tick` and :meth:`release`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .boundary import common_prefix_len
from .hints import workflow_key

RESUME = "\u27f2"  # appended to an agent's name: its resume tag ("executor/agent⟲")
INF = math.inf


@dataclass
class Gap:
    workflow: str
    app: str | None
    agent: str
    started: float
    resume_at: float
    expires_at: float
    ste: float = INF
    kind: str = "tool"   # "tool": planned from the tool's duration; "turn": the agent's own STE


def resume_agent(agent: str) -> str:
    return agent + RESUME


class ToolGaps:
    """Resume tags with a time plan (module doc)."""

    def __init__(self, tags: Any, *, load_s: Callable[[Any], float] | None = None,
                 hold_ste: float = 2, near_ste: float = 1, lead_margin_s: float = 0.05,
                 min_grace_s: float = 1.0, max_tracked: int = 4096, turn_gaps: bool = True) -> None:
        self.tags = tags
        self.turn_gaps = turn_gaps  # False: tool gaps only (nothing is learned; the ablation)
        self.load_s = load_s or (lambda node: 0.0)
        self.hold_ste, self.near_ste = hold_ste, near_ste
        self.lead_margin_s = lead_margin_s
        self.min_grace_s = min_grace_s
        self.max_tracked = max_tracked
        # (wf key, agent) -> (last turn's tokens, how to find its node: None = the book's locate)
        self.last: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.gaps: dict[tuple, Gap] = {}                         # (wf key, agent) -> open gap
        # ("app", app, agent), or ("wf", wf key, agent) without an app: agents whose prompts
        # extend their last turn
        self.extends: "OrderedDict[tuple, bool]" = OrderedDict()
        self.opened = self.closed_by_request = self.expired = 0
        self.turns_opened = 0

    # ------------------------------------------------------------------ events
    def finished(self, workflow: str, agent: str, app: str | None, tokens: Sequence[int],
                 locate: Callable[[tuple], Any] | None = None, now: float | None = None,
                 siblings: bool = False) -> None:
        """A request of ``agent`` finished with ``tokens`` (prompt + generated, with KV) cached.
        ``locate``: how to find that turn's node when a gap opens, for an engine whose tree
        keys more than tokens (SGLang: the request's LoRA / cache-salt namespace); None: the
        tag book's own. ``now``: with it, an agent learned to extend its turns gets a turn gap
        (module doc); without it, only the turn is recorded. ``siblings``: another request of
        this agent is still in flight (T5: no turn gap)."""
        key = (workflow_key(workflow, app), agent)
        self.last[key] = (tuple(tokens), locate)
        self.last.move_to_end(key)
        while len(self.last) > self.max_tracked:
            self.last.popitem(last=False)
        if (now is None or siblings or key in self.gaps
                or not self.extends.get(self._learn_key(key, app))):
            return
        gap = Gap(workflow, app, agent, now, INF, INF, kind="turn")
        self.gaps[key] = gap
        self.tags.tag_fixed_prefix(tokens, len(tokens), workflow, resume_agent(agent), app=app,
                                   locate=locate, remember=False)
        self.turns_opened += 1
        self._set(gap, self._plan(gap, now), now)

    def waiting(self, workflow: str, app: str | None, tool_s: dict, now: float) -> list[str]:
        """A tool step started; ``tool_s``: agents that resume after it -> expected seconds.
        Returns the agents that got a resume tag (those whose last turn is known)."""
        out = []
        for agent, secs in tool_s.items():
            key = (workflow_key(workflow, app), agent)
            tokens, locate = self.last.get(key, ((), None))
            if not tokens:
                continue
            secs = max(0.0, float(secs))
            gap = Gap(workflow, app, agent, now, now + secs, now + 2 * secs + self.min_grace_s)
            self.gaps[key] = gap
            self.tags.tag_fixed_prefix(tokens, len(tokens), workflow, resume_agent(agent), app=app,
                                       locate=locate, remember=False)
            self.opened += 1
            self._set(gap, self._plan(gap, now), now)
            out.append(agent)
        return out

    def arrived(self, workflow: str, agent: str, app: str | None, now: float,
                tokens: Sequence[int] | None = None) -> None:
        """A request of ``agent`` arrived: its own request takes over; the gap closes. With its
        prompt ``tokens``: learn whether it extends the agent's last turn (module doc)."""
        key = (workflow_key(workflow, app), agent)
        if tokens is not None and self.turn_gaps:
            self._learn(key, workflow, agent, app, tokens)
        gap = self.gaps.pop(key, None)
        if gap is not None:
            self.closed_by_request += 1
            self._set(gap, INF, now)

    @staticmethod
    def _learn_key(key: tuple, app: str | None) -> tuple:
        return ("app", app, key[1]) if app else ("wf",) + key

    def _learn(self, key: tuple, workflow: str, agent: str, app: str | None,
               tokens: Sequence[int]) -> None:
        """Does ``tokens`` reuse at least half of what the agent's last turn added past its
        fixed prefix (and at least a page)? Half, not any: the chat template's header of the
        next message (``<|im_start|>user\n``, a task template) follows every fixed prompt, and
        a prompt that shares only that has a new history, not the last one extended."""
        last = self.last.get(key)
        fixed = self.tags.fixed_prefix_len(workflow, agent, app)
        if last is None or fixed <= 0:  # (T4)
            return
        ps = self.tags.page_size
        added = len(last[0]) - fixed
        reused = common_prefix_len(tokens, last[0], step=ps) - fixed
        extends = reused >= max(ps, added / 2)
        lk = self._learn_key(key, app)
        if not extends:
            self.extends.pop(lk, None)
            return
        self.extends[lk] = True
        self.extends.move_to_end(lk)
        while len(self.extends) > self.max_tracked:
            self.extends.popitem(last=False)

    def tick(self, now: float) -> None:
        """Move each open gap along its plan (tool: hold -> near -> expired; turn: the agent's
        STE)."""
        for key, gap in list(self.gaps.items()):
            ste = self._plan(gap, now)
            if ste == INF:  # a tool far slower than planned, or an agent no longer expected
                del self.gaps[key]
                if gap.kind == "tool":
                    self.expired += 1
            if ste != gap.ste:
                self._set(gap, ste, now)

    def release(self, workflow: str, app: str | None = None) -> None:
        """The workflow ended (its tags are dropped by the tag book)."""
        wf = workflow_key(workflow, app)
        for key in [k for k in self.gaps if k[0] == wf]:
            del self.gaps[key]
        for key in [k for k in self.last if k[0] == wf]:
            del self.last[key]
            self.extends.pop(("wf",) + key, None)  # (an app's agents stay learned)

    def as_dict(self) -> dict:
        """Counters and open gaps, for the engines' snapshots (``/kvflow/v1/cache``)."""
        kinds = [g.kind for g in self.gaps.values()]
        return {"turn_gaps": self.turn_gaps, "open_tool": kinds.count("tool"),
                "open_turn": kinds.count("turn"), "tool_opened": self.opened,
                "turns_opened": self.turns_opened, "closed_by_request": self.closed_by_request,
                "tool_expired": self.expired, "agents_learned": len(self.extends)}

    # ------------------------------------------------------------------ plan
    def _plan(self, gap: Gap, now: float) -> float:
        if gap.kind == "turn":  # +inf while the agent is not expected: a dynamic suffix again
            return self.tags.effective_ste((workflow_key(gap.workflow, gap.app), gap.agent))
        if now >= gap.expires_at:
            return INF
        node = self.tags.agent_node(gap.workflow, resume_agent(gap.agent), gap.app)
        lead = self.load_s(node) + self.lead_margin_s
        return self.near_ste if now >= gap.resume_at - lead else self.hold_ste

    def _set(self, gap: Gap, ste: float, now: float) -> None:
        gap.ste = ste
        self.tags.update(gap.workflow, {resume_agent(gap.agent): ste}, app=gap.app, now=now)

    def next_change_at(self) -> float | None:
        """When the next open gap moves on (for an engine that sleeps between steps)."""
        times = []
        for g in self.gaps.values():
            if g.kind == "turn":  # moves with hints, not with time
                continue
            if g.ste == self.near_ste:
                times.append(g.expires_at)
            else:
                node = self.tags.agent_node(g.workflow, resume_agent(g.agent), g.app)
                times.append(g.resume_at - self.load_s(node) - self.lead_margin_s)
        return min(times) if times else None
