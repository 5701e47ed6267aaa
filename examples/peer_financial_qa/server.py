"""The embedded kvflow server (``kvflow serve``) for the example, on the package's launcher.

    with EmbeddedServer(model="smollm2-135m") as srv:
        srv.base_url        # "http://127.0.0.1:<port>/v1"

:class:`kvflow_agents.serve_process.ServeProcess` does the work: a child process in its own
session (stopped as a process group), output to a log file, ``GET /health`` polled until 200,
and on a failed start a :class:`ServerStartError` carrying the log's tail.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvflow_agents.serve_process import ServeProcess, ServerStartError, free_port

__all__ = ["EmbeddedServer", "ServerStartError", "free_port"]


class EmbeddedServer(ServeProcess):
    def __init__(self, model: str = "smollm2-135m", *, host: str = "127.0.0.1",
                 port: Optional[int] = None, timeout_s: float = 600.0,
                 extra_args: Sequence[str] = (), command: Optional[Sequence[str]] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self.model = model
        self.extra_args = list(extra_args)
        super().__init__(["--model", model, *self.extra_args], host=host, port=port,
                         timeout_s=timeout_s, command=command, env=env)
