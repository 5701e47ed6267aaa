"""The seam between the engine-agnostic cache policy and an engine's KV memory.

The policy core (this package) owns *which* pages hold *what* and *when* they move: the radix
tree, page allocation in both tiers, eviction order, prefetch plans, node states. An engine owns
the bytes: tensors indexed by page id. It implements :class:`KVTransferBackend` so the policy can
ask for copies without importing torch (or SGLang, or the simulator's clock).

Invariants the policy relies on:
- page ids are ``0 <= id < num_pages`` of their tier and are only handed out by the policy's
  allocators, so the backend never allocates;
- when ``backup_to_host`` returns, the policy treats the host pages as holding the copy: it
  frees the device pages (they may be reallocated at once) and may load from the host pages.
  A backend that copies later must keep that true: order the copy before any later load from
  those host pages or into those device pages, and before the engine writes those device
  pages (the embedded pool: copies inline, or on one FIFO copy thread whose pages forwards
  ``wait_copies`` for);
- ``start_load`` may finish later: the returned time (same clock as ``now()``) is when the
  device pages become readable; until then the node is ``LOADING`` and must not be evicted or
  read by a batch. The engine's scheduler polls via the cache manager.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class KVTransferBackend(Protocol):
    """What an engine provides so the policy core can move KV between tiers."""

    def now(self) -> float:
        """Monotonic clock in seconds (real for engines, virtual for the simulator)."""
        ...

    def backup_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device pages to host pages (same order, same length); now, or ordered as above."""
        ...

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> float:
        """Begin copying host pages to device pages; return the time they are usable."""
        ...


class NullTransferBackend:
    """A backend that moves no bytes: for policy tests, benchmarks and the simulator's dry runs.

    ``link_bytes_per_s`` and ``bytes_per_page`` let it still report when a load would finish.
    """

    def __init__(self, *, bytes_per_page: int = 0, link_bytes_per_s: float | None = None,
                 clock=None) -> None:
        import time

        self._clock = clock or time.monotonic
        self.bytes_per_page = bytes_per_page
        self.link_bytes_per_s = link_bytes_per_s
        self.backups = 0
        self.loads = 0

    def now(self) -> float:
        return self._clock()

    def backup_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("backup_to_host: page lists differ in length")
        self.backups += len(device_pages)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> float:
        if len(device_pages) != len(host_pages):
            raise ValueError("start_load: page lists differ in length")
        self.loads += len(device_pages)
        start = self.now()
        if not self.link_bytes_per_s:
            return start
        return start + len(device_pages) * self.bytes_per_page / self.link_bytes_per_s
