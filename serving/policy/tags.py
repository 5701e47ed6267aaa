"""The tag book: which node ends each agent's fixed prefix, and how urgent that agent is.

A *tag* is ``(workflow key, agent)``. The book owns the :class:`~.hints.HintRegistry` (raw STE
per workflow and agent, leases, step times) and the :class:`~.priority.PriorityIndex` (tags on
nodes -> subtree-min node priority), and between the two the *effective* STE of a tag: the raw
one, +inf while the workflow's lease is expired or while a per-client cap demotes the tag.

It knows the engine's tree only through callables, so the same book runs over our
:class:`~.tree.RadixTree` and over SGLang's ``UnifiedTreeNode`` tree:

- ``parent_of(node)`` (for the index), ``alive(node)`` (still in the tree);
- ``locate(prefix) -> node | None``: the node where a page-aligned prefix ends, split there,
  or None when that prefix is not cached (per call for engines that need request context);
- ``is_host(node)`` (optional): the node is host-only; with it the book keeps the set of
  host-only tags incrementally (the engine reports tier changes with :meth:`node_tier`), so the
  prefetcher's candidates are ``near & host`` without a scan.

Also here: the fixed-prefix boundary when none is declared (what an agent's recent prompts
share, :func:`~.boundary.infer_boundary`) and per-app prefix memory (a new workflow instance of
an app protects an agent's prefix from its first hint, before the agent runs in it).

Invariants (checked by ``inspection.check_invariants``): B1 a record's node is alive and is the
index's node for its tag; B2 ``tag in host_tags`` iff its node is host-only (when tracked);
B3 ``tag in near`` iff its effective STE <= lookahead.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .boundary import infer_boundary
from .hints import HintRegistry, workflow_key
from .priority import PriorityIndex
from .toolgap import RESUME

INF = math.inf
Tag = tuple  # (workflow key, agent)


@dataclass
class AgentPrefix:
    tag: Tag
    tokens: tuple              # the page-aligned fixed prefix
    node: Any                  # tagged node, None while not in the tree


class TagBook:
    """Tags, hints and effective STE (module doc)."""

    def __init__(self, *, page_size: int, parent_of: Callable[[Any], Any],
                 alive: Callable[[Any], bool] = lambda n: True,
                 locate: Callable[[tuple], Any] | None = None,
                 is_host: Callable[[Any], bool] | None = None,
                 lookahead: float = 1, lease_s: float = 60.0,
                 client_cap_pages: int | None = None, infer_window: int = 3,
                 max_app_prefixes: int = 4096, max_dormant_prefixes: int = 1024) -> None:
        self.page_size = page_size
        self.lookahead = lookahead
        self.client_cap_pages = client_cap_pages
        self.infer_window = infer_window
        self.max_app_prefixes = max_app_prefixes
        self.max_dormant_prefixes = max_dormant_prefixes
        self.hints = HintRegistry(lease_s=lease_s)
        self.index = PriorityIndex(parent_of)
        self.alive = alive
        self.locate = locate
        self.is_host = is_host
        self.records: dict[Tag, AgentPrefix] = {}
        self.wf_tags: dict[str, set] = {}
        self.near: set = set()               # tags with effective STE <= lookahead
        self.host_tags: set = set()          # tags whose node is host-only (when tracked)
        # what the prefetcher's blocked-plan memo keys on: nodes that stopped being host-only
        # (loaded, or fresh KV adopted: the only way a host-only path gets shorter), and STE
        # changes of host-only tags (the prefetch candidates' urgency and budget)
        self.host_shrinks = 0
        self.host_ste_changes = 0
        self.demoted: set = set()            # tags over their client's device cap
        self._tag_seq: dict = {}             # tag -> order of first tagging (deterministic plans)
        self._seq = itertools.count()
        self._history: dict[Tag, deque] = {}
        # (app, agent) -> that agent's fixed prefix, remembered across workflow instances
        self._app_prefix: "OrderedDict[tuple[str, str], tuple]" = OrderedDict()
        # workflow key -> {agent: fixed prefix} of a workflow forgotten while quiet (its lease
        # and grace ran out, not ended): its own tags come back with its next hint
        self._dormant: "OrderedDict[str, dict]" = OrderedDict()
        self._dormant_prefixes = 0

    # ------------------------------------------------------------------ reads
    def node_of(self, tag: Tag):
        rec = self.records.get(tag)
        return rec.node if rec is not None else None

    def agent_node(self, workflow: str, agent: str, app: str | None = None):
        """The node tagged as ``agent``'s fixed-prefix end in ``workflow`` (None if not cached)."""
        return self.node_of((workflow_key(workflow, app), agent))

    def fixed_prefix_len(self, workflow: str, agent: str, app: str | None = None) -> int:
        rec = self.records.get((workflow_key(workflow, app), agent))
        return len(rec.tokens) if rec is not None else 0

    def effective_ste(self, tag: Tag) -> float:
        if tag in self.demoted:
            return INF
        return self.hints.ste(tag[0], tag[1])

    def prefetch_candidates(self) -> list[Tag]:
        """Tags near enough to prefetch (and host-only, when tracked), in first-tagging order:
        set order follows str hashes (PYTHONHASHSEED), and the planner keeps input order among
        equally urgent candidates."""
        near = self.near
        if self.is_host is not None:
            host = self.host_tags
            near = near & host if len(near) < len(host) else host & near
        return sorted(near, key=self._tag_seq.__getitem__)

    # ------------------------------------------------------------------ tagging
    def tag_fixed_prefix(self, tokens: Sequence[int], fixed_len_tokens: int, workflow: str,
                         agent: str, app: str | None = None, *,
                         locate: Callable[[tuple], Any] | None = None, remember: bool = True):
        """Tag the node where ``agent``'s fixed prefix ends (page-aligned down); returns it, or
        None when that prefix is not (fully) cached. Cheap when unchanged: call it per request.
        ``remember=False``: not an app-wide prefix (a tool gap's resume tag, :mod:`.toolgap`)."""
        wf = workflow_key(workflow, app)
        tag = (wf, agent)
        b = max(0, min(int(fixed_len_tokens), len(tokens))) // self.page_size * self.page_size
        prefix = tuple(tokens[:b])
        rec = self.records.get(tag)
        if rec is not None and rec.node is not None and rec.tokens == prefix and self.alive(rec.node):
            return rec.node
        if rec is None:
            rec = self.records[tag] = AgentPrefix(tag, prefix, None)
            self._tag_seq.setdefault(tag, next(self._seq))
            self.wf_tags.setdefault(wf, set()).add(tag)
        elif rec.tokens != prefix:
            self.index.remove_tag(tag)
            self.host_tags.discard(tag)
            rec.node = None
        rec.tokens = prefix
        self.refresh(tag)
        if b == 0:
            return None
        if app and remember:
            self._remember_app_prefix(app, agent, prefix)
        locate = locate or self.locate
        node = locate(prefix) if locate is not None else None
        if node is None:
            return None
        self.set_node(tag, node)
        return node

    def set_node(self, tag: Tag, node) -> None:
        """Put ``tag`` (already recorded) on ``node``."""
        rec = self.records[tag]
        rec.node = node
        self.index.set_tag(tag, node, INF)
        if self.is_host is not None:
            if self.is_host(node):
                self.host_tags.add(tag)
            else:
                self.host_tags.discard(tag)
        self.refresh(tag)
        if self.client_cap_pages is not None:
            self._apply_client_cap(self.hints.client_of(tag[0]))

    def prompts_seen(self, workflow: str, agent: str, app: str | None = None) -> int:
        """Prompts of ``agent`` in its boundary history (at most ``infer_window``)."""
        return len(self._history.get((workflow_key(workflow, app), agent), ()))

    def infer_boundary(self, workflow: str, agent: str, tokens: Sequence[int],
                       app: str | None = None) -> int:
        """No declared boundary: the page-aligned prefix this agent's last ``infer_window``
        prompts share (0 until two are seen). Records ``tokens`` in its history."""
        lcp = infer_boundary(self._history, (workflow_key(workflow, app), agent), tokens,
                             self.infer_window)
        return lcp // self.page_size * self.page_size

    # ------------------------------------------------------------------ hints
    def update(self, workflow: str, ste: dict, *, agent: str | None = None,
               step: int | None = None, app: str | None = None, client: str | None = None,
               now: float) -> None:
        """Merge a hint (``{agent: steps | None}``; ``agent`` = the sender, STE 0 unless the
        hint says otherwise) and reprioritise."""
        wf = workflow_key(workflow, app)
        if agent is not None and agent not in ste:
            ste = {**ste, agent: 0}
        changed, revived = self.hints.update(wf, ste, now=now, step=step,
                                             client=client or app or None, agent=agent)
        if revived:
            for tag in self.wf_tags.get(wf, ()):
                self.refresh(tag)
        else:
            # Hot path (a hint per request): the workflow is live, so the effective STE is
            # the raw one unless a client cap demoted the tag.
            records, demoted, near, look = self.records, self.demoted, self.near, self.lookahead
            set_ste, host = self.index.set_ste, self.host_tags
            for a, v in changed.items():
                tag = (wf, a)
                if tag in records:
                    if tag in demoted:
                        v = INF
                    if set_ste(tag, v) and tag in host:
                        self.host_ste_changes += 1
                    if v <= look:
                        near.add(tag)
                    else:
                        near.discard(tag)
        if wf in self._dormant:  # before the app's: its own prefixes, not another instance's
            self._restore_dormant(workflow, app, wf)
        if app and self._app_prefix:
            self._bind_app_prefixes(workflow, app, wf, changed)
        if self.client_cap_pages is not None and (changed or revived):
            self._apply_client_cap(self.hints.client_of(wf))

    def release(self, workflow: str, app: str | None = None, *, dormant: bool = False) -> list[Tag]:
        """The workflow ended: forget its hints and tags; returns the dropped tags.
        ``dormant``: it was only quiet for longer than its lease and grace (the hint registry
        forgot it), so its agents' fixed prefixes are remembered (bounded, oldest first out)
        and re-tagged by its next hint (:meth:`_restore_dormant`): a workflow that pauses
        (a person in the loop, a long tool) and resumes can prefetch its next agent again at
        once, instead of after each agent has run once more, or after binding another
        instance's prefix of the same app and agent."""
        wf = workflow_key(workflow, app)
        w = self.hints.release(wf)
        dropped = list(self.wf_tags.pop(wf, ()))
        self._forget_dormant(wf)
        if dormant:
            # int32 arrays: a 1,000-token prefix in 4 KB instead of a tuple's ~36 KB; not the
            # tool gaps' resume tags (their gaps go with the workflow)
            kept = {tag[1]: array("i", self.records[tag].tokens) for tag in dropped
                    if tag in self.records and self.records[tag].tokens and RESUME not in tag[1]}
            if kept:
                self._dormant[wf] = kept
                self._dormant_prefixes += len(kept)
                while self._dormant_prefixes > self.max_dormant_prefixes and len(self._dormant) > 1:
                    self._forget_dormant(next(iter(self._dormant)))
        for tag in dropped:
            self.index.remove_tag(tag)
            self.records.pop(tag, None)
            self._tag_seq.pop(tag, None)
            self.near.discard(tag)
            self.host_tags.discard(tag)
            self.demoted.discard(tag)
            self._history.pop(tag, None)
        if w is not None and self.client_cap_pages is not None:
            self._apply_client_cap(w.client)
        return dropped

    def expire(self, now: float) -> list[str]:
        """Leases: workflows quiet for longer than ``lease_s`` count as +inf from now on."""
        expired = self.hints.expire(now)
        for wf in expired:
            for tag in self.wf_tags.get(wf, ()):
                self.refresh(tag)
        return expired

    def refresh(self, tag: Tag) -> None:
        v = self.effective_ste(tag)
        if self.index.set_ste(tag, v) and tag in self.host_tags:
            self.host_ste_changes += 1
        if v <= self.lookahead:
            self.near.add(tag)
        else:
            self.near.discard(tag)

    def set_lookahead(self, lookahead: float) -> None:
        self.lookahead = lookahead
        for tag in self.records:
            self.refresh(tag)

    # ------------------------------------------------------------------ tree events
    def node_tier(self, node, on_host: bool) -> None:
        """``node`` became host-only (or readable again): keep ``host_tags`` in step."""
        if not on_host:
            self.host_shrinks += 1
        tags = self.index.tags_at(node)
        if tags:
            if on_host:
                self.host_tags.update(tags)
            else:
                self.host_tags.difference_update(tags)

    def node_removed(self, node) -> None:
        """``node`` leaves the tree: its tags lose their node (call before ``index.drop_node``)."""
        for tag in list(self.index.tags_at(node)):
            rec = self.records.get(tag)
            if rec is not None:
                rec.node = None
            self.host_tags.discard(tag)

    def rebuild_index(self) -> None:
        """Start a fresh priority index from the records whose node is still alive (an adapter
        whose tree hooks fell out of step; never expected)."""
        old = self.index
        self.index = PriorityIndex(old._parent_of, on_change=old.on_change)
        for tag, rec in self.records.items():
            if rec.node is not None and self.alive(rec.node):
                self.index.set_tag(tag, rec.node, self.effective_ste(tag))
            else:
                rec.node = None

    # ------------------------------------------------------------------ app prefixes, caps
    def _remember_app_prefix(self, app: str, agent: str, prefix: tuple) -> None:
        key = (app, agent)
        self._app_prefix[key] = prefix
        self._app_prefix.move_to_end(key)
        while len(self._app_prefix) > self.max_app_prefixes:
            self._app_prefix.popitem(last=False)

    def _forget_dormant(self, wf: str) -> None:
        kept = self._dormant.pop(wf, None)
        if kept:
            self._dormant_prefixes -= len(kept)

    def _restore_dormant(self, workflow: str, app: str | None, wf: str) -> None:
        """Re-tag a forgotten workflow's own agents (:meth:`release` with ``dormant``) when it
        hints again; each tag finds its node if the prefix is still cached in either tier."""
        kept = self._dormant.pop(wf)
        self._dormant_prefixes -= len(kept)
        for agent, prefix in kept.items():
            if (wf, agent) not in self.records:
                self.tag_fixed_prefix(prefix, len(prefix), workflow, agent, app=app, remember=False)

    def _bind_app_prefixes(self, workflow: str, app: str, wf: str, changed: dict) -> None:
        """Tag, in this workflow, the agents with a finite STE whose fixed prefix the app has
        shown before (in another workflow instance) but which have no tag here yet."""
        records = self.records
        for a, v in changed.items():
            if v == INF or (wf, a) in records:
                continue
            prefix = self._app_prefix.get((app, a))
            if prefix:
                self.tag_fixed_prefix(prefix, len(prefix), workflow, a, app=app)

    def set_client_cap(self, pages: int | None) -> None:
        """Change ``client_cap_pages`` (None: no cap) and re-apply it to every client."""
        if pages == self.client_cap_pages:
            return
        self.client_cap_pages = pages
        if pages is None:
            for tag in list(self.demoted):
                self.demoted.discard(tag)
                self.refresh(tag)
            return
        for client in {w.client for w in self.hints.workflows.values()}:
            self._apply_client_cap(client)

    def _apply_client_cap(self, client: str) -> None:
        """Fairness: a client's tags protect at most ``client_cap_pages`` pages; the least
        urgent tags beyond the cap count as +inf."""
        cap = self.client_cap_pages
        tags = []
        for wf, w in self.hints.workflows.items():
            if w.client != client:
                continue
            for tag in self.wf_tags.get(wf, ()):
                raw = self.hints.ste(wf, tag[1])
                if raw < INF:
                    tags.append((raw, tag))
        tags.sort(key=lambda x: x[0])
        used = 0
        for raw, tag in tags:
            used += len(self.records[tag].tokens) // self.page_size
            over = used > cap
            if over != (tag in self.demoted):
                if over:
                    self.demoted.add(tag)
                else:
                    self.demoted.discard(tag)
                self.refresh(tag)

