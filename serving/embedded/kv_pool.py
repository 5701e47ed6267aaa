"""Two-tier paged KV memory for the embedded engine; the policy core's ``KVTransferBackend``.

Both tiers are one tensor each, same layout as the model reads
(``[layers, 2, num_pages, page_size, kv_heads, head_dim]``):

- ``device_kv`` on ``device`` (cpu or cuda): what ``LlamaModel.prefill/decode_batch`` read/write.
- ``host_kv`` in host RAM (pinned only when the device is CUDA: a CPU-only torch cannot pin).

Page ids are handed out by the policy's allocators; this class never allocates.

- ``backup_to_host(device_pages, host_pages)``: synchronous copy device -> host.
- ``start_load(host_pages, device_pages) -> ready_time``: copies host -> device. On CPU the copy
  is done before returning. On CUDA it is queued on a separate stream after the compute stream's
  current work and recorded with an event; call ``wait_loads(device_pages)`` (GPU-side wait, no
  CPU block) before a forward that reads them, ``is_ready(device_pages)`` to poll.
  With ``host_link_gbps`` the returned time is virtual: ``max(now, link free) + bytes / (X*1e9)``,
  i.e. X is in gigaBYTES per second and loads queue on one emulated link; the copy itself is
  done at once, the pages are only declared usable later, costing no CPU. Without it the
  returned time is ``now()`` on CPU (copy already done) and an estimate on CUDA.
- ``bytes_per_page``; ``now()`` (``time.monotonic`` unless a ``clock`` is given).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .model.config import LlamaConfig
from .model.llama import resolve_device


class PagedKVPool:
    CUDA_EST_BYTES_PER_S = 20e9  # only for the returned estimate; events give the truth

    def __init__(self, config: LlamaConfig, *, device_pages: int, host_pages: int,
                 page_size: int = 16, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, host_link_gbps: float | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.page_size = page_size
        self.device = resolve_device(device)
        self.dtype = dtype or config.torch_dtype
        self.host_link_gbps = host_link_gbps
        self._clock = clock or time.monotonic
        shape = (config.num_layers, 2, 0, page_size, config.num_kv_heads, config.head_dim)
        dev_shape = shape[:2] + (device_pages,) + shape[3:]
        host_shape = shape[:2] + (host_pages,) + shape[3:]
        self._cuda = self.device.type == "cuda"
        self.device_kv = torch.zeros(dev_shape, dtype=self.dtype, device=self.device)
        self.host_kv = torch.zeros(host_shape, dtype=self.dtype,
                                   pin_memory=self._cuda and torch.cuda.is_available())
        self._link_free_at = 0.0
        self._pending: list[tuple[object, frozenset[int]]] = []  # (cuda event, device pages)
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self.stats = {"backup_pages": 0, "load_pages": 0, "backup_s": 0.0, "load_s": 0.0}

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_device_pages(self) -> int:
        return self.device_kv.shape[2]

    @property
    def num_host_pages(self) -> int:
        return self.host_kv.shape[2]

    @property
    def bytes_per_page(self) -> int:
        c = self.config
        return (c.num_layers * 2 * self.page_size * c.num_kv_heads * c.head_dim
                * self.device_kv.element_size())

    # -- KVTransferBackend -------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    def _idx(self, pages: Sequence[int], n: int, device) -> torch.Tensor:
        t = torch.as_tensor(list(pages), dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
            raise IndexError(f"page id out of range [0, {n})")
        return t.to(device)

    def backup_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("backup_to_host: page lists differ in length")
        if not device_pages:
            return
        t0 = time.perf_counter()
        d = self._idx(device_pages, self.num_device_pages, self.device)
        h = self._idx(host_pages, self.num_host_pages, "cpu")
        if self._cuda:
            self.wait_loads(device_pages)
        data = self.device_kv.index_select(2, d)
        self.host_kv.index_copy_(2, h, data.cpu() if self._cuda else data)  # .cpu() syncs
        self.stats["backup_pages"] += len(device_pages)
        self.stats["backup_s"] += time.perf_counter() - t0

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> float:
        if len(device_pages) != len(host_pages):
            raise ValueError("start_load: page lists differ in length")
        start = self.now()
        if not device_pages:
            return start
        t0 = time.perf_counter()
        h = self._idx(host_pages, self.num_host_pages, "cpu")
        d = self._idx(device_pages, self.num_device_pages, self.device)
        nbytes = len(device_pages) * self.bytes_per_page
        if self._cuda:
            self._cuda_load(h, d, frozenset(int(p) for p in device_pages))
            ready = start + nbytes / self.CUDA_EST_BYTES_PER_S
        else:
            self.device_kv.index_copy_(2, d, self.host_kv.index_select(2, h))
            ready = start
        if self.host_link_gbps:
            begin = max(start, self._link_free_at)
            self._link_free_at = begin + nbytes / (self.host_link_gbps * 1e9)
            ready = max(ready, self._link_free_at)
        self.stats["load_pages"] += len(device_pages)
        self.stats["load_s"] += time.perf_counter() - t0
        return ready

    # -- CUDA stream details -----------------------------------------------------------------------
    def _cuda_load(self, h: torch.Tensor, d: torch.Tensor, pages: frozenset[int]) -> None:
        # gather on the CPU into a pinned staging buffer (the caching host allocator keeps it
        # alive until the async copy that uses it has finished), then H2D + scatter on our stream
        staging = torch.empty(self.host_kv.shape[:2] + (len(h),) + self.host_kv.shape[3:],
                              dtype=self.dtype, pin_memory=True)
        torch.index_select(self.host_kv, 2, h, out=staging)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # pages may still be read
        with torch.cuda.stream(stream):
            data = staging.to(self.device, non_blocking=True)
            self.device_kv.index_copy_(2, d, data)
            d.record_stream(stream)  # allocated on the compute stream, used on ours
            ev = torch.cuda.Event()
            ev.record(stream)
        self._pending.append((ev, pages))

    def is_ready(self, device_pages: Sequence[int] | None = None) -> bool:
        """True when no unfinished copy writes any of ``device_pages`` (all pages if None)."""
        self._prune()
        want = None if device_pages is None else set(device_pages)
        return not any(want is None or want & pages for _, pages in self._pending)

    def wait_loads(self, device_pages: Sequence[int] | None = None) -> None:
        """Make the current CUDA stream wait for loads into ``device_pages`` (all if None).
        No CPU block; a no-op on CPU, where loads complete inside ``start_load``."""
        if not self._pending:
            return
        want = None if device_pages is None else set(device_pages)
        cur = torch.cuda.current_stream(self.device)
        for ev, pages in self._pending:
            if want is None or want & pages:
                cur.wait_event(ev)
        self._prune()

    def synchronize(self) -> None:
        """Block the CPU until every load has finished."""
        for ev, _ in self._pending:
            ev.synchronize()
        self._pending.clear()

    def _prune(self) -> None:
        self._pending = [(ev, p) for ev, p in self._pending if not ev.query()]
