"""PagedKVPool: the policy's KVTransferBackend over real tensors (tiny-random)."""

import pytest
import torch

from embedded_helpers import make_pool
from kvflow_agents.serving.embedded.kv_pool import PagedKVPool
from kvflow_agents.serving.policy.backend import KVTransferBackend


def _ids(n, seed=1):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_is_a_transfer_backend(tiny16):
    _, _, cfg = tiny16
    pool = make_pool(cfg)
    assert isinstance(pool, KVTransferBackend)
    assert pool.bytes_per_page == cfg.kv_bytes_per_token * pool.page_size
    assert pool.device_kv.shape == (2, 2, 64, 16, 2, 64)
    assert not pool.host_kv.is_pinned()  # CPU device: never pin (CPU wheels cannot)


def test_backup_load_roundtrip_restores_kv_and_logits(tiny16):
    model, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=16, host_pages=16)
    ids = _ids(80)
    pages_a = [3, 9, 1]                         # 48-token prefix in 3 scattered pages
    model.prefill(pool.device_kv, ids[:48], pages_a, 0)
    ref = model.prefill(pool.device_kv, ids[48:], pages_a + [12, 13], 48, return_all=True)
    before = pool.device_kv[:, :, pages_a].clone()

    pool.backup_to_host(pages_a, [7, 0, 15])
    pool.device_kv.normal_()                    # the device copy is gone (evicted, reused)
    ready = pool.start_load([7, 0, 15], [4, 5, 11])
    assert ready <= pool.now()                  # no link emulation: usable at once on CPU
    assert torch.equal(pool.device_kv[:, :, [4, 5, 11]], before)
    got = model.prefill(pool.device_kv, ids[48:], [4, 5, 11, 2, 6], 48, return_all=True)
    assert torch.equal(got, ref)
    assert pool.stats["backup_pages"] == 3 and pool.stats["load_pages"] == 3


def test_link_emulation_ready_time(tiny16):
    _, _, cfg = tiny16
    t = [100.0]
    pool = make_pool(cfg, host_link_gbps=0.5, clock=lambda: t[0])
    bpp = pool.bytes_per_page                   # 2 layers * 2 * 16 * 2 heads * 64 * 2 B
    assert bpp == 16384
    pool.host_kv[:, :, 2] = 1.0
    r1 = pool.start_load([1, 2, 3], [10, 11, 12])
    assert r1 == pytest.approx(100.0 + 3 * bpp / 0.5e9)
    assert torch.all(pool.device_kv[:, :, 11] == 1.0)   # the copy itself is already done
    r2 = pool.start_load([4], [13])             # queues behind the first on the one link
    assert r2 == pytest.approx(r1 + bpp / 0.5e9)
    t[0] = 200.0                                # link idle again
    assert pool.start_load([5, 6], [14, 15]) == pytest.approx(200.0 + 2 * bpp / 0.5e9)
    assert pool.start_load([], []) == 200.0


def test_argument_checks(tiny16):
    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=4, host_pages=4)
    with pytest.raises(ValueError):
        pool.backup_to_host([0, 1], [0])
    with pytest.raises(ValueError):
        pool.start_load([0], [0, 1])
    with pytest.raises(IndexError):
        pool.start_load([4], [0])
    with pytest.raises(IndexError):
        pool.backup_to_host([-1], [0])
    assert pool.is_ready([0]) and pool.wait_loads([0]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_load_roundtrip(tiny16):
    from kvflow_agents.serving.embedded.model import load_model
    model, _, cfg = load_model("tiny-random", device="cuda")
    pool = PagedKVPool(cfg, device_pages=16, host_pages=16, device="cuda")
    assert pool.host_kv.is_pinned()
    ids = _ids(40)
    ref = model.prefill(pool.device_kv, ids, [0, 1, 2], 0, return_all=True)
    pool.backup_to_host([0, 1, 2], [5, 6, 7])
    pool.device_kv.zero_()
    pool.start_load([5, 6, 7], [8, 9, 10])
    pool.wait_loads([8, 9, 10])
    got = model.prefill(pool.device_kv, ids[32:], [8, 9, 10], 32, return_all=True)
    assert torch.allclose(got, ref[32:], atol=5e-2)
    pool.synchronize()
    assert pool.is_ready()
