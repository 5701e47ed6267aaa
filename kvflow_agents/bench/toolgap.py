"""``kvflow bench toolgap``: the turn after a tool call, per cache policy, side by side.

One trial, on one embedded engine per policy (same weights, pools, link; only the policy and
what the client tells it differ):

1. agent A's turn: ``[system: A's fixed prompt, user: a long task history]`` → it calls a tool
   (16 generated tokens);
2. the tool step starts: the client's out-of-band ``transition`` (A is one step away). The
   ``kvflow`` variant also sends ``kvflow_tool_s = {A: gap}`` — what the LangGraph adapter sends
   once it has timed that tool; ``kvflow (no tool time)`` sends the same hint without it;
3. for the tool's duration (the *gap*) other workflows keep the engine busy: requests of other
   agents arrive at ``background_rate`` per second, each with its own fixed prompt and task, so
   the longer the tool runs the more of the cache they displace;
4. the tool returns: A's resumed turn is its last turn (prompt + what it generated) plus the
   tool's result. Its TTFT (server-side, arrival to first token) is the measurement;
5. the same request again at once (everything cached, nothing in between): the warm hit it is
   compared with.

Trials rotate the policy order, so a shared machine's noise hits every policy alike. The
table: resumed-turn TTFT per policy and gap, the warm-hit TTFT, their ratio, and the prompt
tokens the resumed turn had to recompute.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

VARIANTS = {  # label -> (engine policy, send kvflow_tool_s)
    "lru": ("lru", False),
    "hicache": ("hicache", False),
    "kvflow (no tool time)": ("kvflow", False),
    "kvflow": ("kvflow", True),
}


@dataclass
class GapCell:
    variant: str
    gap_s: float
    resumed_ttft: list = field(default_factory=list)
    warm_ttft: list = field(default_factory=list)
    recomputed: list = field(default_factory=list)
    load_wait: list = field(default_factory=list)

    def as_dict(self) -> dict:
        med = statistics.median
        r, w = med(self.resumed_ttft), med(self.warm_ttft)
        return {"variant": self.variant, "gap_s": self.gap_s, "resumed_ttft_s": round(r, 5),
                "warm_ttft_s": round(w, 5), "ratio_vs_warm": round(r / w, 3) if w > 0 else None,
                "recomputed_tokens": med(self.recomputed), "load_wait_s": round(med(self.load_wait), 5),
                "trials": len(self.resumed_ttft)}


def _text(n: int, seed: int) -> str:
    """``n`` characters of distinct filler (the tiny model's tokenizer is byte-level)."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda"]
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(words) + str(rng.randrange(1000)))
    return " ".join(out)[:n]


def bench_toolgap(*, model: str = "tiny-random", gaps: Sequence[float] = (0.1, 0.5, 1.0, 2.0),
                  variants: Sequence[str] = tuple(VARIANTS), trials: int = 3, fixed: int = 512,
                  history: int = 1024, tool_result: int = 32, background_rate: float = 8.0,
                  background_fixed: int = 512, background_task: int = 512, background_agents: int = 4,
                  device_tokens: int = 4096, host_tokens: int = 65536, host_link_gbps: Optional[float] = 0.2,
                  progress: Optional[Callable[[str], None]] = None) -> dict:
    from kvflow_agents.protocol import Hints
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.model import load_model

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    loaded = load_model(model)
    engines = {v: Engine(loaded=loaded, model=model, policy=VARIANTS[v][0], device_tokens=device_tokens,
                         host_tokens=host_tokens, host_link_gbps=host_link_gbps, max_batch=16)
               for v in variants}
    cells = {(v, g): GapCell(v, g) for v in variants for g in gaps}
    fixed_a = "You are agent A. " + _text(fixed, 1)
    bg_fixed = [f"You are background agent {k}. " + _text(background_fixed, 100 + k) for k in range(background_agents)]
    try:
        for eng in engines.values():  # warm-up: the model's first steps, each engine once
            eng.chat([{"role": "user", "content": "warm up"}], max_tokens=2, temperature=0)
        for trial in range(trials):
            for gi, gap in enumerate(gaps):
                order = list(variants)
                k = (trial + gi) % len(order)
                order = order[k:] + order[:k]
                for v in order:
                    if progress:
                        progress(f"trial {trial + 1}/{trials}, gap {gap:g}s: {v}")
                    _one_trial(engines[v], cells[(v, gap)], VARIANTS[v][1], Hints, trial, gi, gap,
                               fixed_a, bg_fixed, history, tool_result, background_rate, background_task)
    finally:
        for eng in engines.values():
            eng.shutdown()
    return {"model": model, "gaps_s": list(gaps), "trials": trials, "fixed": fixed, "history": history,
            "tool_result": tool_result, "background_rate": background_rate,
            "background": {"agents": background_agents, "fixed": background_fixed, "task": background_task},
            "device_tokens": device_tokens, "host_tokens": host_tokens, "host_link_gbps": host_link_gbps,
            "rows": [c.as_dict() for c in cells.values()]}


