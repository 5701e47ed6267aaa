"""``kvflow bench engine``: where a decode step of the embedded engine goes.

A decode step is one batched model forward plus everything around it on the engine thread:
scheduling, cache bookkeeping (the policy core), sampling, detokenisation, the per-request sinks
(which hand text to the HTTP layer), the stats snapshot. Every one of those is paid once per
generated token, so it caps what any cache policy can save on a short call (see
``bench/RESULTS.md``: the per-call floor that bounds the oracle over lru).

The measurement runs an in-process :class:`~kvflow_agents.serving.embedded.engine.Engine` per
policy (weights shared), submits ``batch`` chat requests at once (each with hints of its own
workflow over a 10-agent cycle, fixed system prompt of ``context`` tokens), lets them decode
``steps`` tokens and times the engine's **decode-only steps** (all ``batch`` requests decoding,
no prefill in that step). Two passes per configuration:

1. *split*: only the step and the model forward are timed (two wrappers, ~1 µs each), giving
   ``step = forward + rest``, the headline numbers;
2. *breakdown*: the engine's collaborators are wrapped (the cache manager, the scheduler,
   sampling, detokeniser, sinks, stats) and each call's exclusive time is charged to its
   category; what no wrapper covers is "engine loop". The wrappers add a few µs per call, so
   the breakdown's total is a little above pass 1's.

Medians over the decode-only steps, so a noisy neighbour moves them least. ``cprofile`` runs
:mod:`cProfile` on the engine thread during a third pass and returns the top functions by
exclusive time (the "profile first" view).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import threading
import time
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Callable, Optional, Sequence

CATEGORIES = ("forward", "cache", "scheduler", "sampling", "detokenise", "sinks", "stats", "engine loop")


@dataclass
class StepSplit:
    policy: str
    batch: int
    context: int
    steps: int                       # decode-only steps measured
    step_ms: float                   # median wall time of one decode-only step
    forward_ms: float                # median model forward (decode_batch) in those steps
    rest_ms: float                   # median of (step - forward)
    breakdown_ms: dict = field(default_factory=dict)   # category -> median ms per step (pass 2)
    rest_per_token_us: float = 0.0   # rest / batch
    profile_top: list = field(default_factory=list)     # [(function, tottime ms per step)]

    def as_dict(self) -> dict:
        return asdict(self)


class _Timers:
    """Exclusive-time accounting for nested wrapped calls on one thread."""

    def __init__(self) -> None:
        self.stack: list[list] = []          # [category, start, child time]
        self.step: dict[str, float] = {}
        self.flags: set[str] = set()

    def wrap(self, category: str, fn: Callable) -> Callable:
        def wrapped(*a, **kw):
            frame = [category, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                total = time.perf_counter() - frame[1]
                self.step[category] = self.step.get(category, 0.0) + total - frame[2]
                if self.stack:
                    self.stack[-1][2] += total
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped


class _Proxy:
    """Wraps every public method of ``target`` in ``timers.wrap(category, ...)``; attributes and
    properties pass through."""

    def __init__(self, target: Any, category: str, timers: _Timers) -> None:
        object.__setattr__(self, "_t", target)
        object.__setattr__(self, "_c", category)
        object.__setattr__(self, "_timers", timers)
        object.__setattr__(self, "_cache", {})

    def __getattr__(self, name: str) -> Any:
        v = getattr(self._t, name)
        if callable(v) and not name.startswith("__") and not isinstance(v, type):
            w = self._cache.get(name)
            if w is None or w.__wrapped__ is not v:
                timed = self._timers.wrap(self._c, v)

                def w(*a, _timed=timed, **kw):
                    out = _timed(*a, **kw)
                    # a per-request session of the cache protocol is cache work too
                    if type(out).__name__.endswith("Session"):
                        return _Proxy(out, self._c, self._timers)
                    return out
                w.__wrapped__ = v  # type: ignore[attr-defined]
                self._cache[name] = w
            return w
        return v

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._t, name, value)


def _requests(eng, batch: int, context: int, steps: int, run: int) -> list:
    """``batch`` chat requests, each its own workflow of a 10-agent cycle, with a fixed system
    prompt of about ``context`` tokens (byte-level exact on tiny-random) and hints."""
    import random

    from kvflow_agents.bench.workload import token_counter
    from kvflow_agents.protocol import Hints

    counter = token_counter(eng.model_config.name if hasattr(eng.model_config, "name") else "tiny-random")
    rng = random.Random(run)
    agents = [f"agent_{i}" for i in range(10)]
    out = []
    for i in range(batch):
        a = i % len(agents)
        ste = {x: float((j - a) % len(agents)) for j, x in enumerate(agents)}
        h = Hints(workflow=f"engine-bench-{run}-{i}", agent=agents[a], step=1, ste=ste,
                  next=[agents[(a + 1) % len(agents)]], app="engine-bench", fixed_messages=1)
        msgs = [{"role": "system", "content": counter.make_text(context, rng, f"[{run}/{i}]")},
                {"role": "user", "content": counter.make_text(16, rng)}]
        out.append((msgs, h))
    return out


SINKS = ("asyncio", "direct")


async def _consume_sse(eng, req) -> int:
    """What ``kvflow serve`` does per streamed event: ``Engine.stream`` (a thread-safe hand-off
    to the event loop per token) and one SSE line of JSON per text delta."""
    import json

    n = 0
    async for ev in eng.stream(req):
        if ev.text:
            line = "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": ev.text}, "finish_reason": None}]}) + "\n\n"
            n += len(line)
    return n


def _run_batch(eng, batch: int, context: int, steps: int, run: int, timeout_s: float = 600.0,
               sink_mode: str = "asyncio") -> None:
    """Submit ``batch`` requests at once and wait for all. ``sink_mode``: ``asyncio`` consumes
    them on an event loop thread as the HTTP server does; ``direct`` uses no-op sinks."""
    import asyncio

    from kvflow_agents.serving.embedded.engine_config import params_from_kwargs

    params = params_from_kwargs({"max_tokens": steps + 2, "ignore_eos": True})
    if sink_mode == "asyncio":
        reqs = [eng.make_request(messages=m, hints=h, params=params)
                for m, h in _requests(eng, batch, context, steps, run)]
        eng.call(lambda e: None)

        async def main() -> None:
            await asyncio.wait_for(asyncio.gather(*(_consume_sse(eng, r) for r in reqs)), timeout_s)
        asyncio.run(main())
        return
    done = threading.Event()
    left = [batch]
    lock = threading.Lock()

    def sink(ev) -> None:
        if ev.done is not None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
    reqs = [eng.make_request(messages=m, hints=h, sink=sink, params=params)
            for m, h in _requests(eng, batch, context, steps, run)]
    eng.call(lambda e: None)  # the engine is idle before the batch lands at once
    for r in reqs:
        eng.submit(r)
    if not done.wait(timeout_s):
        raise TimeoutError(f"batch {batch} did not finish in {timeout_s} s")


def _instrument(eng, timers: _Timers, full: bool) -> Callable[[], None]:
    """Install the wrappers on the engine (on its thread, between steps); returns an undo."""
    saved: list[tuple[Any, str, Any]] = []

    def setattr_saved(obj, name, value) -> None:
        saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    step_fn = eng._step
    records: list = []

    def timed_step():
        timers.step, timers.flags = {}, set()
        t0 = time.perf_counter()
        progress = step_fn()
        dt = time.perf_counter() - t0
        records.append((dt, dict(timers.step), set(timers.flags)))
        return progress
    eng._bench_records = records

    def install(e) -> None:
        setattr_saved(e, "_step", timed_step)
        model = e.model
        fwd = timers.wrap("forward", model.decode_batch)

        def counted_forward(kv, seqs, *a, **kw):
            timers.flags.add(f"batch={len(seqs)}")
            return fwd(kv, seqs, *a, **kw)
        setattr_saved(model, "decode_batch", counted_forward)
        prefill = model.prefill

        def flagged_prefill(*a, **kw):
            timers.flags.add("prefill")
            return prefill(*a, **kw)
        setattr_saved(model, "prefill", flagged_prefill)
        if not full:
            return
        setattr_saved(e, "manager", _Proxy(e.manager, "cache", timers))
        setattr_saved(e, "scheduler", _Proxy(e.scheduler, "scheduler", timers))
        for name, cat in (("_send", "sinks"), ("_publish", "stats")):
            if hasattr(e, name):
                setattr_saved(e, name, timers.wrap(cat, getattr(e, name)))
        tok = e.tokenizer
        stream = tok.stream

        def timed_stream(*a, **kw):
            s = stream(*a, **kw)
            return _Proxy(s, "detokenise", timers)
        setattr_saved(tok, "stream", timed_stream)
        setattr_saved(e, "sampler", _Proxy(e.sampler, "sampling", timers))  # one call per step
    eng.call(install)

    def undo(e=eng) -> None:
        def restore(_e) -> None:
            for obj, name, old in reversed(saved):
                if old is _MISSING:
                    try:
                        delattr(obj, name)
                    except AttributeError:
                        pass
                else:
                    setattr(obj, name, old)
        e.call(restore)
    return undo


_MISSING = object()


def _decode_only(records: list, batch: int) -> list:
    """(step seconds, category seconds) of the steps that decoded the whole batch, no prefill."""
    return [(dt, cats) for dt, cats, flags in records
            if "prefill" not in flags and f"batch={batch}" in flags]


def measure(eng, batch: int, *, context: int = 1024, steps: int = 64, run: int = 0,
            cprofile: bool = False, sink_mode: str = "asyncio") -> StepSplit:
    """Both passes (and optionally cProfile) for one engine and batch size."""
    # pass 1: step vs forward only
    timers = _Timers()
    undo = _instrument(eng, timers, full=False)
    try:
        _run_batch(eng, batch, context, steps, run, sink_mode=sink_mode)
    finally:
        undo()
    recs = _decode_only(eng._bench_records, batch)
    if not recs:
        raise RuntimeError("no decode-only step was observed")
    step_ms = median(dt for dt, _ in recs) * 1e3
    fw_ms = median(c["forward"] for _, c in recs) * 1e3
    rest_ms = median(dt - c["forward"] for dt, c in recs) * 1e3
    # pass 2: breakdown
    timers = _Timers()
    undo = _instrument(eng, timers, full=True)
    try:
        _run_batch(eng, batch, context, steps, run + 1, sink_mode=sink_mode)
    finally:
        undo()
    recs2 = _decode_only(eng._bench_records, batch) or recs
    breakdown = {}
    for cat in CATEGORIES[:-1]:
        breakdown[cat] = median(c.get(cat, 0.0) for _, c in recs2) * 1e3
    breakdown["engine loop"] = median(dt - sum(c.values()) for dt, c in recs2) * 1e3
    top: list = []
    if cprofile:
        top = profile_steps(eng, batch, context=context, steps=steps, run=run + 2, sink_mode=sink_mode)
    return StepSplit(policy=eng.policy.name, batch=batch, context=context, steps=len(recs),
                     step_ms=step_ms, forward_ms=fw_ms, rest_ms=rest_ms, breakdown_ms=breakdown,
                     rest_per_token_us=rest_ms / batch * 1e3, profile_top=top)


def profile_steps(eng, batch: int, *, context: int, steps: int, run: int, top: int = 15,
                  sink_mode: str = "asyncio") -> list:
    """cProfile on the engine thread for one batch; top functions by exclusive time, in ms per
    engine step (torch kernels show as their Python entry points)."""
    pr = cProfile.Profile()
    n_steps = [0]

    def start(e) -> None:
        n_steps[0] = e.counters.get("steps", 0)
        pr.enable()

    def stop(e) -> None:
        pr.disable()
        n_steps[0] = max(1, e.counters.get("steps", 0) - n_steps[0])
    eng.call(start)
    try:
        _run_batch(eng, batch, context, steps, run, sink_mode=sink_mode)
    finally:
        eng.call(stop)
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    rows = []
    for (fn_file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        short = f"{fn_file.rsplit('/', 2)[-1] if '/' in fn_file else fn_file}:{line}({name})"
        rows.append((short, tt / n_steps[0] * 1e3, nc / n_steps[0]))
    rows.sort(key=lambda r: -r[1])
    return [[n, round(ms, 4), round(calls, 2)] for n, ms, calls in rows[:top]]


def run_engine_bench(*, model: str, policies: Sequence[str], batches: Sequence[int], context: int,
                     steps: int, page_size: int = 16, cprofile: bool = False, sink_mode: str = "asyncio",
                     progress: Optional[Callable[[str], Any]] = None) -> list[StepSplit]:
    """One in-process engine per policy (weights loaded once), every batch size on each; the
    policies are interleaved per batch size so a noisy neighbour hits them alike."""
    from kvflow_agents.serving.embedded.engine import Engine
    from kvflow_agents.serving.embedded.model import load_model

    loaded = load_model(model)
    need = max(batches) * (-(-(context + 64 + steps + 64) // page_size) + 1) * page_size
    engines = {}
    try:
        for p in policies:
            engines[p] = Engine(model=model, policy=p, device_tokens=2 * need, host_tokens=2 * need,
                                page_size=page_size, max_batch=max(batches), loaded=loaded,
                                max_prefill_tokens=max(1024, context + 64))
        out = []
        for b in batches:
            for k, p in enumerate(policies):
                if progress is not None:
                    progress(f"{p} batch {b}")
                # warm the kernels and the tree at this shape once, unmeasured
                _run_batch(engines[p], b, context, 4, run=10_000 + b, sink_mode=sink_mode)
                out.append(measure(engines[p], b, context=context, steps=steps, run=1000 * b + k * 10,
                                   cprofile=cprofile, sink_mode=sink_mode))
        return out
    finally:
        for e in engines.values():
            e.shutdown()


# ------------------------------------------------------------------------------ report
REST_TARGET_MS = 0.3   # non-model time per decode step at batch 1 (issue #16)


def summary(results: Sequence[StepSplit]) -> dict:
    """Target check: rest <= 0.3 ms at batch 1 under every policy; spread across policies."""
    b1 = [r for r in results if r.batch == 1]
    out: dict = {"rest_target_ms": REST_TARGET_MS}
    if b1:
        rests = [r.rest_ms for r in b1]
        out.update({"batch1_rest_ms": {r.policy: r.rest_ms for r in b1},
                    "batch1_rest_max_ms": max(rests), "batch1_rest_spread_ms": max(rests) - min(rests),
                    "met": max(rests) <= REST_TARGET_MS})
    return out


def render_table(results: Sequence[StepSplit], title: str):
    """Fits 80 columns: milliseconds per decode-only step (medians)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for name in ("policy", "B", "step", "fwd", "rest", "cache", "sampl", "detok", "sinks", "loop"):
        t.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    for r in results:
        b = r.breakdown_ms
        t.add_row(r.policy, str(r.batch), *(_ms(v) for v in (
            r.step_ms, r.forward_ms, r.rest_ms, b.get("cache", 0), b.get("sampling", 0),
            b.get("detokenise", 0), b.get("sinks", 0), b.get("engine loop", 0))))
    return t


