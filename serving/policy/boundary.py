"""Where an agent's fixed prefix ends when the client declares no boundary.

Rule (shared by every engine through :class:`~.tags.TagBook`):
the longest prefix common to the agent's last ``window`` prompts, 0 until two are seen. An
agent's fixed prompt is what stays the same across its calls; the rest is per-call variables.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, MutableMapping, Sequence


def common_prefix_len(a: Sequence, b: Sequence, hi: int | None = None, *, step: int = 1) -> int:
    """Length of the common prefix of ``a`` and ``b`` (at most ``hi``), rounded down to a
    multiple of ``step`` (a page). The one implementation the policy core, the tokenizers and
    the SGLang plugin share. Binary search on slices: comparing slices runs in C, so this beats
    a Python loop on long prompts (lists and tuples; other sequences are compared as lists).
    Each probe compares only the slice past the prefix already known equal: ~8 us for two
    1,070-token prompts that differ after 1,024 tokens, against ~22 us comparing from 0 (an
    arriving request is compared with up to 16 of its agent's earlier turns, toolgap.py)."""
    if not isinstance(a, (list, tuple)):
        a = list(a)
    if not isinstance(b, (list, tuple)):
        b = list(b)
    if type(a) is not type(b):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    hi = n if hi is None else min(hi, n)
    hi -= hi % step
    if a[:hi] == b[:hi]:
        return hi
    lo = 0
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi + step] != b[:hi + step] (or hi = max)
        mid = (lo + hi + step) // 2 // step * step
        if a[lo:mid] == b[lo:mid]:  # (a[:lo] is known equal: compare only what is new)
            lo = mid
        else:
            hi = mid - step
    return lo


def infer_boundary(history: MutableMapping[Hashable, deque], key: Hashable, tokens: Sequence[int],
                   window: int) -> int:
    """Record ``tokens`` in ``history[key]`` (the last ``window`` prompts) and return the length
    of the prefix all of them share (not page-aligned; 0 until two prompts are seen)."""
    hist = history.get(key)
    if hist is None:
        hist = history[key] = deque(maxlen=max(2, window))
    t = tuple(tokens)
    hist.append(t)
    if len(hist) < 2:
        return 0
    lcp = len(t)
    for other in hist:
        if other is not t:
            lcp = common_prefix_len(t, other, lcp)
    return lcp
