"""glibc malloc thresholds pinned for the engine's process (serving/embedded/malloc_tuning.py).

Each check runs in a fresh interpreter: the thresholds are process-wide, and glibc's adaptive
ones depend on everything the process allocated before.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

from kvflow_agents.serving.embedded.malloc_tuning import (MMAP_THRESHOLD_MAX,
                                                          pin_malloc_thresholds)

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# a 24 MiB block: above glibc's starting mmap threshold (128 KiB) and below the 32 MiB cap
_BLOCKS = """
    import ctypes, ctypes.util, json, resource, sys
    from kvflow_agents.serving.embedded.malloc_tuning import pin_malloc_thresholds
    pinned = pin_malloc_thresholds() if sys.argv[-1] == "pin" else False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n = 24 << 20
    faults = []
    for _ in range(4):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)      # write every page, as a forward writes its activations
        libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"pinned": pinned, "faults": faults}))
"""


@glibc_only
def test_pinned_thresholds_keep_a_freed_block_on_the_heap():
    pages = (24 << 20) // 4096
    pinned = _run(_BLOCKS.replace('sys.argv[-1] == "pin"', "True"))
    assert pinned["pinned"] is True
    # the first use faults the block in; every later one reuses the same heap memory
    assert pinned["faults"][0] >= pages // 2
    assert max(pinned["faults"][1:]) < 64, pinned
    # glibc's adaptive thresholds: the first block was mmapped and unmapped on free, the
    # second comes from a heap grown for it: paged in again (what pinning removes)
    adaptive = _run(_BLOCKS.replace('sys.argv[-1] == "pin"', "False"))
    assert adaptive["pinned"] is False
    assert adaptive["faults"][1] >= pages // 2, adaptive


@glibc_only
def test_an_engine_pins_them_and_its_decode_steps_fault_no_pages():
    """A forward's temporaries stay on the heap between steps: decode steps after the first
    few fault (almost) no pages, on the main thread too, where glibc's main arena adapts."""
    r = _run("""
        import json, resource, torch
        from kvflow_agents.serving.embedded.engine import Engine
        eng = Engine(model="tiny-random", policy="oracle", torch_threads=1, start=False)
        kv = eng.pool.device_kv
        ps = eng.page_size
        seqs = [(1 + b, list(range(b * 40, b * 40 + 40)), 600) for b in range(8)]
        with torch.inference_mode():
            for _ in range(5):
                eng.model.decode_batch(kv, seqs)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(20):
                eng.model.decode_batch(kv, seqs)
            steps = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20
        print(json.dumps({"described": eng.describe()["malloc_pinned"], "per_step": steps}))
    """)
    assert r["described"] is True
    assert r["per_step"] < 20, r


def test_thresholds_out_of_range_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold"):
        pin_malloc_thresholds(mmap_threshold=MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError, match="trim_threshold"):
        pin_malloc_thresholds(trim_threshold=-1)