def _ms(v: float) -> str:
    """At most 5 characters, 4 significant digits."""
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def markdown(results: Sequence[StepSplit]) -> str:
    head = ("| policy | batch | step (ms) | model forward | rest | cache | scheduler | sampling | "
            "detokenise | sinks | stats | engine loop |")
    lines = [head, "|---|---:|" + "---:|" * 10]
    for r in results:
        b = r.breakdown_ms
        lines.append("| " + " | ".join([r.policy, str(r.batch), *(f"{v:.3f}" for v in (
            r.step_ms, r.forward_ms, r.rest_ms, b.get("cache", 0), b.get("scheduler", 0),
            b.get("sampling", 0), b.get("detokenise", 0), b.get("sinks", 0), b.get("stats", 0),
            b.get("engine loop", 0)))]) + " |")
    return "\n".join(lines)


def plot(results: Sequence[StepSplit], path: str, title: str) -> None:
    """Stacked bars per policy and batch: model forward + each part of the rest (ms per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in results})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    colors = dict(zip(CATEGORIES, ("#bbbbbb", "#dd8452", "#8172b3", "#55a868", "#4c72b0", "#c44e52",
                                   "#937860", "#222222")))
    for ax, b in zip(axes[0], batches):
        rs = [r for r in results if r.batch == b]
        names = [r.policy for r in rs]
        bottom = [0.0] * len(rs)
        for cat in CATEGORIES:
            vals = [r.forward_ms if cat == "forward" else
                    r.rest_ms * (r.breakdown_ms.get(cat, 0) / max(1e-9, sum(
                        v for k, v in r.breakdown_ms.items() if k != "forward"))) for r in rs]
            ax.bar(names, vals, bottom=bottom, color=colors[cat], label=cat)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax.set_title(f"batch {b}: ms per decode step", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
