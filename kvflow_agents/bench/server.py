"""The ``kvflow serve`` flags of one benchmark; the servers themselves are
:class:`kvflow_agents.serve_process.ServeProcess` (the launcher the PEER example uses too)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from kvflow_agents.serve_process import ServeProcess, ServerStartError, free_port

__all__ = ["BenchServer", "ServerStartError", "free_port", "serve_args", "client_core_threads"]

BenchServer = ServeProcess


def client_core_threads() -> int:
    """torch threads for a benchmark's server: one core fewer than the machine has (at least
    one), since the client runs on the same machine. With every core, an op the server splits
    over all of them stalls whenever the client holds one (on the 2-core CI box: a 1 MB KV copy
    p50 28 us, mean 750 us), and those stalls, not the cache policy, set the figures."""
    return max(1, (os.cpu_count() or 1) - 1)


def serve_args(*, model: str, policy: str, device_tokens: int, host_tokens: int, page_size: int,
               host_link_gbps: Optional[float], lookahead: int, max_batch: int,
               torch_threads: Optional[int] = None, extra: Sequence[str] = ()) -> list[str]:
    """The ``kvflow serve`` flags shared by every policy of one benchmark (only --policy differs)."""
    args = ["--model", model, "--policy", policy, "--device-tokens", str(device_tokens),
            "--host-tokens", str(host_tokens), "--page-size", str(page_size),
            "--lookahead", str(lookahead), "--max-batch", str(max_batch), "--log-level", "warning"]
    if host_link_gbps:
        args += ["--host-link-gbps", f"{host_link_gbps:.6g}"]
    if torch_threads is not None:
        args += ["--torch-threads", str(torch_threads)]
    return args + list(extra)
