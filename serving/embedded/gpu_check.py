"""The prepared GPU check: lru / hicache / kvflow / oracle side by side on the embedded engine
with ``--device cuda`` (real PCIe host↔device copies, real prefill), in-process (no web stack),
on a random-weight model of Llama-3.1-8B's shape, at the paper's single-workflow settings:
a cycle of 10 agents with 4096- and 8192-token fixed prompts.

    python -m kvflow_agents.serving.embedded.gpu_check --out gpu_check.json       # GPU machine
    python -m kvflow_agents.serving.embedded.gpu_check --model tiny-random --device cpu \\
        --fixed 256 --rounds 1 --warmup 1                                          # a CPU dry run

The device pool holds ``--device-fraction`` (default 0.4) of the agents' fixed prompts, as on
the paper's memory-constrained GPU; the host pool holds all of them. Each policy gets its own
engine over the same weights. Prints a table and ratios (kvflow vs lru / hicache / oracle) of the
median round latency and writes everything as JSON. It imports only torch, networkx and
pydantic besides this package (the GPU machine has no FastAPI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

POLICIES = ("lru", "hicache", "kvflow", "oracle")


def fixed_prompt(agent_index: int, n_chars: int) -> str:
    """Deterministic text; with the byte-level tokenizer of the random presets, 1 char = 1 token."""
    words = [f"rule{agent_index}-{i % 97}" for i in range(n_chars // 6 + 2)]
    return (f"You are agent {agent_index}. " + " ".join(words))[:n_chars]


def run_policy(loaded, *, policy: str, device: str, agents: int, fixed: int, dynamic: int, output: int,
               rounds: int, warmup: int, device_tokens: int, host_tokens: int,
               host_link_gbps: Optional[float], log=print) -> dict:
    from kvflow_agents.graph.examples import cycle_graph
    from kvflow_agents.protocol import Hints
    from kvflow_agents.serving.embedded.engine import Engine

    names = [f"agent_{i}" for i in range(agents)]
    g = cycle_graph(agents, names)
    systems = {a: fixed_prompt(i, fixed) for i, a in enumerate(names)}
    eng = Engine(loaded=loaded, policy=policy, device=device, device_tokens=device_tokens,
                 host_tokens=host_tokens, host_link_gbps=host_link_gbps, page_size=16,
                 max_prefill_tokens=max(1024, fixed + dynamic + 64), default_max_tokens=output)
    calls, round_s = [], []
    try:
        tr = g.tracker("gpu-check")
        for r in range(warmup + rounds):
            t0 = time.perf_counter()
            for a in names:
                tr.start(a)
                h = Hints(workflow="gpu-check", app="gpu-check", agent=a, step=tr.step, ste=tr.ste(),
                          next=tr.next_agents(), fixed_messages=1)
                user = f"round {r} call of {a}: " + "x" * max(0, dynamic - 24)
                c = eng.chat([{"role": "system", "content": systems[a]}, {"role": "user", "content": user}],
                             hints=h, max_tokens=output, ignore_eos=True, timeout=600)
                tr.finish(a)
                if r >= warmup:
                    calls.append({"agent": a, "latency_s": c.latency_s, "ttft_s": c.ttft_s,
                                  "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
                                  "device_hit_tokens": c.device_hit_tokens, "host_hit_tokens": c.host_hit_tokens,
                                  "load_wait_s": c.load_wait_s})
            if r >= warmup:
                round_s.append(time.perf_counter() - t0)
            log(f"  {policy:8s} fixed {fixed}: round {r + 1}/{warmup + rounds} "
                f"{time.perf_counter() - t0:.2f}s{' (warm-up)' if r < warmup else ''}")
        cache = eng.cache_report()
    finally:
        eng.shutdown()
    n = max(1, len(calls))
    return {
        "policy": policy, "fixed": fixed, "round_s": round_s,
        "round_p50_s": statistics.median(round_s) if round_s else None,
        "ttft_mean_s": sum(c["ttft_s"] for c in calls) / n,
        "device_hit_frac": sum(c["device_hit_tokens"] for c in calls) / max(1, sum(c["prompt_tokens"] for c in calls)),
        "host_hit_frac": sum(c["host_hit_tokens"] for c in calls) / max(1, sum(c["prompt_tokens"] for c in calls)),
        "load_wait_s": sum(c["load_wait_s"] for c in calls),
        "metrics": cache.get("metrics", {}), "calls": calls,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--fixed", default="4096,8192", help="comma-separated fixed-prompt sizes (tokens)")
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--dynamic", type=int, default=32)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="measured rounds of the cycle")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device-fraction", type=float, default=0.4)
    p.add_argument("--host-link-gbps", type=float, default=None,
                   help="emulate a slower link (default: the real host<->device copy)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    try:
        sizes = [int(x) for x in a.fixed.split(",") if x.strip()]
    except ValueError:
        p.error(f"--fixed: comma-separated integers, got {a.fixed!r}")
    pols = [x.strip() for x in a.policies.split(",") if x.strip()]
    bad = [x for x in pols if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {bad}; choose from {POLICIES}")

    import torch

    from kvflow_agents.serving.embedded.model import load_model

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU (use --device cpu --model tiny-random for a dry run)")
    t0 = time.perf_counter()
    loaded = load_model(a.model, a.device)
    print(f"model {a.model} on {a.device} ready in {time.perf_counter() - t0:.1f}s "
          f"({loaded[2].kv_bytes_per_token} KV bytes/token)", flush=True)
    results = []
    for fixed in sizes:
        per_agent = fixed + a.dynamic + a.output + 64
        dev = max(int(a.device_fraction * a.agents * fixed) // 16 * 16, (per_agent + 31) // 16 * 16 + 16)
        host = 2 * a.agents * per_agent
        print(f"fixed {fixed}: device pool {dev} tokens ({dev / (a.agents * fixed):.0%} of the fixed "
              f"prompts), host pool {host} tokens", flush=True)
        for pol in pols:
            results.append(run_policy(loaded, policy=pol, device=a.device, agents=a.agents, fixed=fixed,
                                      dynamic=a.dynamic, output=a.output, rounds=a.rounds, warmup=a.warmup,
                                      device_tokens=dev, host_tokens=host, host_link_gbps=a.host_link_gbps,
                                      log=lambda s: print(s, flush=True)))
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print()
    print(f"{'fixed':>6} {'policy':>8} {'round p50 s':>12} {'TTFT ms':>8} {'dev hit':>8} {'host hit':>8} "
          f"{'load wait s':>11}")
    for r in results:
        print(f"{r['fixed']:>6} {r['policy']:>8} {r['round_p50_s']:>12.3f} {1000 * r['ttft_mean_s']:>8.1f} "
              f"{r['device_hit_frac']:>8.1%} {r['host_hit_frac']:>8.1%} {r['load_wait_s']:>11.3f}")
    ratios = {}
    for fixed in sizes:
        by = {r["policy"]: r["round_p50_s"] for r in results if r["fixed"] == fixed}
        if "kvflow" in by:
            ratios[fixed] = {f"kvflow_vs_{b}": (by[b] / by["kvflow"]) for b in ("lru", "hicache") if b in by}
            if "oracle" in by:
                ratios[fixed]["kvflow_over_oracle"] = by["kvflow"] / by["oracle"]
            print(f"fixed {fixed}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[fixed].items()))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"args": vars(a), "results": results, "ratios": ratios,
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
