"""Shared setup for the SGLang plugin tests (run inside .venv-sglang only).

CPU stand-ins, each at the narrowest point:
- ``get_device`` -> "cpu" in SGLang's test-kit fixtures (it raises without an accelerator);
- ``_cuda_host_register`` -> no-op (pinning host memory needs CUDA);
- SGLang's 10 GiB host-RAM margin before any host pool -> 256 MiB (a shared CPU box);
- ``L2TransferEngine.submit_device_to_host / submit_host_to_device`` -> completed at once, no
  bytes moved: the host<->device copy boundary. Everything above it (HiCache controller, host
  pool allocation, load/ack queues, layer counters, the tree) is SGLang's real code. Tests that
  need real bytes moved put SGLang's own methods back (``sgl_helpers.real_copies``).
"""

from __future__ import annotations

import warnings


try:  # the main venv has no SGLang: this folder is then not collected at all
    import sglang.srt  # noqa: F401
    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False
    collect_ignore_glob = ["*.py"]


class _Done:
    """An already-completed device event."""

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class TransferLog:
    def __init__(self):
        self.h2d = []   # host index tensors loaded
        self.d2h = []


XFER = TransferLog()


def _install_cpu_stand_ins() -> None:
    import sglang.srt.mem_cache.l2_transfer as l2
    import sglang.srt.mem_cache.pool_host.common as phc
    import sglang.test.kits.unified_radix_cache.fixtures as fx

    fx.get_device = lambda *a, **k: "cpu"
    phc._cuda_host_register = lambda *a, **k: None
    import sglang.srt.mem_cache.pool_host.base as phb

    phb.HICACHE_HOST_MEMORY_RESERVE_BYTES = 256 * 1024 ** 2   # a GPU server's 10 GiB margin

    def d2h(self, transfers):
        XFER.d2h.extend(t.host_indices for t in transfers)
        return l2.TransferCompletion(_Done(), _Done(), False)

    def h2d(self, transfers, *, transfer_layer_id_max, start_event=None, on_layer_done=None):
        XFER.h2d.extend(t.host_indices for t in transfers)
        if on_layer_done is not None:
            for i in range(transfer_layer_id_max):
                on_layer_done(i)
        return l2.TransferCompletion(_Done(), _Done(), False)

    # SGLang's own methods, kept for the tests that move real bytes (sgl_helpers.real_copies)
    if not hasattr(l2.L2TransferEngine, "real_submit_host_to_device"):
        l2.L2TransferEngine.real_submit_device_to_host = l2.L2TransferEngine.submit_device_to_host
        l2.L2TransferEngine.real_submit_host_to_device = l2.L2TransferEngine.submit_host_to_device
    l2.L2TransferEngine.submit_device_to_host = d2h
    l2.L2TransferEngine.submit_host_to_device = h2d


if HAVE_SGLANG:
    warnings.filterwarnings("ignore")
    _install_cpu_stand_ins()
