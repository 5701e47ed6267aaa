"""How fast this process runs the model, measured once at start, before any request.

One serving process runs the same code up to ~20 % faster or slower than another on this box
(bench/RESULTS.md §6.22, §6.25), and the benches pair trials run on different processes by it
(``kvflow_agents/bench/speed.py``). The model's seconds per decode step during a run measure it
too, but they also move with what the run does: a policy that recomputes or loads more memory
between its decode steps, or decodes larger batches, makes its own steps slower (§6.48), and an
adjustment by them credits that to luck. This probe times a fixed forward instead: batch-1 decode
steps over ``context`` tokens of the device pool's first pages, before the pool holds anything
(the pages are free: what the probe writes is overwritten before any request reads it).
"""

from __future__ import annotations

import time
from statistics import median
from typing import Optional

import torch


def probe_decode_s(model, kv: torch.Tensor, *, context: int = 1024, reps: int = 8,
                   warmup: int = 2) -> Optional[float]:
    """Median wall seconds of ``reps`` batch-1 decode forwards at position ``context`` (clipped
    to the pool: one page is kept for the new token), after ``warmup`` untimed ones; ``None``
    when ``reps`` is 0 or the pool has fewer than two pages."""
    ps, pages = kv.shape[3], kv.shape[2]
    context = min(context, (pages - 1) * ps)
    if reps <= 0 or context <= 0:
        return None
    seqs = [(0, list(range(context // ps + 1)), context)]
    cuda = kv.device.type == "cuda"
    times = []
    with torch.inference_mode():
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            model.decode_batch(kv, seqs)
            if cuda:
                torch.cuda.synchronize(kv.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return median(times)
