"""Tagging in the SGLang plugin: where :class:`~.cache.KVFlowRadixCache` puts an agent's fixed
prefix tag in SGLang's tree, and what a finished request leaves for its agent's next turn
(a mixin, like :mod:`.hints` and :mod:`.loads`).

- ``checkpoint_into_tree`` (SGLang caches a request's computed tokens): the request's prefill
  is timed (the recompute estimate, ``cache.py``), its agent is no longer held from prefetch,
  a finished request's whole turn is recorded for the tool and turn gaps
  (``serving/policy/toolgap.py``), and its fixed prefix is tagged once it is cached
  (:meth:`_tag_request`: the declared boundary, else the one the book infers from the agent's
  prompts; page-aligned down; not before a chunked prefill has cached all of it).
- :meth:`_prefix_node`: the node where a prefix ends, split there with SGLang's own
  prompt-boundary trick (a re-insert of the cached path's own pages with ``prev_prefix_len``:
  nothing changes hands). Hybrid trees (SWA / Mamba state per node), which SGLang splits only
  when Full-only, get the deepest node ending within the prefix instead (:meth:`_node_within`).
- :meth:`_locate`: the same for a prefix with no request at hand (an app prefix bound to a new
  workflow, a tool gap's resume tag), keyed by the request's LoRA id / cache salt as SGLang's
  tree is.

State lives on the cache (``KVFlowRadixCache._kv_reset_state``): ``_req_hints``, ``kv_book``,
``kv_gaps``, ``kv_stats``.
"""

from __future__ import annotations

import logging
from array import array

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from .hints import ReqHints

logger = logging.getLogger(__name__)

FULL = ComponentType.FULL


class KVFlowTagging:
    """Fixed-prefix tags and finished turns over SGLang's tree (module doc)."""

    def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        self._note_prefill(req)
        info = self._req_hints.get(getattr(req, "rid", None))
        if info is None:
            return
        self._unhold(info)  # admitted and computed: its prefix is in the tree
        if req.finished():
            self._req_hints.pop(req.rid, None)
            siblings = any(o.tag == info.tag for o in self._req_hints.values())
            # what the agent's resumed turn would start with (a tool gap's resume tag)
            extra, salt = req.extra_key, getattr(req, "cache_salt", None)
            self.kv_gaps.finished(info.workflow, info.agent, info.app,
                                  req.full_untruncated_fill_ids[:up_to],
                                  locate=None if extra is None and salt is None else
                                  lambda prefix: self._locate(prefix, extra, salt),
                                  now=self._kv_now(), siblings=siblings)
        if info.tagged:
            return
        try:
            info.tagged = self._tag_request(req, info)
        except Exception:  # advisory: a tagging bug must not fail the request
            info.tagged = True
            logger.exception("kvflow: tagging failed for %s", req.rid)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        info = self._req_hints.pop(getattr(req, "rid", None), None)
        if info is not None:
            self._unhold(info)

    def _tag_request(self, req, info: ReqHints) -> bool:
        """Tag the request's fixed prefix; True when done (or nothing to do ever)."""
        if self.disable or req.last_node is None:
            return True
        ps = self.page_size
        cached = int(req.kv.cache_protected_len)  # tokens of this request now owned by the tree
        book = self.kv_book
        if info.fixed_tokens is not None:
            boundary = min(info.fixed_tokens, len(req.origin_input_ids))
            if cached < boundary // ps * ps:
                return False  # chunked prefill: not all of the fixed prefix is cached yet
        prompt = list(req.origin_input_ids)  # (not copied per chunk while the prefix fills)
        if info.fixed_tokens is None:
            boundary = book.infer_boundary(info.workflow, info.agent, prompt, info.app)
            if boundary:
                self.kv_stats["inferred_tags"] += 1
        boundary = min(boundary, cached) // ps * ps
        if boundary <= 0:
            return True
        before = book.node_of(info.tag)
        extra, salt = req.extra_key, getattr(req, "cache_salt", None)
        node = book.tag_fixed_prefix(
            prompt, boundary, info.workflow, info.agent, app=info.app,
            locate=lambda prefix: self._prefix_node(prefix, extra, salt, req.last_node))
        if node is not None and node is not before:
            self.kv_stats["tags"] += 1
        return True

    def _locate(self, prefix: tuple, extra_key=None, cache_salt=None):
        """The node where a cached prefix ends, split there. The book's default locate (an app
        prefix bound to a new workflow: no request, no extra key); a tool gap's resume tag
        passes its request's LoRA id / cache salt (SGLang keys the tree by them too)."""
        key = self._radix_key(prefix, extra_key, cache_salt)
        res = self.match_prefix(MatchPrefixParams(key=key))
        if res.device_prefix_len < len(prefix) // self.page_size * self.page_size:
            return None
        return self._prefix_node(prefix, extra_key, cache_salt, res.last_device_node)

    def _radix_key(self, tokens, extra_key, cache_salt) -> RadixKey:
        return RadixKey(array("q", tokens), extra_key, is_bigram=self.tree_core.is_eagle,
                        cache_salt=cache_salt).page_aligned(self.page_size)

    def _prefix_node(self, tokens, extra_key, cache_salt, anchor_id):
        """Split the tree where ``tokens`` end (page-aligned, already cached on device below
        ``anchor_id``) and return that node, or None when that prefix is not cached."""
        if anchor_id is None or len(tokens) < self.page_size:
            return None
        key = self._radix_key(list(tokens), extra_key, cache_salt)
        b = len(key)
        if b <= 0:
            return None
        if not self._full_only():
            return self._node_within(anchor_id, b)
        # Values of the cached path (the tree's own pages): re-inserting key[:b] with them
        # and prev_prefix_len = b only splits (no page changes hands, nothing is freed).
        path_values = self.path_device_indices(anchor_id)
        if len(path_values) < b:
            return None
        result = self.insert(InsertParams(key=key, value=path_values[:b].clone(),
                                          prev_prefix_len=b, inserted_len=b))
        node = self.tree_core._node_arena.get(result.last_device_node)
        if node is None or result.prefix_len < b:
            return None
        return node

    def _full_only(self) -> bool:
        comps = self._components_tuple
        return len(comps) == 1 and comps[0].component_type == FULL

    def _node_within(self, anchor_id, b: int):
        """Hybrid models (SWA / Mamba state per node): SGLang splits only Full-only trees, so
        neither do we; the tag goes on the deepest cached node that ends within the fixed
        prefix (a slightly shorter protected prefix, never a longer one)."""
        node = self.tree_core._node_arena.get(anchor_id)
        if node is None:
            return None
        ends, n, root = [], node, self.tree_core.root_node
        while n is not None and n is not root:
            ends.append(n)
            n = n.parent
        depth, best = 0, None
        for n in reversed(ends):
            depth += len(n.key)
            if depth > b:
                break
            best = n
        return best
