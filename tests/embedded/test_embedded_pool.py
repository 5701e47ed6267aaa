"""PagedKVPool: the policy's KVTransferBackend over real tensors (tiny-random)."""

import time

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
    pool.wait_copies(pages_a)                   # a forward writing these pages waits so
    pool.device_kv.normal_()                    # the device copy is gone (evicted, reused)
    ready = pool.start_load([7, 0, 15], [4, 5, 11])
    assert ready <= pool.now()                  # no link emulation: usable at once on CPU
    pool.wait_copies([4, 5, 11])                 # (copied on the copy thread, in the background)
    assert pool.is_ready([4, 5, 11]) and torch.equal(pool.device_kv[:, :, [4, 5, 11]], before)
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
    pool.wait_copies([11])                       # the copy itself takes real time only
    assert torch.all(pool.device_kv[:, :, 11] == 1.0)
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
    assert pool.is_ready([0]) and pool.wait_copies([0]) is None


@pytest.mark.parametrize("dst_pages,src_pages", [
    (list(range(10, 20)), list(range(30, 40))),                        # one run each side
    ([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]),                               # dst breaks once
    ([60, 61, 2, 3, 40], [7, 8, 9, 1, 2]),                             # both break, descending
    ([2 * i for i in range(20)], list(range(20))),                     # 20 one-page runs
])
def test_page_copies_match_a_gather(tiny16, dst_pages, src_pages):
    """backup/load copy neighbouring pages as slices: same bytes as index_select/index_copy_."""
    from kvflow_agents.serving.embedded.kv_pool import page_runs

    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=64, host_pages=64)
    pool.host_kv.normal_()
    pool.device_kv.normal_()
    want = pool.device_kv.clone()
    want.index_copy_(2, torch.tensor(dst_pages), pool.host_kv.index_select(2, torch.tensor(src_pages)))
    pool.start_load(src_pages, dst_pages)
    pool.wait_copies(dst_pages)
    assert torch.equal(pool.device_kv, want)
    runs = page_runs(dst_pages, src_pages)
    assert sum(n for _, _, n in runs) == len(dst_pages)
    host_want = pool.host_kv.clone()
    host_want.index_copy_(2, torch.tensor(src_pages), pool.device_kv.index_select(2, torch.tensor(dst_pages)))
    pool.backup_to_host(dst_pages, src_pages)
    pool.synchronize()                          # (a backup may copy on the copy thread)
    assert torch.equal(pool.host_kv, host_want)


def test_copies_follow_a_replaced_device_tensor(tiny16):
    """The CPU copies work on byte views of the tiers made once per tensor; a grown device
    tier (the engine replaces ``device_kv`` with a longer one) gets the next load, and the
    old tensor's view is let go."""
    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=8, host_pages=8)
    pool.host_kv.normal_()
    pool.start_load([1, 2], [0, 1])
    pool.wait_copies()
    old = pool.device_kv
    pool.device_kv = torch.cat([old, torch.zeros_like(old)], 2)   # 16 pages now
    pool.start_load([3, 4, 5], [12, 13, 14])
    pool.wait_copies()
    assert torch.equal(pool.device_kv[:, :, 12:15], pool.host_kv[:, :, 3:6])
    assert torch.equal(pool.device_kv[:, :, 0:2], pool.host_kv[:, :, 1:3])
    assert not torch.equal(old[:, :, 0:2], torch.zeros_like(old[:, :, 0:2]))  # the first load landed there
    assert all(b.tensor is not old for b in pool._tier_bytes.values())


