"""KVFlow for stock SGLang (``sglang==0.5.23``), without a fork.

- ``plugin.register`` — SGLang's ``sglang.srt.plugins`` entry point (see pyproject.toml):
  registers the ``kvflow`` eviction policy and radix-cache backend, the scheduler hooks and the
  ``/kvflow/v1/*`` HTTP endpoints.
- ``cache.KVFlowRadixCache`` — ``UnifiedRadixCache`` subclass (tags, STE order, prefetch).
- ``launch.serve_sglang(argv)`` / ``python -m kvflow_agents.serving.sglang.launch`` — starts
  SGLang with HiCache and the kvflow backend/policy even where the entry point is not installed.

Importing this package does not import SGLang; the submodules above do.
"""

from .messages import KVFlowControl  # noqa: F401  (no SGLang import)
