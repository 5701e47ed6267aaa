"""The engine's start-up speed probe (serving/embedded/speed_probe.py): batch-1 decode forwards
timed once, before any request, over pages the pool has not handed out yet."""

from kvflow_agents.serving.embedded.cache_view import cache_report
from kvflow_agents.serving.embedded.engine import Engine
from kvflow_agents.serving.embedded.speed_probe import probe_decode_s


def test_the_probe_is_timed_at_start_and_leaves_no_trace_in_what_requests_get(tiny16):
    msgs = [{"role": "system", "content": "You are a careful planner. " * 20},
            {"role": "user", "content": "plan the next step"}]
    outs, probes = [], []
    for reps in (8, 0):
        with Engine(model="tiny-random", policy="kvflow", device_tokens=2048, host_tokens=4096,
                    loaded=tiny16, speed_probe_reps=reps) as eng:
            probes.append(cache_report(eng)["engine"]["speed_probe_s"])
            outs.append([eng.chat(msgs, max_tokens=12, ignore_eos=True).token_ids for _ in range(2)])
            assert cache_report(eng)["engine"]["speed_probe_s"] == probes[-1]  # once, at start
    assert probes[0] > 0 and probes[1] is None
    # the probe wrote into free pages: the replies (a cold prefill, then a cached prefix) are
    # those of an engine that never probed
    assert outs[0] == outs[1] and outs[0][0] == outs[0][1]


def test_the_probe_fits_what_the_pool_holds(tiny16):
    model, _, cfg = tiny16
    import torch
    kv = torch.zeros((cfg.num_layers, 2, 3, 16, cfg.num_kv_heads, cfg.head_dim), dtype=cfg.torch_dtype)
    assert probe_decode_s(model, kv, context=1024, reps=2) > 0   # clipped to 2 pages of context
    assert probe_decode_s(model, kv[:, :, :1], reps=2) is None   # no page left for the new token
    assert probe_decode_s(model, kv, reps=0) is None
