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

**Parallel instances.** The hints name an agent, not an instance, so the server tells instances
apart by their tokens: it keeps each finished turn of an agent not resumed yet (``last``: up to
``max_instances`` per agent, ``max_tracked`` in all), a tool hint opens its gap on the most
recently finished of them without a tool gap (the instance whose tool just started: LangGraph
posts the tool step right after that instance's call), each gap under a resume tag of its own
(``agent⟲``, ``agent⟲2``, ...), and a request closes the gap of the turn it extends. With one
key per agent, three ``Send`` executors each calling their tool kept one turn between them, and
the first executor to resume closed that one too (RESULTS.md §6.43).

Invariants: T1 a resume tag exists only while its gap is open (between the tool hint, or the
end of a learned agent's turn, and the agent's next request, the expiry or the workflow's end);
T2 a tool gap's STE is ``hold_ste`` before ``resume_at - lead`` and from then on ``near_ste``,
or the agent's own effective STE when that is lower (another instance of it running),
a turn gap's the agent's effective STE as of the last :meth:`tick`; T3 without
``kvflow_tool_s`` and without an agent whose prompts extend its last turn past its fixed prefix
nothing here runs (the policy is exactly the one without gaps); T4 an agent with no fixed
prefix tagged is never learned (its fixed prompt alone would read as reuse); T5 a turn gap
opens only for a request with no other request of its agent in flight; T6 a gap belongs to one
finished turn (one resume tag each), is opened on it by a tool hint or its own end, and is
closed by the request that extends that turn (not by another instance's).

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
    slot: int = 0        # which of the agent's resume tags (one per instance with a gap open)
    near: bool = False   # a tool gap past ``resume_at - lead`` (T2)

    @property
    def tag_agent(self) -> str:
        return resume_agent(self.agent, self.slot)


@dataclass
class Turn:
    """One finished request of an agent: what its resumed turn would start with."""
    tokens: tuple
    locate: Callable[[tuple], Any] | None  # how to find its node (None: the tag book's)
    gap: Gap | None = None


def resume_agent(agent: str, slot: int = 0) -> str:
    """The resume tag's agent name: ``agent⟲`` for the first gap open, ``agent⟲2``,
    ``agent⟲3`` for more instances of the agent waiting at once."""
    return agent + RESUME + (str(slot + 1) if slot else "")


class ToolGaps:
    """Resume tags with a time plan (module doc)."""

    def __init__(self, tags: Any, *, load_s: Callable[[Any], float] | None = None,
                 hold_ste: float = 2, near_ste: float = 1, lead_margin_s: float = 0.05,
                 min_grace_s: float = 1.0, max_tracked: int = 4096, max_instances: int = 16,
                 turn_gaps: bool = True) -> None:
        self.tags = tags
        self.turn_gaps = turn_gaps  # False: tool gaps only (nothing is learned; the ablation)
        self.load_s = load_s or (lambda node: 0.0)
        self.hold_ste, self.near_ste = hold_ste, near_ste
        self.lead_margin_s = lead_margin_s
        self.min_grace_s = min_grace_s
        self.max_tracked = max_tracked
        self.max_instances = max_instances
        # (wf key, agent) -> its finished turns not resumed yet, oldest first (T6)
        self.last: "OrderedDict[tuple, list[Turn]]" = OrderedDict()
        self.gaps: dict[tuple, Gap] = {}                     # (wf key, agent, slot) -> open gap
        # ("app", app, agent), or ("wf", wf key, agent) without an app: agents whose prompts
        # extend their last turn
        self.extends: "OrderedDict[tuple, bool]" = OrderedDict()
        self.opened = self.closed_by_request = self.expired = 0
        self.turns_opened = 0
        self.now_seen = -INF  # the latest event time (a dropped turn's gap is closed then)
        self.num_turns = 0    # in ``last``, all agents: at most ``max_tracked``

    def open_gaps(self, workflow: str, agent: str, app: str | None = None) -> list[Gap]:
        """The agent's open gaps (one per waiting instance), by slot."""
        wf = workflow_key(workflow, app)
        return sorted((g for k, g in self.gaps.items() if k[0] == wf and k[1] == agent),
                      key=lambda g: g.slot)

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
        if now is not None:
            self.now_seen = max(self.now_seen, now)
        key = (workflow_key(workflow, app), agent)
        turns = self.last.setdefault(key, [])
        turn = Turn(tuple(tokens), locate)
        turns.append(turn)
        self.num_turns += 1
        if len(turns) > self.max_instances:  # (an instance that never resumed)
            self._drop_turn(key, turns.pop(0))
        self.last.move_to_end(key)
        while self.num_turns > self.max_tracked:  # the least recently finished agent's oldest
            old_key = next(iter(self.last))
            old = self.last[old_key]
            self._drop_turn(old_key, old.pop(0))
            if not old:
                del self.last[old_key]
        if now is None or siblings or not self.extends.get(self._learn_key(key, app)):
            return
        self._open(key, turn, Gap(workflow, app, agent, now, INF, INF, kind="turn"), now)
        self.turns_opened += 1

    def waiting(self, workflow: str, app: str | None, tool_s: dict, now: float) -> list[str]:
        """A tool step started; ``tool_s``: agents that resume after it -> expected seconds.
        The tool is that of the agent's instance that finished last without a tool gap yet
        (T6); returns the agents that got a resume tag (those with such a turn)."""
        self.now_seen = max(self.now_seen, now)
        out = []
        for agent, secs in tool_s.items():
            key = (workflow_key(workflow, app), agent)
            turn = next((t for t in reversed(self.last.get(key, ()))
                         if t.tokens and (t.gap is None or t.gap.kind == "turn")), None)
            if turn is None:
                continue
            secs = max(0.0, float(secs))
            self._open(key, turn, Gap(workflow, app, agent, now, now + secs,
                                      now + 2 * secs + self.min_grace_s), now)
            self.opened += 1
            out.append(agent)
        return out

    def arrived(self, workflow: str, agent: str, app: str | None, now: float,
                tokens: Sequence[int] | None = None) -> None:
        """A request of ``agent`` arrived. With its prompt ``tokens``: it takes over the turn it
        extends, whose gap closes (T6), and teaches whether the agent's prompts extend its
        turns (module doc); one that extends none closes the agent's turn gaps (its tool gaps
        may be a sibling instance's, still in its tool). Without: every gap of the agent
        closes."""
        self.now_seen = max(self.now_seen, now)
        key = (workflow_key(workflow, app), agent)
        turns = self.last.get(key, [])
        if tokens is None:
            for t in turns:
                if t.gap is not None:
                    self._close(key, t, now)
            return
        fixed = self.tags.fixed_prefix_len(workflow, agent, app)
        best, reused = None, -1
        for t in turns:
            n = common_prefix_len(tokens, t.tokens, step=self.tags.page_size)
            if n > reused:
                best, reused = t, n
        extends = best is not None and self._extends(best, reused, fixed)
        if self.turn_gaps and best is not None and fixed > 0:  # (T4)
            self._learn(self._learn_key(key, app), extends)
        if extends:
            turns.remove(best)  # resumed: the new request's own turn will follow it
            self.num_turns -= 1
            if best.gap is not None:
                self._close(key, best, now)
            return
        for t in turns:
            if t.gap is not None and t.gap.kind == "turn":
                self._close(key, t, now)

    def _extends(self, turn: Turn, reused: int, fixed: int) -> bool:
        """Does a prompt that shares ``reused`` tokens with ``turn`` extend it: reuse at least
        half of what the turn added past the agent's fixed prefix, and at least a page? Half,
        not any: the chat template's header of the next message (``<|im_start|>user\n``, a
        task template) follows every fixed prompt, and a prompt that shares only that has a
        new history, not the last one extended."""
        return reused - fixed >= max(self.tags.page_size, (len(turn.tokens) - fixed) / 2)

    @staticmethod
    def _learn_key(key: tuple, app: str | None) -> tuple:
        return ("app", app, key[1]) if app else ("wf",) + key

    def _learn(self, lk: tuple, extends: bool) -> None:
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
        self.now_seen = max(self.now_seen, now)
        for key, gap in list(self.gaps.items()):
            ste = self._plan(gap, now)
            if ste == INF:  # a tool far slower than planned, or an agent no longer expected
                self._forget_gap(gap)
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
            self.num_turns -= len(self.last.pop(key))
            self.extends.pop(("wf",) + key, None)  # (an app's agents stay learned)

    def as_dict(self) -> dict:
        """Counters and open gaps, for the engines' snapshots (``/kvflow/v1/cache``)."""
        kinds = [g.kind for g in self.gaps.values()]
        return {"turn_gaps": self.turn_gaps, "open_tool": kinds.count("tool"),
                "open_turn": kinds.count("turn"), "tool_opened": self.opened,
                "turns_opened": self.turns_opened, "closed_by_request": self.closed_by_request,
                "tool_expired": self.expired, "agents_learned": len(self.extends),
                "turns_tracked": self.num_turns}

    # ------------------------------------------------------------------ gaps
    def _open(self, key: tuple, turn: Turn, gap: Gap, now: float) -> None:
        """Open ``gap`` on ``turn`` (in place of a turn gap it had: a tool hint turns it into a
        tool gap, same slot), tag the turn's node and set its first STE."""
        if turn.gap is not None:
            gap.slot = turn.gap.slot
        else:
            used = {k[2] for k in self.gaps if k[:2] == key}
            gap.slot = next(i for i in range(len(used) + 1) if i not in used)
        turn.gap = gap
        self.gaps[key + (gap.slot,)] = gap
        self.tags.tag_fixed_prefix(turn.tokens, len(turn.tokens), gap.workflow, gap.tag_agent,
                                   app=gap.app, locate=turn.locate, remember=False)
        self._set(gap, self._plan(gap, now), now)

    def _close(self, key: tuple, turn: Turn, now: float, *, by_request: bool = True) -> None:
        gap, turn.gap = turn.gap, None
        if self.gaps.pop(key + (gap.slot,), None) is gap:
            self.closed_by_request += by_request
            self._set(gap, INF, now)

    def _forget_gap(self, gap: Gap) -> None:
        key = (workflow_key(gap.workflow, gap.app), gap.agent)
        self.gaps.pop(key + (gap.slot,), None)
        for t in self.last.get(key, ()):
            if t.gap is gap:
                t.gap = None

    def _drop_turn(self, key: tuple, turn: Turn) -> None:
        """A turn no longer tracked (taken out of ``last`` by the caller): its gap goes too."""
        self.num_turns -= 1
        if turn.gap is not None:
            self._close(key, turn, max(self.now_seen, turn.gap.started), by_request=False)

    # ------------------------------------------------------------------ plan
    def _plan(self, gap: Gap, now: float) -> float:
        if gap.kind == "turn":  # +inf while the agent is not expected: a dynamic suffix again
            return self.tags.effective_ste((workflow_key(gap.workflow, gap.app), gap.agent))
        if now >= gap.expires_at:
            return INF
        # (T2: near from then on; once back on device its lead shrinks, and holding it again
        # would let it go again)
        gap.near = gap.near or now >= self._near_at(gap)
        if not gap.near:
            return self.hold_ste
        # A sibling instance of the agent running puts the agent at STE 0: its resumes come
        # before whatever waits for all of them (a fan-in's next agent, at 1 by the graph)
        return min(self.near_ste, self.tags.effective_ste((workflow_key(gap.workflow, gap.app),
                                                           gap.agent)))

    def _near_at(self, gap: Gap) -> float:
        """When a tool gap goes near: ``resume_at - lead`` (one formula for :meth:`_plan` and
        :meth:`next_change_at`, so an engine woken then finds it moved)."""
        node = self.tags.agent_node(gap.workflow, gap.tag_agent, gap.app)
        return gap.resume_at - (self.load_s(node) + self.lead_margin_s)

    def _set(self, gap: Gap, ste: float, now: float) -> None:
        gap.ste = ste
        self.tags.update(gap.workflow, {gap.tag_agent: ste}, app=gap.app, now=now)

    def next_change_at(self) -> float | None:
        """When the next open gap moves on (for an engine that sleeps between steps)."""
        times = []
        for g in self.gaps.values():
            if g.kind == "turn":  # moves with hints, not with time
                continue
            times.append(g.expires_at if g.near else self._near_at(g))
        return min(times) if times else None
