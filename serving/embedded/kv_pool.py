"""Two-tier paged KV memory for the embedded engine; the policy core's ``KVTransferBackend``.

Both tiers are one tensor each, same layout as the model reads
(``[layers, 2, num_pages, page_size, kv_heads, head_dim]``):

- ``device_kv`` on ``device`` (cpu or cuda): what ``LlamaModel.prefill/decode_batch`` read/write.
- ``host_kv`` in host RAM (pinned only when the device is CUDA: a CPU-only torch cannot pin).

Page ids are handed out by the policy's allocators; this class never allocates.

- ``backup_to_host(device_pages, host_pages)``: copies device -> host. On CPU with a copy
  thread it is queued there and returns at once; the engine thread's eviction does not wait
  for a memcpy, as a GPU's write-back does not (it goes on a copy stream). On CUDA, or
  without a copy thread, it is synchronous (after the loads still copying into those pages).
- ``start_load(host_pages, device_pages) -> ready_time``: copies host -> device in the
  background, as a GPU's copy engine would: on CUDA on a separate stream after the compute
  stream's current work, recorded with an event; on CPU inline (the default) or, with
  ``copy_thread``, on the copy thread. Inline is the CPU default because a copy running
  beside a forward goes through the same caches: with 8 workflows the copy thread slowed
  prefills that overlapped a copy 1.8x and made calls 1.4-2 % slower (bench/RESULTS.md
  §6.33); a GPU's copy engine does not charge its forwards that way. CPU copies keep the GIL
  (one memcpy per run of pages and layer's K or V): a copy that released it would wait for
  the event loop's thread to give it back, up to the 5 ms switch interval (``_copy_pages``).
- The copy thread is one FIFO: every copy runs after the copies queued before it, so a load
  reads a host page only after a backup queued earlier wrote it, and lands in a device page
  only after a backup queued earlier read it. The one exception keeps that order: a copy a
  forward waits for that has not started and shares no page (device or host) with any other
  unfinished copy is taken off the queue and run at once by the waiting thread, instead of
  after unrelated loads (an eviction's backup out of the pages a prefill is about to write,
  queued behind the prefetches of the same step, would otherwise hold that prefill ~2 ms).
  What is left to the caller: before a forward reads or writes pages, ``wait_copies(those
  pages)`` (CUDA: a GPU-side wait for loads into them; CPU: blocks until no queued copy
  writes or reads them, normally long since); ``is_ready`` polls.
  With ``host_link_gbps`` the returned time is virtual: ``max(now, link free) + bytes / (X*1e9)``,
  i.e. X is in gigaBYTES per second and loads queue on one emulated link; the pages are declared
  usable only then. Without it the returned time is ``now()`` on CPU and an estimate on CUDA.
- A copy that fails on the copy thread has already been promised (the policy freed a backup's
  device pages and may load its host pages; a load's node may already be read): from then on
  no KV in either tier can be trusted, so ``copy_failure`` holds the error, every
  ``wait_copies`` raises :class:`KVCopyFailed` (no forward reads KV after it) until the owner
  calls ``take_copy_failure()`` and drops what the cache held (the engine: ``_reset_cache``).
  Inline copies fail their caller instead, who knows which pages they were.
- ``bytes_per_page``; ``now()`` (``time.monotonic`` unless a ``clock`` is given).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Sequence

import torch

from .model.config import LlamaConfig
from .model.llama import resolve_device

log = logging.getLogger(__name__)


class KVCopyFailed(RuntimeError):
    """A copy on the copy thread failed: the KV in the pool cannot be trusted until reset."""


class PagedKVPool:
    CUDA_EST_BYTES_PER_S = 20e9  # only for the returned estimate; events give the truth

    def __init__(self, config: LlamaConfig, *, device_pages: int, host_pages: int,
                 page_size: int = 16, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, host_link_gbps: float | None = None,
                 clock: Callable[[], float] | None = None, copy_thread: bool = False) -> None:
        """``copy_thread`` (CPU): copy loads and backups on a background thread instead of
        inline on the caller's (the engine's) thread (see the module docstring)."""
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
        # unfinished copies, oldest first: the device pages each writes (a load) or reads (a
        # backup) and, on the CPU copy thread, the host pages (a CUDA load stages them at once)
        self._pending: list[_Copy] = []
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None  # CPU copies
        self._tier_bytes: dict[str, _TierBytes] = {}  # CPU copies: "device" | "host" -> its bytes
        self.copy_thread = bool(copy_thread) and not self._cuda
        self.stats = {"backup_pages": 0, "load_pages": 0, "backup_s": 0.0, "load_s": 0.0,
                      "copies_run_by_waiter": 0}
        self._stats_lock = threading.Lock()
        self.copy_failure: BaseException | None = None  # the copy thread's first failed copy

    @property
    def copy_mode(self) -> str:
        """Where copies between the tiers run, as ``kvflow serve`` reports it."""
        if self._cuda:
            return "copy stream"
        return "copy thread" if self.copy_thread else "inline"

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
        _check_ids(pages, n)
        return torch.as_tensor(list(pages), dtype=torch.long).to(device)

    @property
    def copying(self) -> bool:
        """A load or a background backup is (or may still be) copying."""
        return bool(self._pending)

    def backup_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        if len(device_pages) != len(host_pages):
            raise ValueError("backup_to_host: page lists differ in length")
        if not device_pages:
            return
        t0 = time.perf_counter()
        self.stats["backup_pages"] += len(device_pages)
        if self._cuda:
            d = self._idx(device_pages, self.num_device_pages, self.device)
            h = self._idx(host_pages, self.num_host_pages, "cpu")
            self.wait_copies(device_pages)
            self.host_kv.index_copy_(2, h, self.device_kv.index_select(2, d).cpu())  # .cpu() syncs
            self.stats["backup_s"] += time.perf_counter() - t0
            return
        _check_ids(host_pages, self.num_host_pages)  # here: a bad id fails the caller
        _check_ids(device_pages, self.num_device_pages)
        self._cpu_copy("backup", device_pages, host_pages)  # (after the loads queued before it)

    def start_load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> float:
        if len(device_pages) != len(host_pages):
            raise ValueError("start_load: page lists differ in length")
        start = self.now()
        if not device_pages:
            return start
        t0 = time.perf_counter()
        nbytes = len(device_pages) * self.bytes_per_page
        if self._cuda:
            h = self._idx(host_pages, self.num_host_pages, "cpu")
            d = self._idx(device_pages, self.num_device_pages, self.device)
            self._cuda_load(h, d, frozenset(int(p) for p in device_pages))
            ready = start + nbytes / self.CUDA_EST_BYTES_PER_S
        else:
            _check_ids(host_pages, self.num_host_pages)  # here: a bad id fails the caller
            _check_ids(device_pages, self.num_device_pages)
            self._cpu_copy("load", device_pages, host_pages)
            ready = start
        if self.host_link_gbps:
            begin = max(start, self._link_free_at)
            self._link_free_at = begin + nbytes / (self.host_link_gbps * 1e9)
            ready = max(ready, self._link_free_at)
        self.stats["load_pages"] += len(device_pages)
        if self._cuda:
            self.stats["load_s"] += time.perf_counter() - t0
        return ready

    def _cpu_copy(self, kind: str, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """A ``kind`` ("load": host -> device | "backup": device -> host) copy on CPU: queued on
        the copy thread, recorded against the device pages it writes or reads; else inline."""
        dst, src = ((self._bytes("device"), self._bytes("host")) if kind == "load"
                    else (self._bytes("host"), self._bytes("device")))
        dst_pages, src_pages = ((device_pages, host_pages) if kind == "load"
                                else (host_pages, device_pages))
        if not self.copy_thread:
            self._timed_copy(kind, dst, dst_pages, src, src_pages)
            return
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvflow-kv-copy")
        args = (kind, dst, list(dst_pages), src, list(src_pages))
        fut = self._copier.submit(self._timed_copy, *args)
        self._pending.append(_Copy(fut, frozenset(int(p) for p in device_pages),
                                   frozenset(int(p) for p in host_pages), args))

    def _bytes(self, tier: str) -> "_TierBytes":
        """A tier's :class:`_TierBytes`, made once per tensor (``.numpy()`` costs ~10 us, a
        one-page copy ~3 us); made again when the tensor is replaced (a growing pool)."""
        kv = self.device_kv if tier == "device" else self.host_kv
        cached = self._tier_bytes.get(tier)
        if cached is None or cached.tensor is not kv:
            cached = self._tier_bytes[tier] = _TierBytes(kv)
        return cached

    def _timed_copy(self, kind: str, dst: "_TierBytes", dst_pages: Sequence[int],
                    src: "_TierBytes", src_pages: Sequence[int]) -> None:
        """The copy itself (on the copy thread or inline), timed into ``stats``."""
        t0 = time.perf_counter()
        try:
            _copy_pages(dst, dst_pages, src, src_pages)
        except Exception as e:  # ids were checked: only a broken tensor gets here
            log.exception("KV %s of %d pages failed", kind, len(dst_pages))
            if self.copy_thread and self.copy_failure is None:
                self.copy_failure = e  # promised already: nothing in the pool is trusted now
            raise
        with self._stats_lock:  # (the copy thread and a waiter may both be copying)
            self.stats[f"{kind}_s"] += time.perf_counter() - t0

    def close(self) -> None:
        """Finish the copies in flight and stop the CPU copy thread (idempotent)."""
        self.synchronize()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None

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
        self._pending.append(_Copy(ev, pages))

    def is_ready(self, device_pages: Sequence[int] | None = None) -> bool:
        """True when no unfinished copy touches any of ``device_pages`` (all pages if None)."""
        self._prune()
        want = None if device_pages is None else set(device_pages)
        return not any(want is None or want & c.device_pages for c in self._pending)

    def wait_copies(self, device_pages: Sequence[int] | None = None) -> None:
        """The copies touching ``device_pages`` (all if None) happen before what follows, so a
        forward may read and write them: on CUDA the current stream waits for the loads into
        them (no CPU block); on CPU this thread blocks until the loads into them and the
        backups out of them are done. A no-op when nothing is in flight. After a copy thread's
        copy failed: :class:`KVCopyFailed` until ``take_copy_failure``."""
        if not self._pending:
            self._raise_if_failed()
            return
        want = None if device_pages is None else set(device_pages)
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            for c in self._pending:
                if want is None or want & c.device_pages:
                    cur.wait_event(c.done)
        else:
            for c in list(self._pending):
                if want is None or want & c.device_pages:
                    if not self._run_by_waiter(c):
                        c.done.result()  # a copy that failed raises here, on the reader's thread
        self._prune()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.copy_failure is not None:
            raise KVCopyFailed("a KV copy failed on the copy thread; the cache must be reset") \
                from self.copy_failure

    def take_copy_failure(self) -> BaseException | None:
        """The copy thread's first failed copy (None if none), after every copy still queued
        has run (their errors are logged, not raised); later waits no longer raise. The caller
        drops everything the cache held: a failed backup left host pages it promised
        unwritten, a failed load device pages a node may be read from."""
        exc = self.copy_failure
        if exc is None:
            return None
        pending, self._pending = self._pending, []
        concurrent.futures.wait([c.done for c in pending])
        self.copy_failure = None
        return exc

    def _run_by_waiter(self, c: "_Copy") -> bool:
        """Run the queued CPU copy ``c`` on this thread now, if that cannot change what any copy
        reads or writes: it has not started and no other unfinished copy touches its pages.
        True if it ran here (it is then off the queue and the record)."""
        if c.done.done() or any(o is not c and not o.done.done()
                                and (o.device_pages & c.device_pages or o.host_pages & c.host_pages)
                                for o in self._pending):
            return False
        if not c.done.cancel():  # the copy thread took it meanwhile
            return False
        self._pending.remove(c)
        self.stats["copies_run_by_waiter"] += 1
        self._timed_copy(*c.args)
        return True

    def synchronize(self) -> None:
        """Block the CPU until every copy has finished; then raise the first failed one's error
        (every copy is waited for first: none is left running untracked)."""
        pending, self._pending = self._pending, []
        failed: BaseException | None = None
        for c in pending:
            if self._cuda:
                c.done.synchronize()
                continue
            try:
                c.done.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the rest
                failed = failed or e
        if failed is not None:
            raise failed

    def _prune(self) -> None:
        if self._cuda:
            self._pending = [c for c in self._pending if not c.done.query()]
        else:
            self._pending = [c for c in self._pending if not c.done.done()]


class _Copy:
    """One unfinished copy: ``done`` (a CUDA event | a copy-thread future), the device and host
    pages it touches, and (CPU) the ``_timed_copy`` arguments to run it elsewhere."""

    __slots__ = ("done", "device_pages", "host_pages", "args")

    def __init__(self, done: object, device_pages: frozenset[int],
                 host_pages: frozenset[int] = frozenset(), args: tuple = ()) -> None:
        self.done, self.device_pages, self.host_pages, self.args = done, device_pages, host_pages, args


def page_runs(dst_pages: Sequence[int], src_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(dst_start, src_start, length)`` for the maximal stretches where both page lists count
    up by one (the page allocator hands out neighbouring ids, ``policy/pages.py``)."""
    runs: list[tuple[int, int, int]] = []
    d0 = s0 = prev_d = prev_s = -2
    n = 0
    for d, s in zip(dst_pages, src_pages):
        if d == prev_d + 1 and s == prev_s + 1:
            n += 1
        else:
            if n:
                runs.append((d0, s0, n))
            d0, s0, n = d, s, 1
        prev_d, prev_s = d, s
    if n:
        runs.append((d0, s0, n))
    return runs


