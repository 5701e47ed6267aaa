"""Choose the emulated host-link speed (``kvflow serve --host-link-gbps``) for a benchmark.

On a CPU a real host->"device" copy is 70-6000x faster than recomputing the KV (see
``notes/embedded_engine.md`` §4), so prefetch would be invisible. The paper's A10G numbers put
loading a prefix at about a third of recomputing it; :func:`calibrate_link` measures the
recompute time of a ``fixed``-token prefix on the chosen model (the TTFT of a cold request minus
that of a warm one that reuses the prefix; minimum over a few pairs, since a noisy machine only
ever adds time) with an in-process
:class:`~kvflow_agents.serving.embedded.engine.Engine`, reads the KV bytes per token from the
engine's pool, and returns the link speed at which loading that prefix takes
``load_fraction x`` the recompute time.
"""

from __future__ import annotations

import gc
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Optional

from .workload import TokenCounter


@dataclass
class LinkCalibration:
    model: str
    prefix_tokens: int            # tokens reused by the warm request (page-aligned)
    kv_bytes_per_token: int
    recompute_s: float            # min cold TTFT - min warm TTFT
    cold_ttft_s: float
    warm_ttft_s: float
    load_fraction: float
    link_gbps: float              # GB/s (1e9 bytes/s) such that load = fraction x recompute
    samples: int

    @property
    def load_s(self) -> float:
        return self.prefix_tokens * self.kv_bytes_per_token / (self.link_gbps * 1e9)

    def as_dict(self) -> dict:
        return {**asdict(self), "load_s": self.load_s}

    def describe(self) -> str:
        return (f"link calibration on {self.model}: recomputing a {self.prefix_tokens}-token prefix "
                f"takes {self.recompute_s * 1e3:.1f} ms (cold TTFT {self.cold_ttft_s * 1e3:.1f} ms, "
                f"warm {self.warm_ttft_s * 1e3:.1f} ms, min of {self.samples}); KV "
                f"{self.kv_bytes_per_token} B/token -> --host-link-gbps {self.link_gbps:.4g} "
                f"(load {self.load_s * 1e3:.1f} ms = {self.load_fraction:.2f} x recompute)")


def calibrate_link(model: str, fixed: int, *, counter: TokenCounter, dynamic: int = 32,
                   page_size: int = 16, load_fraction: float = 1 / 3, samples: int = 5,
                   seed: int = 12345, loaded: Optional[tuple] = None) -> LinkCalibration:
    from kvflow_agents.serving.embedded.engine import Engine

    if not 0 < load_fraction:
        raise ValueError("load_fraction must be > 0")
    rng = random.Random(seed)
    dev = 4 * (fixed + dynamic + 64) + 4096
    eng = Engine(model=model, policy="oracle", device_tokens=dev, host_tokens=0,
                 page_size=page_size, loaded=loaded)
    try:
        bpt = eng.pool.bytes_per_page // page_size
        eng.chat([{"role": "user", "content": counter.make_text(64, rng)}], max_tokens=2)  # warm kernels
        cold, warm, diffs, reused = [], [], [], []
        for i in range(samples):
            system = counter.make_text(fixed, rng, f"[calibration {i}]")
            msgs = lambda: [{"role": "system", "content": system},  # noqa: E731
                            {"role": "user", "content": counter.make_text(dynamic, rng)}]
            c = eng.chat(msgs(), max_tokens=1, ignore_eos=True)
            w = eng.chat(msgs(), max_tokens=1, ignore_eos=True)
            cold.append(c.ttft_s)
            warm.append(w.ttft_s)
            diffs.append(c.ttft_s - w.ttft_s)
            reused.append(w.cached_tokens)
        recompute = max(min(cold) - min(warm), 1e-6)
        prefix = int(statistics.median(reused)) or fixed
        gbps = prefix * bpt / (recompute * load_fraction) / 1e9
        return LinkCalibration(model=eng.model_name, prefix_tokens=prefix, kv_bytes_per_token=bpt,
                               recompute_s=recompute, cold_ttft_s=min(cold),
                               warm_ttft_s=min(warm), load_fraction=load_fraction,
                               link_gbps=gbps, samples=samples)
    finally:
        eng.shutdown()
        del eng
        gc.collect()
