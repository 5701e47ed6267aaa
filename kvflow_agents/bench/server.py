"""The ``kvflow serve`` flags of one benchmark; the servers themselves are
:class:`kvflow_agents.serve_process.ServeProcess` (the launcher the PEER example uses too)."""

from __future__ import annotations

from typing import Optional, Sequence

from kvflow_agents.serve_process import ServeProcess, ServerStartError, free_port

__all__ = ["BenchServer", "ServerStartError", "free_port", "serve_args"]

BenchServer = ServeProcess


def serve_args(*, model: str, policy: str, device_tokens: int, host_tokens: int, page_size: int,
               host_link_gbps: Optional[float], lookahead: int, max_batch: int,
               extra: Sequence[str] = ()) -> list[str]:
    """The ``kvflow serve`` flags shared by every policy of one benchmark (only --policy differs)."""
    args = ["--model", model, "--policy", policy, "--device-tokens", str(device_tokens),
            "--host-tokens", str(host_tokens), "--page-size", str(page_size),
            "--lookahead", str(lookahead), "--max-batch", str(max_batch), "--log-level", "warning"]
    if host_link_gbps:
        args += ["--host-link-gbps", f"{host_link_gbps:.6g}"]
    return args + list(extra)
