"""Fixed glibc malloc thresholds for the engine's process (``kvflow serve --pin-malloc``).

Every forward allocates its activations afresh (torch's CPU allocator is ``posix_memalign``
underneath, no caching), and a decode step's temporaries are 0.1-10 MiB. glibc serves a block
above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh ``mmap`` and gives it back on free,
so each step faults its temporaries in again, a 4 KiB page at a time, zeroing each; freed heap
memory above ``M_TRIM_THRESHOLD`` is handed back too and faulted in again. glibc raises both
thresholds as it sees large blocks freed, but how far depends on the order of earlier
allocations and frees, so one process of the same code faults ~2,000 pages per decode step and
the next none (tiny-random, 8 sequences of 1k tokens, model on the main thread: 7.0-9.3 ms a
step against 3.3-3.7 ms); a served engine faulted ~310,000 pages in the first 8 s of an
8-workflow bench (bench/RESULTS.md §6.53).

Setting the thresholds once turns glibc's adjustment off (``mallopt``'s documented effect):
blocks up to ``mmap_threshold`` come from the heap and stay there between steps. The cost is
that the process keeps its peak heap instead of returning it, which a server that reuses the
same shapes every step wants anyway (PyTorch's CPU performance guide recommends jemalloc or
tcmalloc for the same reason; this needs no preload). glibc caps ``M_MMAP_THRESHOLD`` at
32 MiB on 64-bit builds; larger blocks (long prefills' attention scores) still use ``mmap``.

Invariant: process-wide and idempotent, like ``torch.set_num_threads``; a no-op (returns
False) where the C library has no ``mallopt`` (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

log = logging.getLogger("kvflow.malloc")

M_TRIM_THRESHOLD = -1   # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20   # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30

_pinned: Optional[tuple[int, int]] = None


def _mallopt():
    # the symbols already loaded into this process (libc's among them): no ``find_library``,
    # which runs ``ldconfig`` in a subprocess at every engine start
    try:
        return getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return None


def pin_malloc_thresholds(mmap_threshold: int = MMAP_THRESHOLD_MAX,
                          trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module doc). True if both took."""
    global _pinned
    if not 0 < mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be in (0, {MMAP_THRESHOLD_MAX}]")
    if trim_threshold < 0:
        raise ValueError("trim_threshold must be >= 0")
    if _pinned == (mmap_threshold, trim_threshold):
        return True
    fn = _mallopt()
    if fn is None:
        log.debug("no mallopt in this C library: malloc thresholds left as they are")
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(fn(M_MMAP_THRESHOLD, mmap_threshold)) and bool(fn(M_TRIM_THRESHOLD, trim_threshold))
    if ok:
        _pinned = (mmap_threshold, trim_threshold)
    else:
        log.warning("mallopt refused the thresholds (%d, %d): left as they are",
                    mmap_threshold, trim_threshold)
    return ok


def malloc_pinned() -> bool:
    """Whether :func:`pin_malloc_thresholds` has taken in this process."""
    return _pinned is not None
