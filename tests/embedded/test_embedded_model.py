"""tiny-random: the paged forward against itself (cached vs full, chunked, batched) and against
a plain, unpaged reference Llama written the textbook way.

Tolerances: fp32 1e-4 absolute on logits (|logits| ~ 4); bf16 5e-2 absolute (bf16 has 8 bits of
mantissa; paths differ only in matmul shapes / accumulation order).
"""

import math

import pytest
import torch

from embedded_helpers import make_pool

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _ids(n, seed=1, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model, ids):
    """Unpaged fp32 HF-style forward (repeat_kv, rotate_half, full causal softmax)."""
    c = model.config
    T, H, KVH, hd = len(ids), c.num_heads, c.num_kv_heads, c.head_dim

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_eps) * w

    def rope(x):  # [heads, T, hd]
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(T).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    x = model.embed.float()[torch.tensor(ids)]
    for L in model.layers:
        qkv = rms(x, L["ln1"]) @ L["qkv"].float().T
        q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], -1)
        q = rope(q.view(T, H, hd).transpose(0, 1))
        k = rope(k.view(T, KVH, hd).transpose(0, 1)).repeat_interleave(H // KVH, 0)
        v = v.view(T, KVH, hd).transpose(0, 1).repeat_interleave(H // KVH, 0)
        s = q @ k.transpose(1, 2) / math.sqrt(hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = (s.softmax(-1) @ v).transpose(0, 1).reshape(T, H * hd)
        x = x + o @ L["o"].float().T
        g, u = (rms(x, L["ln2"]) @ L["gate_up"].float().T).split(c.intermediate, -1)
        x = x + (torch.nn.functional.silu(g) * u) @ L["down"].float().T
    return rms(x, model.norm) @ model.lm_head.float().T


def test_matches_unpaged_reference(tiny32):
    model, _, cfg = tiny32
    pool = make_pool(cfg)
    ids = _ids(90)
    got = model.prefill(pool.device_kv, ids, [5, 1, 9, 2, 7, 3], 0, return_all=True)
    ref = reference_logits(model, ids)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("which", ["tiny32", "tiny16"])
@pytest.mark.parametrize("split", [37, 32, 1])
def test_cached_prefix_equals_full_prefill(request, which, split):
    model, _, cfg = request.getfixturevalue(which)
    pool = make_pool(cfg)
    ids = _ids(100)
    full = model.prefill(pool.device_kv, ids, list(range(7)), 0, return_all=True)
    pages = [40, 3, 17, 60, 9, 22, 30]  # scattered, not the pages used above
    model.prefill(pool.device_kv, ids[:split], pages, 0)
    part = model.prefill(pool.device_kv, ids[split:], pages, split, return_all=True)
    assert part.shape == (100 - split, cfg.vocab_size)
    assert (full[split:] - part).abs().max().item() < TOL[cfg.torch_dtype]
    # the prefix really is read from the pool: corrupt one of its pages
    pool.device_kv[:, :, pages[0]] += 1.0
    bad = model.prefill(pool.device_kv, ids[split:], pages, split, return_all=True)
    assert (bad - part).abs().max().item() > 10 * TOL[cfg.torch_dtype]


def test_chunked_prefill_equals_one_chunk(tiny16):
    model, _, cfg = tiny16
    pool = make_pool(cfg)
    ids = _ids(100, seed=2)
    one = model.prefill(pool.device_kv, ids, list(range(7)), 0, return_all=True)
    chunked = model.prefill(pool.device_kv, ids, list(range(10, 17)), 0, chunk_size=24,
                            return_all=True)
    assert (one - chunked).abs().max().item() < TOL[cfg.torch_dtype]
    last = model.prefill(pool.device_kv, ids, list(range(20, 27)), 0, chunk_size=24)
    assert last.shape == (cfg.vocab_size,) and torch.allclose(last, chunked[-1], atol=5e-2)


@pytest.mark.parametrize("which", ["tiny32", "tiny16"])
def test_decode_steps_equal_prefill(request, which):
    model, _, cfg = request.getfixturevalue(which)
    pool = make_pool(cfg)
    ids = _ids(40, seed=3)
    full = model.prefill(pool.device_kv, ids, [0, 1, 2], 0, return_all=True)
    pages = [11, 5, 8]
    model.prefill(pool.device_kv, ids[:30], pages, 0)
    for p in range(30, 40):
        step = model.decode_batch(pool.device_kv, [(ids[p], pages, p)])
        assert step.shape == (1, cfg.vocab_size)
        assert (step[0] - full[p]).abs().max().item() < TOL[cfg.torch_dtype]


@pytest.mark.parametrize("which", ["tiny32", "tiny16"])
def test_batched_decode_equals_single(request, which):
    model, _, cfg = request.getfixturevalue(which)
    lens = [0, 5, 16, 33, 70]  # incl. an empty prefix and a page-boundary position
    seqs, k = [], 0
    for i, n in enumerate(lens):
        pages = list(range(k, k + n // 16 + 1))[::-1]  # reversed: not in id order
        k += len(pages)
        seqs.append((_ids(n + 1, seed=10 + i), pages))
    single_pool, batch_pool = make_pool(cfg), make_pool(cfg)
    singles = []
    for ids, pages in seqs:
        for pool in (single_pool, batch_pool):
            if len(ids) > 1:
                model.prefill(pool.device_kv, ids[:-1], pages, 0)
        singles.append(model.decode_batch(single_pool.device_kv,
                                          [(ids[-1], pages, len(ids) - 1)])[0])
    batch = model.decode_batch(batch_pool.device_kv,
                               [(ids[-1], pages, len(ids) - 1) for ids, pages in seqs])
    for i, s in enumerate(singles):
        assert (batch[i] - s).abs().max().item() < TOL[cfg.torch_dtype]
    assert torch.equal(single_pool.device_kv, batch_pool.device_kv) or \
        (single_pool.device_kv.float() - batch_pool.device_kv.float()).abs().max() < 5e-2


def test_page_checks(tiny16):
    model, _, cfg = tiny16
    pool = make_pool(cfg)
    with pytest.raises(ValueError):
        model.prefill(pool.device_kv, _ids(20), [0], 0)  # 20 tokens need 2 pages of 16
    with pytest.raises(ValueError):
        model.decode_batch(pool.device_kv, [(1, [0], 16)])  # position 16 is on a 2nd page


def test_greedy_generate_deterministic(tiny16):
    from kvflow_agents.serving.embedded.model import greedy_generate
    model, tok, cfg = tiny16
    pool = make_pool(cfg)
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}])
    a = greedy_generate(model, pool.device_kv, list(range(4)), prompt, 8)
    b = greedy_generate(model, pool.device_kv, list(range(4, 8)), prompt, 8)
    assert a == b and len(a) == 8


def test_model_path_dir_loads_hf_layout(tmp_path, tiny16):
    """--model-path: any local Llama dir (safetensors + config.json + tokenizer.json)."""
    import json

    from safetensors.torch import save_file

    from kvflow_agents.serving.embedded.model import load_model
    from kvflow_agents.serving.embedded.model.config import config_to_hf
    from kvflow_agents.serving.embedded.model.llama import random_weights
    model, tok, cfg = tiny16
    save_file(random_weights(cfg), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    tok.save(tmp_path)
    m2, tok2, cfg2 = load_model(str(tmp_path))
    assert cfg2.replace(name=cfg.name, extra=cfg.extra) == cfg
    pool = make_pool(cfg)
    ids = tok2.encode_chat([{"role": "user", "content": "hello"}])
    a = model.prefill(pool.device_kv, ids, [0, 1, 2, 3], 0)
    b = m2.prefill(pool.device_kv, ids, [4, 5, 6, 7], 0)
    assert torch.equal(a, b)


def test_unknown_and_oversized_presets():
    from kvflow_agents.serving.embedded.model import load_model
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="cuda"):
        load_model("llama-3.1-8b-shape", device="cpu")
