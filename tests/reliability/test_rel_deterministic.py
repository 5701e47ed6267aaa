"""Deterministic mode (issue #17, reproducer 9): batch-invariant decoding, so greedy output does
not depend on what else is batched, how the prefill budget is shared, or prefix-cache reuse.

Checked bit for bit on fp32 and bf16 weights: on this project's CPUs fp32 GEMMs pick another
kernel for fewer than 4 rows, so plain batching does change fp32 logits there."""

from __future__ import annotations

import threading

import pytest
import torch

from kvflow_agents.serving.embedded.kv_pool import PagedKVPool
from kvflow_agents.serving.embedded.model import load_model


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request):
    return load_model("tiny-random", dtype=request.param)


def _prefill_all(model, cfg, prompts, ps=16):
    pool = PagedKVPool(cfg, device_pages=256, host_pages=0, page_size=ps)
    seqs, nxt = [], 0
    for p in prompts:
        n = -(-(len(p) + 4) // ps)
        pages = list(range(nxt, nxt + n))
        nxt += n
        logits = model.prefill(pool.device_kv, p, pages, 0)
        seqs.append((int(torch.argmax(logits)), pages, len(p)))
    return pool, seqs


def test_invariant_decode_is_bit_identical_alone_and_batched(loaded):
    model, _, cfg = loaded
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 64)]
    pool, seqs = _prefill_all(model, cfg, prompts)
    batched = model.decode_batch(pool.device_kv, seqs, invariant_rows=8)
    for i, s in enumerate(seqs):
        alone = model.decode_batch(pool.device_kv, [s], invariant_rows=8)
        assert torch.equal(alone[0], batched[i]), i
        pair = model.decode_batch(pool.device_kv, [seqs[(i + 1) % len(seqs)], s], invariant_rows=8)
        assert torch.equal(pair[1], batched[i]), i
    # more sequences than rows: processed in groups of exactly R rows
    many = model.decode_batch(pool.device_kv, seqs + seqs[:2], invariant_rows=4)
    assert torch.equal(many[:len(seqs)], model.decode_batch(pool.device_kv, seqs, invariant_rows=4))


def _greedy(eng, prompts, concurrent: bool, max_tokens=24):
    out = [None] * len(prompts)

    def go(i):
        out[i] = eng.generate(prompts[i], max_tokens=max_tokens, temperature=0, ignore_eos=True).token_ids
    if concurrent:
        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        [t.start() for t in ts]
        [t.join() for t in ts]
    else:
        for i in range(len(prompts)):
            go(i)
    return out


def test_engine_greedy_output_does_not_depend_on_batching_or_cache(loaded):
    from kvflow_agents.serving.embedded.engine import Engine

    shared = "A long shared agent prompt that several requests reuse from the cache. " * 6
    prompts = [shared + f"question {i}: " + "why? " * (i % 4) for i in range(8)]
    prompts += [f"unrelated prompt {i} " * (2 + i) for i in range(4)]
    kw = dict(model="tiny-random", policy="lru", device_tokens=8192, max_batch=8,
              max_prefill_tokens=96, deterministic=True, deterministic_chunk=64)
    with Engine(loaded=loaded, **kw) as eng:
        alone = _greedy(eng, prompts, concurrent=False)      # later ones reuse the cached prefix
    with Engine(loaded=loaded, **kw) as eng:
        batched = _greedy(eng, prompts, concurrent=True)     # cold cache, shared budget, batches
        again = _greedy(eng, prompts, concurrent=True)       # warm cache
    assert batched == alone and again == alone