def _check_ids(pages: Sequence[int], n: int) -> None:
    if pages and (min(pages) < 0 or max(pages) >= n):
        raise IndexError(f"page id out of range [0, {n})")


class _TierBytes:
    """A CPU pool tier's memory as one flat byte ``memoryview`` (shared, not copied): page ``p``
    of row ``r`` (one layer's K or V; the tier is contiguous) is the ``row_bytes`` bytes at
    ``(r * pages + p) * row_bytes``."""

    __slots__ = ("tensor", "mv", "rows", "pages", "row_bytes")

    def __init__(self, kv: torch.Tensor) -> None:
        self.tensor = kv
        self.rows, self.pages = kv.shape[0] * kv.shape[1], kv.shape[2]
        self.row_bytes = kv[0, 0, :1].numel() * kv.element_size()
        self.mv = memoryview(kv.view(-1).view(torch.uint8).numpy())


def _copy_pages(dst: _TierBytes, dst_pages: Sequence[int], src: _TierBytes,
                src_pages: Sequence[int]) -> None:
    """CPU copy of whole pages ``src[src_pages] -> dst[dst_pages]`` (ids checked by the caller):
    one ``memoryview`` slice assignment (a memcpy) per run of neighbouring pages and per layer's
    K and V. Unlike numpy's and torch's copies it keeps the GIL: they release it for the memcpy,
    and on a serving process getting it back waits for the event loop's thread to give it up,
    up to the 5 ms switch interval, per copy op: in a served 8-workflow run copies took 2.8x
    their CPU time, 64-page loads up to 6.7 ms for 0.3 ms of work (bench/RESULTS.md §6.35).
    tiny-random alone: 64 pages in one run 0.06 ms, scattered 0.3 ms, one page 3 us."""
    rb, d_mv, s_mv = dst.row_bytes, dst.mv, src.mv
    d_stride, s_stride = dst.pages * rb, src.pages * rb
    for d, s, n in page_runs(dst_pages, src_pages):
        d0, s0, nb = d * rb, s * rb, n * rb
        for r in range(dst.rows):
            od, os_ = d0 + r * d_stride, s0 + r * s_stride
            d_mv[od:od + nb] = s_mv[os_:os_ + nb]
