"""An emulated host link for SGLang's HiCache host->device copies (``--kvflow-host-link-gbps``).

Why: on a CPU (and on a GPU whose PCIe is much faster than the one being studied) a host->
device "copy" of a prefix finishes long before recomputing it would, so prefetching is
invisible: nothing is ever in flight when a request arrives, and status-aware admission, the
overlap scheduler's load-slot ring and the in-flight code paths never run. This module puts a
link of ``gbps`` gigaBYTES per second (1e9 B/s) under SGLang's copies, the embedded engine's
``--host-link-gbps`` idea (``serving/embedded/kv_pool.py``): loads queue on one link; a load of
``b`` bytes submitted at ``t`` occupies it from ``begin = max(t, link free)`` to ``end = begin +
b / rate``; layer ``i`` of ``L`` is ready at ``begin + (i + 1) / L * (end - begin)``.

Where it sits: ``L2TransferEngine.submit_host_to_device`` (the one place SGLang 0.5.23 starts
an H2D transfer, for demand loads and the plugin's prefetches alike). The events it returns,
and the per-layer events of the ``LayerLoadingEvent`` slot the forward waits on, are replaced
by :class:`LinkEvent` objects that are not ready before their time:

- ``query()`` is False until then: SGLang's ack polling (``loading_check``), its load-slot
  ring check (``LayerDoneCounter.update_producer`` asserts the slot's previous load is done)
  and ``is_load_back_event_done`` see the load in flight;
- ``synchronize()`` / ``wait()`` block until then (a demand load's batch waits for each layer
  in the forward, as on a GPU; the wait is the exposed load time).

On a CPU device the bytes also land only then: the real copy (SGLang's own transfer code) runs
at the first moment a reader may legitimately see the data (an event found ready, or a wait
that has waited). Until then the destination rows hold whatever was there before, so a reader
that skips the wait reads stale KV, as it would on a GPU; with ``KVFLOW_HOST_LINK_POISON=1``
they hold NaN instead, so such a read cannot go unnoticed (a debugging aid for tests). On a GPU
the copy is submitted at once on SGLang's stream and only its visibility is delayed.

Device->host backups are not throttled: PCIe is full duplex and the paper's link cost is the
load. Installed by the plugin (``plugin.register``) in every SGLang process when
``KVFLOW_HOST_LINK_GBPS`` is set (the launcher's ``--kvflow-host-link-gbps`` sets it), whatever
the cache backend, so stock HiCache and KVFlow are measured on the same link. Written against
``sglang==0.5.23``; :func:`install` checks every name it patches and raises if one moved.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

ENV_GBPS = "KVFLOW_HOST_LINK_GBPS"
ENV_POISON = "KVFLOW_HOST_LINK_POISON"


class HostLinkError(RuntimeError):
    pass


class HostLink:
    """One emulated link: FIFO, ``gbps`` x 1e9 bytes per second."""

    def __init__(self, gbps: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = time.sleep, poison: bool = False) -> None:
        if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
            raise HostLinkError(f"host link speed must be a positive number of GB/s, got {gbps!r}")
        self.gbps = float(gbps)
        self.clock = clock
        self._sleep = sleep
        self.poison = poison
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.stats = {"loads": 0, "bytes": 0, "busy_s": 0.0, "queued_s": 0.0, "waited_s": 0.0}

    def schedule(self, nbytes: int) -> tuple[float, float]:
        """Reserve the link for ``nbytes``; returns (begin, end) on :attr:`clock`."""
        with self._lock:
            now = self.clock()
            begin = max(now, self._free_at)
            end = begin + nbytes / (self.gbps * 1e9)
            self._free_at = end
            self.stats["loads"] += 1
            self.stats["bytes"] += int(nbytes)
            self.stats["busy_s"] += end - begin
            self.stats["queued_s"] += begin - now
        return begin, end

    def sleep_until(self, t: float) -> None:
        d = t - self.clock()
        if d > 0:
            self.stats["waited_s"] += d
            self._sleep(d)

    def snapshot(self) -> dict:
        return {"gbps": self.gbps, **{k: (round(v, 6) if isinstance(v, float) else v)
                                       for k, v in self.stats.items()}}


class PendingLoad:
    """One H2D submission on the link. ``land()`` runs the deferred copy exactly once."""

    def __init__(self, link: HostLink, begin: float, end: float, layers: int,
                 copy: Optional[Callable[[], Any]]) -> None:
        self.link, self.begin, self.end, self.layers = link, begin, end, max(1, layers)
        self._copy = copy
        self._lock = threading.Lock()

    def layer_ready_at(self, i: int) -> float:
        return self.begin + (self.end - self.begin) * (i + 1) / self.layers

    def land(self) -> None:
        if self._copy is None:
            return
        with self._lock:
            copy, self._copy = self._copy, None
            if copy is not None:
                copy()

    @property
    def landed(self) -> bool:
        return self._copy is None


class LinkEvent:
    """Stands for a device event of a pending load: not ready before ``ready_at``."""

    def __init__(self, load: PendingLoad, ready_at: float, inner: Any = None) -> None:
        self.load, self.ready_at, self.inner = load, ready_at, inner

    def query(self) -> bool:
        if self.load.link.clock() < self.ready_at:
            return False
        self.load.land()
        return self.inner.query() if self.inner is not None else True

    def synchronize(self) -> None:
        self.load.link.sleep_until(self.ready_at)
        self.load.land()
        if self.inner is not None:
            self.inner.synchronize()

    def wait(self, stream: Any = None) -> None:
        self.load.link.sleep_until(self.ready_at)
        self.load.land()
        if self.inner is not None:
            self.inner.wait(stream)

    def record(self, stream: Any = None) -> None:
        pass  # recorded by construction

    def elapsed_time(self, other: "LinkEvent") -> float:
        return (getattr(other, "ready_at", self.ready_at) - self.ready_at) * 1000.0


# ------------------------------------------------------------------------------ installation
_link: Optional[HostLink] = None


def current() -> Optional[HostLink]:
    return _link


def _nbytes(transfers) -> int:
    total = 0
    for t in transfers:
        per_token = getattr(t.host_pool, "size_per_token", None)
        if per_token is None:
            raise HostLinkError(f"{type(t.host_pool).__name__} has no size_per_token")
        total += len(t.host_indices) * int(per_token)
    return total


def _poison(transfers) -> None:
    import torch

    for t in transfers:
        pool = t.device_pool
        bufs = list(getattr(pool, "k_buffer", None) or []) + list(getattr(pool, "v_buffer", None) or [])
        idx = t.device_indices
        for buf in bufs:
            if buf.is_floating_point():
                buf[idx.to(buf.device)] = torch.nan


def install(gbps: float, *, poison: Optional[bool] = None,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], Any] = time.sleep) -> HostLink:
    """Put the emulated link under SGLang's H2D copies in this process (idempotent for the
    same speed). Returns the link."""
    global _link
    if poison is None:
        poison = os.environ.get(ENV_POISON, "") not in ("", "0")
    if _link is not None:
        if _link.gbps != float(gbps):
            raise HostLinkError(f"host link already installed at {_link.gbps} GB/s")
        return _link
    from sglang.srt.managers import cache_controller as cc
    from sglang.srt.mem_cache import l2_transfer as l2

    for owner, names in ((l2.L2TransferEngine, ("submit_host_to_device",)),
                         (l2, ("TransferCompletion",)),
                         (cc.LayerLoadingEvent, ("wait", "complete")),
                         (cc, ("LayerDoneCounter", "device_module"))):
        missing = [n for n in names if not hasattr(owner, n)]
        if missing:
            raise HostLinkError(f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}: "
                                f"SGLang moved (written for sglang==0.5.23)")
    link = HostLink(gbps, clock=clock, sleep=sleep, poison=poison)
    orig_submit = l2.L2TransferEngine.submit_host_to_device
    orig_wait = cc.LayerLoadingEvent.wait

    def submit_host_to_device(self, transfers, *, transfer_layer_id_max, start_event=None,
                              on_layer_done=None):
        begin, end = link.schedule(_nbytes(transfers))
        slot = getattr(on_layer_done, "__self__", None)
        slot = slot if isinstance(slot, cc.LayerLoadingEvent) else None
        on_cpu = all(getattr(getattr(t.device_pool, "device", None), "type",
                             str(getattr(t.device_pool, "device", "cpu"))) == "cpu"
                     for t in transfers)
        if on_cpu and (slot is not None or on_layer_done is None):
            # The bytes land when a reader may see them (see the module docstring).
            if link.poison:
                _poison(transfers)

            def copy(engine=self, transfers=transfers, n=transfer_layer_id_max):
                orig_submit(engine, transfers, transfer_layer_id_max=n, start_event=None,
                            on_layer_done=None)

            load = PendingLoad(link, begin, end, transfer_layer_id_max, copy)
            inner_start = inner_finish = None
        else:
            completion = orig_submit(self, transfers, transfer_layer_id_max=transfer_layer_id_max,
                                     start_event=start_event, on_layer_done=on_layer_done)
            load = PendingLoad(link, begin, end, transfer_layer_id_max, None)
            inner_start, inner_finish = completion.start_event, completion.finish_event
        if slot is not None:
            inner = list(slot.load_events) if load.landed else [None] * len(slot.load_events)
            slot.load_events = [LinkEvent(load, load.layer_ready_at(i), inner[i])
                                for i in range(len(slot.load_events))]
        return l2.TransferCompletion(LinkEvent(load, begin, inner_start),
                                     LinkEvent(load, end, inner_finish), False)

    def wait(self, layer_index):
        ev = self.load_events[layer_index]
        if isinstance(ev, LinkEvent):
            ev.wait(cc.device_module.current_stream())
            return
        orig_wait(self, layer_index)

    submit_host_to_device.__wrapped__ = orig_submit
    wait.__wrapped__ = orig_wait
    l2.L2TransferEngine.submit_host_to_device = submit_host_to_device
    cc.LayerLoadingEvent.wait = wait
    _link = link
    logger.info("kvflow: emulated host link %.4g GB/s under SGLang's host->device copies%s",
                link.gbps, " (poisoning in-flight rows)" if poison else "")
    return link


def uninstall() -> None:
    """Restore SGLang's methods (tests)."""
    global _link
    if _link is None:
        return
    from sglang.srt.managers import cache_controller as cc
    from sglang.srt.mem_cache import l2_transfer as l2

    l2.L2TransferEngine.submit_host_to_device = l2.L2TransferEngine.submit_host_to_device.__wrapped__
    cc.LayerLoadingEvent.wait = cc.LayerLoadingEvent.wait.__wrapped__
    _link = None


def install_from_env() -> Optional[HostLink]:
    raw = os.environ.get(ENV_GBPS, "").strip()
    if not raw:
        return None
    try:
        gbps = float(raw)
    except ValueError:
        raise HostLinkError(f"{ENV_GBPS}={raw!r} is not a number of GB/s") from None
    return install(gbps)