def test_cpu_copies_keep_the_gil(tiny16):
    """An inline copy does not hand the GIL to another thread: in a server the event loop's
    thread would take it, and the engine thread would wait up to the switch interval (5 ms) to
    get it back, per copy op. A thread that wants the GIL the whole time does not run during a
    load or a backup (the switch interval is raised so only a release could let it in)."""
    import sys
    import threading

    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=64, host_pages=64)
    pool.host_kv.normal_()
    pages = list(range(0, 64, 2))                          # 32 runs: many copy ops
    pool.start_load([0], [0])       # (views of the tiers made first: torch ops release the GIL)
    go, stop, ran = threading.Event(), threading.Event(), [0]

    def want_the_gil():
        go.wait()
        while True:
            ran[0] += 1
            if stop.is_set():
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    t = threading.Thread(target=want_the_gil)
    t.start()
    try:
        go.set()
        until = time.perf_counter() + 0.005               # (holding the GIL: it is waiting now)
        while time.perf_counter() < until:
            pass
        before = ran[0]
        pool.start_load(pages, pages)
        pool.backup_to_host(pages[::-1], pages)
        during = ran[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join()
    assert ran[0] > 0                                      # it did run, once we let go
    assert during == 0
    assert torch.equal(pool.host_kv[:, :, pages], pool.device_kv[:, :, pages[::-1]])


def test_cpu_loads_run_on_a_copy_thread_in_order(tiny16):
    """start_load returns before the copy is done; loads land in the order they were started
    (a later load into the same pages wins); a backup queued after them copies what they wrote."""
    import threading

    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=True)
    for p in range(8):
        pool.host_kv[:, :, p] = float(p)
    gate = threading.Event()
    pool.start_load([0], [0])                   # starts the copy thread
    pool._copier.submit(gate.wait)              # hold it: the next loads queue behind
    pool.start_load([3, 4], [5, 6])
    pool.start_load([7], [6])                   # same device page, later: must win
    assert not pool.is_ready([5]) and not pool.is_ready() and pool.is_ready([1, 2])
    gate.set()
    pool.wait_copies([6])
    assert torch.all(pool.device_kv[:, :, 5] == 3.0) and torch.all(pool.device_kv[:, :, 6] == 7.0)
    pool.start_load([2], [1])
    pool.backup_to_host([1], [0])               # queued behind the load into page 1
    pool.synchronize()
    assert torch.all(pool.host_kv[:, :, 0] == 2.0)
    pool.close()
    assert pool.is_ready() and pool._copier is None
    with pytest.raises(IndexError):             # bad ids fail at once, not on the copy thread
        pool.start_load([8], [0])
    # with every core in torch's ops, loads are copied inline (a copy thread would stall them)
    inline = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=False)
    inline.host_kv[:, :, 3] = 5.0
    inline.start_load([3], [2])
    assert inline._copier is None and inline.is_ready() and torch.all(inline.device_kv[:, :, 2] == 5.0)


def test_a_backup_is_queued_on_the_copy_thread_in_order(tiny16):
    """On CPU with a copy thread a backup returns at once, even behind a held load (the engine
    thread's eviction does not wait for a memcpy), and keeps the order the policy relies on:
    it copies what a load queued before it wrote into its device page; a load queued after it
    from its host page reads what it wrote; a forward's ``wait_copies`` of its device page
    returns only once it has read the page, so the page can be reused; inline it is done on
    return."""
    import threading

    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=True)
    for p in range(8):
        pool.host_kv[:, :, p] = float(p)
    pool.device_kv[:, :, 3] = 30.0
    pool.start_load([0], [0])                   # (starts the copy thread)
    gate = threading.Event()
    pool._copier.submit(gate.wait)              # hold the copy thread
    pool.start_load([1], [5])                   # host 1 -> device 5, held
    pool.backup_to_host([5, 3], [7, 2])         # returns at once, behind the held load
    pool.start_load([2], [6])                   # reads host 2 after the backup wrote it
    assert pool.stats["backup_pages"] == 2 and pool.stats["backup_s"] == 0.0  # not copied yet
    assert not pool.is_ready([3]) and pool.is_ready([4])    # the backup still reads page 3
    waited = threading.Event()
    t = threading.Thread(target=lambda: (pool.wait_copies([3]), waited.set()), daemon=True)
    t.start()
    assert not waited.wait(0.2)                 # a forward writing page 3 is held
    gate.set()
    t.join(5)
    assert waited.is_set() and pool.is_ready([3])
    pool.synchronize()
    assert torch.all(pool.host_kv[:, :, 7] == 1.0)    # device 5 after its load landed
    assert torch.all(pool.host_kv[:, :, 2] == 30.0)   # device 3
    assert torch.all(pool.device_kv[:, :, 6] == 30.0)  # the later load read the backup's copy
    assert pool.stats["backup_s"] > 0
    pool.close()
    inline = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=False)
    inline.device_kv[:, :, 1] = 4.0
    inline.backup_to_host([1], [6])
    assert inline._copier is None and inline.is_ready() and torch.all(inline.host_kv[:, :, 6] == 4.0)


