"""Lazy decode pages on the embedded engine (``EngineConfig.lazy_decode_pages``): a running
request holds the pages it has written, not all of ``max_tokens``, so the next agent's prefix
stays on device beside it; greedy output is the same as with pages allocated upfront."""

from __future__ import annotations

import asyncio

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.embedded.engine import Engine


def _msgs(system: str, user: str) -> list:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _run(tiny16, lazy: bool):
    """64 device pages. B's call leaves its ~26-page prefix cached; then A runs with a
    19-page prompt and max_tokens 600 (38 pages), B next (STE 1). Returns B's prefix tokens
    on device while A has written 10 tokens, the pages evicted for allocations, A's output."""
    with Engine(model="tiny-random", policy="kvflow", device_tokens=1024, host_tokens=8192,
                page_size=16, lazy_decode_pages=lazy, loaded=tiny16) as eng:
        b_msgs = _msgs("b" * 390, "hi")
        eng.chat(b_msgs, hints=Hints(workflow="w", agent="B", step=0, ste={"B": 0, "A": 1},
                                     fixed_messages=1), max_tokens=2)
        b_prompt = eng.make_request(messages=b_msgs).prompt_ids
        fixed = eng.call(lambda e: e.manager.fixed_prefix_len("w", "B"))
        on_device = lambda e: e.manager.peek(b_prompt[:fixed]).device_len  # noqa: E731

        async def a_call():
            req = eng.make_request(messages=_msgs("a" * 280, "go"), max_tokens=600,
                                   hints=Hints(workflow="w", agent="A", step=1,
                                               ste={"A": 0, "B": 1}, fixed_messages=1))
            req.params.ignore_eos = True
            req.params.temperature = 0
            written, mid, done, reserved = 0, None, None, []
            async for ev in eng.stream(req):
                written += len(ev.token_ids)
                if mid is None and written >= 10:
                    mid = eng.call(on_device)
                    reserved.append(eng.cache_report()["pools"]["device"]["reserved_tokens"])
                done = ev.done or done
            return mid, done, reserved[0]

        mid_device, done, reserved = asyncio.run(a_call())
        evicted = eng.call(lambda e: sum(e.manager.metrics.evicted_pages.get(f"device:{r}", 0)
                                         for r in ("alloc", "grow")))   # admissions, decode pages
        assert eng.call(lambda e: e.manager.check_invariants() or True)
        return fixed, mid_device, evicted, done, reserved


def test_lazy_decode_keeps_the_next_agents_prefix_beside_a_long_running_request(tiny16):
    fixed, lazy_mid, lazy_evicted, lazy_done, lazy_reserved = _run(tiny16, lazy=True)
    _, up_mid, up_evicted, up_done, up_reserved = _run(tiny16, lazy=False)
    # the cache report shows what the running request may still take: a quarter of its ~38
    # decode pages (the default decode_reserve), less what it has written
    assert up_reserved == 0 and 16 * 7 <= lazy_reserved <= 16 * 10
    assert fixed >= 384
    assert lazy_done.finish_reason == up_done.finish_reason == "length"
    assert lazy_done.token_ids == up_done.token_ids and len(lazy_done.token_ids) == 600
    assert lazy_mid == fixed          # B's whole prefix on device while A decodes
    assert up_mid < fixed             # upfront: A's admission evicted (some of) it
    # as A wrote its 600 tokens its growth evicted what it needed (B's tail: then, A done, B
    # is prefetched back), no more than upfront allocation evicted at once
    assert 0 < lazy_evicted <= up_evicted


def _two_long_replies(tiny16, reserve: float, prompts: list, solo: bool = False, **cfg):
    """32 device pages; two 100-token prompts that each write 200 tokens (19 pages each, 38 in
    all). Returns the two completions and the retractions the cache counted."""
    with Engine(model="tiny-random", policy="lru", device_tokens=512, host_tokens=0,
                page_size=16, decode_reserve=reserve, loaded=tiny16, **cfg) as eng:
        async def one(prompt):
            req = eng.make_request(prompt_ids=prompt, max_tokens=200)
            req.params.ignore_eos = True
            done = None
            async for ev in eng.stream(req):
                done = ev.done or done
            return done

        async def both():
            if solo:
                return [await one(p) for p in prompts]
            return await asyncio.gather(*(one(p) for p in prompts))

        done = asyncio.run(both())
        assert eng.call(lambda e: e.manager.check_invariants() or True)
        return done, eng.call(lambda e: e.manager.metrics.retractions)


def test_an_optimistic_reserve_runs_both_and_a_retracted_request_decodes_on_unchanged(tiny32):
    """With half of max_tokens reserved both requests are admitted at once; when their
    replies outgrow the pool the newest is retracted (its KV cached), re-prefilled from the
    cache once the other is done, and decodes on: its tokens are the ones it writes alone.
    A full reserve never retracts (the second request waits instead). float32: in bf16 the
    re-prefilled KV of its outputs differs from the decode-written KV in the last bits, and
    this random model's greedy pick drifted ~80 tokens after the retraction (as a recompute
    preemption in vLLM or SGLang may)."""
    prompts = [[10 + i for i in range(100)], [250 - i for i in range(100)]]  # vocab: 259
    alone, _ = _two_long_replies(tiny32, 1.0, prompts, solo=True)
    optimistic, retracted = _two_long_replies(tiny32, 0.5, prompts)
    full, never = _two_long_replies(tiny32, 1.0, prompts)
    assert retracted >= 1 and never == 0
    for got in (optimistic, full):
        assert [c.finish_reason for c in got] == ["length", "length"]
        assert [c.token_ids for c in got] == [c.token_ids for c in alone]
        assert [c.cached_tokens for c in got] == [0, 0]  # what the client's prompt got


def test_deterministic_mode_replays_a_retracted_reply_bit_for_bit(tiny16):
    """--deterministic: a retracted request keeps only its prompt cached (decode-written KV is
    not what a prefill writes) and replays its outputs through batch-invariant decode steps,
    so even in bf16 both replies are token for token the ones written alone."""
    prompts = [[10 + i for i in range(100)], [250 - i for i in range(100)]]
    det = dict(deterministic=True, deterministic_chunk=32, max_batch=4)
    alone, _ = _two_long_replies(tiny16, 1.0, prompts, solo=True, **det)
    optimistic, retracted = _two_long_replies(tiny16, 0.5, prompts, **det)
    assert retracted >= 1
    assert [c.token_ids for c in optimistic] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in optimistic] == ["length", "length"]
