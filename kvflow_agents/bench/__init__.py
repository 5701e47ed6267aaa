"""``kvflow bench``: side-by-side benchmarks of the cache policies (lru, hicache, kvflow, oracle).

- :mod:`.workload`: the paper's synthetic multi-agent workflow (N agents in a cycle, or a
  fan-out/AND variant) and the async client that drives it with hints v1.
- :mod:`.server`: start/stop one ``kvflow serve`` subprocess (one per policy, identical flags).
- :mod:`.calibrate`: choose the emulated host-link speed so that loading a prefix costs a
  chosen fraction (default 1/3, the paper's A10G ratio) of recomputing it.
- :mod:`.runner`: run one workload per policy, sequentially, with a warm-up; collect
  per-request TTFT/latency, per-workflow latency, per-tier hits and load hidden/exposed time.
- :mod:`.peer`: the PEER example (LangGraph) as the workload.
- :mod:`.report`: the side-by-side table, ratios vs lru/hicache/oracle, JSON, PNG plot.

Benchmarks are code, never timed tests: the numbers depend on the machine.
"""