def _one_trial(eng: Any, cell: GapCell, send_tool_s: bool, Hints: Any, trial: int, gi: int, gap: float,
               fixed_a: str, bg_fixed: list, history: int, tool_result: int, rate: float, task: int) -> None:
    wf = f"tg-{trial}-{gi}"
    msgs = [{"role": "system", "content": fixed_a}, {"role": "user", "content": _text(history, 1000 + 10 * trial + gi)}]
    ids1 = eng.tokenizer.encode_chat(msgs)
    h = Hints(workflow=wf, agent="agent", step=1, ste={"agent": 0, "tools": 1}, fixed_messages=1)
    first = eng.chat(msgs, hints=h, max_tokens=16, temperature=0, ignore_eos=True)
    # the tool step starts (out of band)
    tool = Hints(workflow=wf, agent="tools", step=2, ste={"agent": 1, "tools": 0}, event="transition",
                 tool_s={"agent": gap} if send_tool_s else {})
    eng.update_hints(tool)
    # other workflows run while the tool does
    t0 = time.monotonic()
    threads = []
    i = 0
    while True:
        at = t0 + i / rate
        if at >= t0 + gap:
            break
        time.sleep(max(0.0, at - time.monotonic()))
        k = i % len(bg_fixed)
        bw = f"bg-{wf}-{i}"
        bmsgs = [{"role": "system", "content": bg_fixed[k]},
                 {"role": "user", "content": _text(task, 5000 + 97 * trial + 13 * gi + i)}]

        def run(bmsgs=bmsgs, bw=bw, k=k):
            eng.chat(bmsgs, hints=Hints(workflow=bw, agent=f"B{k}", ste={f"B{k}": 0}, fixed_messages=1),
                     max_tokens=8, temperature=0, ignore_eos=True)
            eng.update_hints(Hints(workflow=bw, agent=f"B{k}", ste={f"B{k}": 2}, event="transition"))
        th = threading.Thread(target=run, daemon=True)
        th.start()
        threads.append(th)
        i += 1
    time.sleep(max(0.0, t0 + gap - time.monotonic()))
    for th in threads:  # the resumed turn is measured on its own (no queue behind the others)
        th.join()
    resumed_ids = ids1 + list(first.token_ids) + eng.tokenizer.encode(_text(tool_result, 9000 + trial))
    hr = Hints(workflow=wf, agent="agent", step=3, ste={"agent": 0, "tools": 1})
    resumed = eng.generate(resumed_ids, hints=hr, max_tokens=1, temperature=0, ignore_eos=True)
    warm = eng.generate(resumed_ids, hints=hr, max_tokens=1, temperature=0, ignore_eos=True)
    eng.update_hints(Hints(workflow=wf, agent="agent", step=4, ste={}, event="end"))
    cell.resumed_ttft.append(resumed.ttft_s)
    cell.warm_ttft.append(warm.ttft_s)
    cell.recomputed.append(resumed.computed_tokens)
    cell.load_wait.append(resumed.load_wait_s)
