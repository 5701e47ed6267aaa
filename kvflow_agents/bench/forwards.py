"""``kvflow bench forwards``: does a policy's cache work slow the model's own forwards?

The workflow benches run one server process per policy, and on this 2-core box one process
runs a few per cent faster or slower than another (``bench/speed.py``), so when a report's
caveat line says "kvflow's decode steps 1.04x the oracle's, more than the processes' luck"
it cannot say whether kvflow's loads, backups and evictions slow the forwards that follow
them (caches, memory traffic, page layout) or whether its processes drew slower cores.

Here every policy's :class:`~kvflow_agents.serving.embedded.engine.Engine` lives in this one
process (weights shared, one torch thread) and the workload is the paper's cycle with one
workflow per engine: each call goes to every engine in turn, the order rotated per call, so
what slows the process slows them all alike. With ``workflows > 1`` each engine serves that
many concurrent workflows (one client thread each, prompts of their own) and the engines
take turns round by round instead, the order rotated per round. Per repetition (fresh
engines, one unmeasured warm-up round) the engines' own counters give the model's seconds
per decode step and per prefill call and their busy steps' time beside the forwards per call
(what the policy's own work, copies included, costs the engine thread), and the client the
wall time per call; the figure per
policy is its ratio to the oracle's, as a geometric mean over repetitions with a 90 %
bootstrap interval over them (``stats.geometric_mean_interval``). The wall time counts what the
engine does between forwards (a policy's planning, evictions and copies) and, in this one
process, the client threads' Python beside the engine on the GIL and the cores: read its
ratio as an upper bound of what a served engine, in a process of its own, pays.
"""

from __future__ import annotations

import contextlib
import math
import random
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from .stats import geometric_mean_interval
from .workload import token_counter

REFERENCE = "oracle"


@dataclass
class ForwardTimes:
    policy: str
    decode_s: list = field(default_factory=list)       # per repetition: model seconds in decode
    decode_steps: list = field(default_factory=list)
    prefill_s: list = field(default_factory=list)      # model seconds in prefill forwards
    calls: int = 0                                     # measured calls per repetition
    wall_s: list = field(default_factory=list)         # per repetition: the calls' wall time
    beside_s: list = field(default_factory=list)       # per repetition: the engine's busy
                                                       # steps' wall time beside the forwards
                                                       # (planning, evictions, copies, sampling)
    load_pages: int = 0                                # pages loaded from host, all repetitions
                                                       # (warm-up rounds included)

    def decode_ms(self) -> list:
        return [1e3 * s / n if n else math.nan for s, n in zip(self.decode_s, self.decode_steps)]

    def _per_call_ms(self, seconds: list) -> list:
        return [1e3 * s / self.calls if self.calls else math.nan for s in seconds]

    def prefill_ms(self) -> list:
        return self._per_call_ms(self.prefill_s)

    def wall_ms(self) -> list:
        return self._per_call_ms(self.wall_s)

    def beside_ms(self) -> list:
        return self._per_call_ms(self.beside_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_ms_per_step": self.decode_ms(),
                "prefill_ms_per_call": self.prefill_ms(), "wall_ms_per_call": self.wall_ms(),
                "beside_ms_per_call": self.beside_ms()}