def test_a_waited_copy_that_touches_no_other_copys_pages_runs_at_once(tiny16):
    """A forward waiting for a backup out of its pages does not wait behind unrelated loads:
    the waiter runs the backup itself when it has not started and no other unfinished copy
    touches its device or host pages; one that does is left to the FIFO (ordering test above)."""
    import threading

    _, _, cfg = tiny16
    pool = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=True)
    for p in range(8):
        pool.host_kv[:, :, p] = float(p)
        pool.device_kv[:, :, p] = 10.0 + p
    pool.start_load([0], [0])                   # (starts the copy thread)
    pool.wait_copies([0])
    gate = threading.Event()
    pool._copier.submit(gate.wait)              # hold the copy thread
    try:
        pool.start_load([1, 2], [1, 2])         # a prefetch, held
        pool.backup_to_host([4], [5])           # an eviction's backup, behind it: unrelated
        pool.backup_to_host([6], [1])           # behind it too, but host 1 is the load's source
        done = threading.Event()
        t = threading.Thread(target=lambda: (pool.wait_copies([4]), done.set()), daemon=True)
        t.start()
        assert done.wait(5)                     # ran by the waiter, the copy thread still held
        assert torch.all(pool.host_kv[:, :, 5] == 14.0) and pool.stats["copies_run_by_waiter"] == 1
        assert pool.is_ready([4]) and not pool.is_ready([6]) and not pool.is_ready([1])
        held = threading.Event()
        t = threading.Thread(target=lambda: (pool.wait_copies([6]), held.set()), daemon=True)
        t.start()
        assert not held.wait(0.2)               # it must not overwrite host 1 before the load read it
    finally:
        gate.set()
    t.join(5)
    assert held.is_set() and pool.stats["copies_run_by_waiter"] == 1
    assert torch.all(pool.device_kv[:, :, 1] == 1.0)   # the load read host 1 before the backup
    assert torch.all(pool.host_kv[:, :, 1] == 16.0)
    pool.close()


def test_a_failed_copy_on_the_copy_thread_stops_every_forward_until_taken(tiny16, monkeypatch):
    """A backup that fails on the copy thread was promised when it was queued (the policy freed
    its device pages and may load its host pages), so after it no wait lets a forward go on,
    whatever pages it asks for, until the owner takes the failure (and drops the cache).
    Inline, the failure raises to the caller, who knows which pages it was."""
    from kvflow_agents.serving.embedded import kv_pool

    _, _, cfg = tiny16
    copy = kv_pool._copy_pages
    armed = [True]

    def failing_backup(dst, dst_pages, src, src_pages):
        if armed[0] and dst.tensor is pool.host_kv:
            armed[0] = False
            raise RuntimeError("injected")
        copy(dst, dst_pages, src, src_pages)

    monkeypatch.setattr(kv_pool, "_copy_pages", failing_backup)
    pool = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=True)
    pool.backup_to_host([1], [2])               # returns at once; fails on the copy thread
    pool.start_load([3], [4])                   # queued behind it (a load of another prefix)
    deadline = time.monotonic() + 5
    while pool.copy_failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(kv_pool.KVCopyFailed):
        pool.wait_copies([6])                   # pages no copy touches: still no forward
    with pytest.raises(kv_pool.KVCopyFailed):
        pool.wait_copies([4])
    exc = pool.take_copy_failure()
    assert isinstance(exc, RuntimeError) and str(exc) == "injected"
    assert pool.is_ready() and pool.take_copy_failure() is None
    pool.wait_copies([1, 4])                    # the owner has reset: forwards go on
    pool.backup_to_host([1], [2])
    pool.wait_copies([1])
    assert pool.copy_failure is None
    armed[0] = True                             # synchronize waits for every copy, then raises
    pool.host_kv[:, :, 5] = 7.0
    pool.backup_to_host([1], [2])
    pool.start_load([5], [6])
    with pytest.raises(RuntimeError, match="injected"):
        pool.synchronize()
    assert torch.all(pool.device_kv[:, :, 6] == 7.0) and pool.is_ready()
    assert isinstance(pool.take_copy_failure(), RuntimeError)
    pool.close()

    armed[0] = True
    pool = make_pool(cfg, device_pages=8, host_pages=8, copy_thread=False)
    with pytest.raises(RuntimeError, match="injected"):
        pool.backup_to_host([1], [2])
    assert pool.copy_failure is None            # its caller got it; the pool stays usable
    pool.wait_copies([1])


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
    pool.wait_copies([8, 9, 10])
    got = model.prefill(pool.device_kv, ids[32:], [8, 9, 10], 32, return_all=True)
    assert torch.allclose(got, ref[32:], atol=5e-2)
    pool.synchronize()
    assert pool.is_ready()
