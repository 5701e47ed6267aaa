"""The decode step's per-token path: one sampling call per step, stream events handed to an
event loop once per step, and fixed-prefix tags that cover the page holding a prompt's end."""

from __future__ import annotations

import asyncio

import torch

from kvflow_agents.protocol import Hints
from kvflow_agents.serving.embedded.engine import Engine
from kvflow_agents.serving.embedded.engine_config import sample_token, sample_tokens
from kvflow_agents.serving.embedded.scheduler import SamplingParams


def test_sample_tokens_matches_per_row_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2), SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    ref_gens = [torch.Generator().manual_seed(i) for i in range(5)]
    got = sample_tokens(logits, params, gens)
    assert got == [sample_token(logits[i], params[i], ref_gens[i]) for i in range(5)]
    greedy = [SamplingParams(temperature=0)] * 5
    assert sample_tokens(logits, greedy, [None] * 5) == logits.argmax(-1).tolist()


def _msgs(system: str, user: str) -> list:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_streams_get_every_token_in_order_batched_per_step(tiny16):
    with Engine(model="tiny-random", policy="kvflow", device_tokens=4096, loaded=tiny16) as eng:
        async def run_all():
            async def one(i):
                req = eng.make_request(messages=_msgs("s" * 40, f"user {i}"), max_tokens=12)
                req.params.ignore_eos = True
                text, done = "", None
                async for ev in eng.stream(req):
                    text += ev.text
                    done = ev.done or done
                return text, done
            return await asyncio.gather(*(one(i) for i in range(4)))
        outs = asyncio.run(run_all())
        calls = eng.call(lambda e: e.counters["decode_steps"])
    for text, done in outs:
        assert done is not None and done.finish_reason == "length"
        assert text == done.text and len(done.token_ids) == 12
    assert calls < 4 * 12   # the four decoded together


def test_fixed_prefix_tag_covers_the_page_holding_the_prompt_end(tiny16):
    """tiny-random: one byte = one token; ChatML puts 10 template tokens around the system
    message and 6 before the user text, so a 1010-byte system message ends at token 1020,
    mid-page; the page 1008-1023 (its end + the user header) is the same on every call, and
    is tagged from the first call on. A 1002-byte one ends at 1012: that page also holds 6
    user bytes, which differ between calls, so the second call takes the tag back to 1008."""
    def tagged(system: str, user) -> list:
        with Engine(model="tiny-random", policy="kvflow", device_tokens=8192, page_size=16,
                    loaded=tiny16) as eng:
            lens = []
            for i in range(3):
                h = Hints(workflow="w", agent="a", step=i, ste={"a": 0, "b": 1}, fixed_messages=1)
                eng.chat(_msgs(system, user(i)), hints=h, max_tokens=2)
                lens.append(eng.call(lambda e: e.manager.fixed_prefix_len("w", "a")))
            return lens

    assert tagged("x" * 1010, lambda i: f"call number {i} " * 3) == [1024, 1024, 1024]
    assert tagged("x" * 1002, lambda i: f"{i}{i}{i}{i}{i}{i} and the rest") == [1024, 1008, 1008]
