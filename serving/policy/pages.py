"""Page allocation for one KV tier (device or host): a free list of integer page ids.

The engine owns the tensors; this pool only decides which page ids are in use, so allocation,
eviction and prefetch decisions stay in pure Python and identical across engines.

Invariants:
- an id is either free or allocated, never both; ``free()`` of a free id raises (double free);
- ``num_free + num_used == capacity``; a bounded pool never hands out ``id >= capacity``;
- a *growable* pool (the ``oracle`` policy's unbounded device) mints new ids instead of
  failing, so ``capacity`` only grows.
"""

from __future__ import annotations

from typing import Iterable


class PoolError(RuntimeError):
    """A page id was freed twice, or freed without being allocated."""


class PagePool:
    """Free list of page ids ``0 <= id < capacity``."""

    def __init__(self, capacity: int, *, name: str = "device", growable: bool = False) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.growable = growable
        self._capacity = capacity
        # Pop from the end: ids come out in ascending order on a fresh pool (reads well in tests).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)  # 1 = allocated; guards against double free

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` page ids, or ``None`` (nothing taken) when fewer are free and the pool is bounded."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            if not self.growable:
                return None
            self._grow(n - len(self._free))
        free = self._free
        pages = free[len(free) - n:][::-1] if n else []
        del free[len(free) - n:]
        used = self._used
        for p in pages:
            used[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        used = self._used
        for p in pages:
            if p < 0 or p >= self._capacity or not used[p]:
                raise PoolError(f"{self.name} pool: page {p} freed but not allocated")
            used[p] = 0
            self._free.append(p)

    def is_allocated(self, page: int) -> bool:
        return 0 <= page < self._capacity and bool(self._used[page])

    def _grow(self, n: int) -> None:
        start = self._capacity
        self._capacity += n
        self._used.extend(bytes(n))
        self._free[:0] = range(self._capacity - 1, start - 1, -1)
