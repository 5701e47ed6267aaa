"""Where an agent's fixed prefix ends when the client declares no boundary.

Rule (shared by the embedded engine through :class:`KVCacheManager` and by the SGLang plugin):
the longest prefix common to the agent's last ``window`` prompts, 0 until two are seen. An
agent's fixed prompt is what stays the same across its calls; the rest is per-call variables.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, MutableMapping, Sequence


def common_prefix_len(a: tuple, b: tuple, hi: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``hi`` (binary search on slices:
    tuple comparison runs in C, so this beats a Python loop on long prompts)."""
    hi = min(hi, len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
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
