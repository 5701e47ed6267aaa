"""Page allocation for one KV tier (device or host): free page ids kept as sorted runs.

The engine owns the tensors; this pool only decides which page ids are in use, so allocation,
eviction and prefetch decisions stay in pure Python and identical across engines.

Why runs and not a free list: the embedded engine's attention gathers a sequence's pages with
``index_select``; on a CPU, pages scattered over the pool make that gather 15-40 % slower than
neighbouring ones (cache lines and TLB; measured on tiny-random, 8 x 1,090-token decode), and a
LIFO free list scatters them as soon as the pool recycles (the ``oracle``'s pool never frees:
part of why it decoded faster than kvflow at equal hit rates). So ``alloc(n)`` hands out the
smallest free run that holds all ``n`` pages (best fit keeps the long runs for long prefixes),
ascending; only when no run is long enough does it piece them together from the longest runs
(the fewest pieces). The host tier gets
the same, so backups and loads copy neighbouring pages too.

Invariants:
- an id is either free or allocated, never both; ``free()`` of a free id raises (double free);
- free runs are sorted, disjoint and never adjacent (``free()`` merges neighbours), and the
  free ids are exactly their union; ``num_free + num_used == capacity``;
- a bounded pool never hands out ``id >= capacity``; ``alloc`` returns ascending ids;
- a *growable* pool (the ``oracle`` policy's unbounded device) mints new ids instead of
  failing, so ``capacity`` only grows.

Cost: ``alloc`` is O(runs) (one scan for the best fit; O(runs log runs) when it must piece
runs together); ``free`` O(k log k + runs) for k ids (one run of neighbouring ids, the usual
case, is checked and cleared by slice; ``alloc`` marks its runs by slice: an alloc and free
of 64 pages take 2-3 us against 9 us id by id).
Runs stay few while ids come back in whole nodes, which are runs themselves; partial eviction
(the store's default) returns a node's tail and reloads it elsewhere later, which is how a
prefix still ends up in pieces (bench/RESULTS.md 6.10).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable


class PoolError(RuntimeError):
    """A page id was freed twice, or freed without being allocated."""


class PagePool:
    """Free page ids ``0 <= id < capacity``, as sorted runs ``[start, end)``."""

    def __init__(self, capacity: int, *, name: str = "device", growable: bool = False) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.growable = growable
        self._capacity = capacity
        self._starts: list[int] = [0] if capacity else []  # free runs, sorted by start
        self._ends: list[int] = [capacity] if capacity else []
        self._num_free = capacity
        self._used = bytearray(capacity)  # 1 = allocated; guards against double free

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._capacity - self._num_free

    @property
    def num_runs(self) -> int:
        """Free runs (1 on a fresh pool; a measure of fragmentation)."""
        return len(self._starts)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` ascending page ids, or ``None`` (nothing taken) when fewer are free and the
        pool is bounded."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return []
        if n > self._num_free:
            if not self.growable:
                return None
            self._grow(n - self._num_free)
        starts, ends = self._starts, self._ends
        best, best_len = -1, 0
        for i, (s, e) in enumerate(zip(starts, ends)):
            ln = e - s
            if ln >= n and (best < 0 or ln < best_len):
                best, best_len = i, ln
                if ln == n:
                    break
        used = self._used
        if best >= 0:
            s = starts[best]
            pages = list(range(s, s + n))
            if best_len == n:
                del starts[best], ends[best]
            else:
                starts[best] = s + n
            used[s:s + n] = b"\x01" * n
        else:  # no run holds n: the longest runs (fewest pieces), then the head of the next
            order = sorted(range(len(starts)), key=lambda j: ends[j] - starts[j], reverse=True)
            pieces, left, gone = [], n, set()
            for j in order:
                take = min(ends[j] - starts[j], left)
                pieces.append((starts[j], take))
                left -= take
                if take == ends[j] - starts[j]:
                    gone.add(j)
                else:
                    starts[j] += take
                if not left:
                    break
            if gone:
                self._starts = starts = [x for j, x in enumerate(starts) if j not in gone]
                self._ends = ends = [x for j, x in enumerate(ends) if j not in gone]
            pages = [p for s, k in sorted(pieces) for p in range(s, s + k)]
            for s, k in pieces:
                used[s:s + k] = b"\x01" * k
        self._num_free -= n
        return pages

    def free(self, pages: Iterable[int]) -> None:
        used, cap = self._used, self._capacity
        ids = sorted(pages)
        n = len(ids)
        if n and ids[-1] - ids[0] + 1 == n and ids[0] >= 0 and ids[-1] < cap:
            # one run of neighbouring ids, the usual case (alloc hands out runs, nodes free
            # theirs whole): checked and cleared by slice, no loop over the ids
            lo, hi = ids[0], ids[-1] + 1
            if not used.count(0, lo, hi):
                used[lo:hi] = bytes(n)
                self._num_free += n
                self._insert_run(lo, hi)
                return
        for k, p in enumerate(ids):
            if p < 0 or p >= cap or not used[p] or (k and ids[k - 1] == p):
                raise PoolError(f"{self.name} pool: page {p} freed but not allocated")
        for p in ids:
            used[p] = 0
        self._num_free += len(ids)
        i = 0
        while i < len(ids):  # each run of consecutive ids enters as one piece
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            self._insert_run(ids[i], ids[j - 1] + 1)
            i = j

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self._capacity and bool(self._used[page])

    def free_runs(self) -> list[tuple[int, int]]:
        """The free runs ``[(start, end), ...]`` (tests, inspection)."""
        return list(zip(self._starts, self._ends))

    def _insert_run(self, s: int, e: int) -> None:
        starts, ends = self._starts, self._ends
        i = bisect_left(starts, s)
        if i and ends[i - 1] == s:            # joins the run before
            i -= 1
            ends[i] = e
        else:
            starts.insert(i, s)
            ends.insert(i, e)
        if i + 1 < len(starts) and starts[i + 1] == ends[i]:  # and the run after
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]

    def _grow(self, n: int) -> None:
        start = self._capacity
        self._capacity += n
        self._used.extend(bytes(n))
        self._num_free += n
        self._insert_run(start, self._capacity)