def run_forwards_bench(*, model: str = "tiny-random", policies: Sequence[str], agents: int = 10,
                       fixed: int = 1024, dynamic: int = 32, output: int = 16, rounds: int = 5,
                       reps: int = 7, device_fraction: float = 0.4, host_link_gbps: float = 0.07,
                       workflows: int = 1,
                       progress: Optional[Callable[[str], None]] = None) -> list[ForwardTimes]:
    """The interleaved in-process runs (module doc); ``policies`` must include the oracle."""
    import torch

    from kvflow_agents.protocol import Hints
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.model import load_model

    if REFERENCE not in policies:
        raise ValueError(f"the {REFERENCE} is the reference: include it in the policies")
    if workflows < 1:
        raise ValueError("workflows must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benches' servers; restored below
    try:
        loaded = load_model(model, "cpu", None)
        rng, tokens = random.Random(0), token_counter(model)
        names = [f"agent_{i}" for i in range(agents)]
        system = {(w, a): tokens.make_text(fixed, rng, lead=f"[{w}{a}]")
                  for w in range(workflows) for a in names}
        # at least two calls' worth (with the chat template's tokens), as the workflow bench
        device = max(2 * (fixed + dynamic + output + 128), int(device_fraction * agents * fixed * workflows))
        host = 4 * agents * workflows * (fixed + dynamic + output)
        out = {p: ForwardTimes(p, calls=rounds * agents * workflows) for p in policies}
        for rep in range(reps):
            with contextlib.ExitStack() as stack:
                engines = {p: stack.enter_context(Engine(
                    loaded=loaded, model=model, policy=p, device_tokens=device, host_tokens=host,
                    host_link_gbps=host_link_gbps, torch_threads=1)) for p in policies}
                wall = dict.fromkeys(policies, 0.0)

                def call(p: str, w: int, step: int, measured: bool) -> None:
                    a, i = names[step % agents], step % agents
                    # the same call for every engine: its dynamic part drawn from its own seed
                    user = tokens.make_text(dynamic, random.Random(f"{rep}.{w}.{step}"), lead=f"{w}.{step}")
                    msgs = [{"role": "system", "content": system[(w, a)]},
                            {"role": "user", "content": user}]
                    h = Hints(workflow=f"w{rep}-{w}", agent=a, step=step, fixed_messages=1,
                              ste={names[(i + k) % agents]: k for k in range(agents)})
                    t0 = time.perf_counter()
                    engines[p].chat(msgs, hints=h, max_tokens=output, temperature=0, ignore_eos=True)
                    if measured and workflows == 1:
                        wall[p] += time.perf_counter() - t0

                def run(r0: int, n_rounds: int, measured: bool) -> None:
                    for r in range(r0, r0 + n_rounds):
                        if workflows == 1:  # call by call, every engine in turn
                            for step in range(r * agents, (r + 1) * agents):
                                k = step % len(policies)
                                for p in list(policies[k:]) + list(policies[:k]):
                                    call(p, 0, step, measured)
                            continue
                        k = r % len(policies)  # round by round, each engine's workflows at once
                        for p in list(policies[k:]) + list(policies[:k]):
                            t0 = time.perf_counter()
                            clients = [threading.Thread(target=lambda p=p, w=w: [
                                call(p, w, step, measured) for step in range(r * agents, (r + 1) * agents)])
                                for w in range(workflows)]
                            for c in clients:
                                c.start()
                            for c in clients:
                                c.join()
                            if measured:
                                wall[p] += time.perf_counter() - t0

                run(0, 1, False)  # warm-up: every prefix computed once, caches and allocator settled
                before = {p: e.call(lambda x: dict(x.counters)) for p, e in engines.items()}
                run(1, rounds, True)
                for p, e in engines.items():
                    c = e.call(lambda x: (dict(x.counters), x.pool.stats.get("load_pages", 0)))
                    t, b = out[p], before[p]
                    t.decode_s.append(c[0]["decode_forward_s"] - b["decode_forward_s"])
                    t.decode_steps.append(c[0]["decode_steps"] - b["decode_steps"])
                    t.prefill_s.append(c[0]["prefill_forward_s"] - b["prefill_forward_s"])
                    t.beside_s.append(c[0]["busy_s"] - b["busy_s"] - t.decode_s[-1] - t.prefill_s[-1])
                    t.wall_s.append(wall[p])
                    t.load_pages += c[1]
            if progress:
                progress(f"repetition {rep + 1}/{reps}")
        return [out[p] for p in policies]
    finally:
        torch.set_num_threads(threads)


# (name, label): each ``ForwardTimes.<name>_ms`` per repetition. "beside": what the engine's
# steps spend outside the model per call (its policy's planning and evictions, KV copies,
# scheduling, sampling), from its ``busy_s`` counter: the part a policy adds by its own work
FIGURES = (("decode", "decode ms / step"), ("prefill", "prefill ms / call"), ("wall", "wall ms / call"),
           ("beside", "beside fwd ms / call"))


def ratios(results: Sequence[ForwardTimes]) -> dict:
    """Per policy and figure (:data:`FIGURES`' names): the per-repetition ratios to the
    oracle, their geometric mean and its 90 % bootstrap interval over repetitions."""
    ref = next(r for r in results if r.policy == REFERENCE)
    out = {}
    for r in results:
        out[r.policy] = {}
        for name, _ in FIGURES:
            mine, theirs = getattr(r, name + "_ms")(), getattr(ref, name + "_ms")()
            reps = [a / b for a, b in zip(mine, theirs) if a > 0 and b > 0]
            if not reps:
                out[r.policy][name] = None
                continue
            g = geometric_mean_interval(reps)
            out[r.policy][name] = {"ratio": g["ratio"], "reps": reps,
                                   "ci": (g["lo"], g["hi"]) if len(reps) > 1 else None}
    return out


def render_table(results: Sequence[ForwardTimes], title: str):
    """One row per figure (its median over repetitions, then its ratio to the oracle's and the
    interval), one column per policy: fits 80 columns for up to five policies."""
    from rich import box
    from rich.table import Table

    rat = ratios(results)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("metric", justify="left")
    for r in results:
        t.add_column(r.policy, justify="right", no_wrap=True, min_width=9)

    def med(xs):
        xs = sorted(x for x in xs if not math.isnan(x))
        return xs[len(xs) // 2] if xs else math.nan

    for name, label in FIGURES:
        t.add_row(label, *(f"{med(getattr(r, name + '_ms')()):.3f}" for r in results))
        vs = [rat[r.policy][name] for r in results]
        t.add_row("  x oracle", *("-" if v is None else f"{v['ratio']:.3f}" for v in vs))
        t.add_row("  90% CI", *("-" if v is None or not v["ci"] else f"{v['ci'][0]:.2f}-{v['ci'][1]:.2f}"
                                for v in vs))
    t.add_row("pages loaded", *(str(r.load_pages) for r in results))
    return t


def plot(results: Sequence[ForwardTimes], path: str, title: str) -> None:
    """Bars: each policy's ratio to the oracle per figure (:data:`FIGURES`), with the intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rat = ratios(results)
    pols = [r.policy for r in results]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for j, (name, label) in enumerate(FIGURES):
        width = 0.8 / len(FIGURES)
        xs = [i + (j - (len(FIGURES) - 1) / 2) * width for i in range(len(pols))]
        vals = [rat[p][name]["ratio"] if rat[p][name] else math.nan for p in pols]
        lo = [v - (rat[p][name]["ci"] or (v, v))[0] if rat[p][name] else 0 for p, v in zip(pols, vals)]
        hi = [(rat[p][name]["ci"] or (v, v))[1] - v if rat[p][name] else 0 for p, v in zip(pols, vals)]
        ax.bar(xs, vals, width=width * 0.95, yerr=[lo, hi], capsize=3, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    tops = [c[1] for p in pols for v in rat[p].values() if v and (c := v["ci"] or (v["ratio"],) * 2)]
    lows = [c[0] for p in pols for v in rat[p].values() if v and (c := v["ci"] or (v["ratio"],) * 2)]
    ax.set_ylim(min(lows + [1.0]) - 0.05, max(tops + [1.0]) + 0.05)  # the ratios sit near 1
    ax.set_xticks(range(len(pols)), pols)
    ax.set_ylabel("ratio to the oracle's")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
