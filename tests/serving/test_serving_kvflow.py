"""KVFlow behaviour of the embedded server, observed through HTTP (``/kvflow/v1/cache``, usage)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow_agents.testing import wait_until
from serving_helpers import AGENTS, agent_call, chat_hints, cycle_ste, residency, system_prompt

# Four agents' fixed prompts (~176 tokens of whole pages each) in a 640-token device pool:
# three fit with their dynamic suffixes, the fourth forces an eviction.
SMALL_POOL = dict(device_tokens=640, host_tokens=8192)


def run_cycle(client, steps=AGENTS, workflow="wf"):
    return [agent_call(client, a, i, workflow=workflow) for i, a in enumerate(steps)]


@pytest.mark.parametrize("policy", ["kvflow", "lru"])
def test_ste_decides_eviction_on_the_paper_cycle(serve, policy):
    """A -> B -> C -> D -> A with room for three prefixes. When D runs, KVFlow evicts C (the
    agent furthest away, STE 3) and keeps A (next, STE 1); LRU does the opposite."""
    with serve(policy=policy, **SMALL_POOL) as srv:
        c = srv.client()
        run_cycle(c)
        rep = srv.cache()
        where = {a: residency(rep, "wf", a) for a in AGENTS}
        if policy == "kvflow":
            assert where == {"A": "device", "B": "device", "C": "host", "D": "device"}
            ste = {a["agent"]: a["ste"] for a in rep["workflows"][0]["agents"]}
            assert ste == cycle_ste("D")
        else:
            assert where == {"A": "none", "B": "device", "C": "device", "D": "device"}
        assert all(a["tokens"] >= 160 for a in rep["workflows"][0]["agents"])
        table = httpx.get(srv.url + "/kvflow/v1/cache", params={"format": "text"}).text
        row_c = next(line.split() for line in table.splitlines() if line.split()[:2] == ["wf", "C"])
        assert row_c[2] == ("host" if policy == "kvflow" else "device")
        # A runs next: a device hit under kvflow, recomputed under lru
        r = agent_call(c, "A", 4)
        kv = r.usage.model_extra["kvflow"]
        if policy == "kvflow":
            assert kv["device_hit_tokens"] >= 160
        else:
            assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_prefetch_lands_before_the_request_with_link_emulation(serve):
    """C's prefix is on host; when B runs (C is next, STE 1) KVFlow starts loading C over the
    emulated link (~1 s for 11 pages) while B computes; C is on device before C's request.
    (The link is emulated slower than tiny-random recomputes: loads are forced here, see the
    next test for what a recompute-aware engine does instead.)"""
    with serve(policy="kvflow", host_link_gbps=0.00018, recompute_aware=False, **SMALL_POOL) as srv:
        c = srv.client()
        run_cycle(c)                                   # C -> host (see the test above)
        agent_call(c, "A", 4)
        t0 = time.monotonic()
        agent_call(c, "B", 5)                          # hints: C has STE 1 -> prefetch
        seen = [residency(srv.cache(), "wf", "C")]
        assert seen[0] == "loading"
        wait_until(lambda: seen.append(residency(srv.cache(), "wf", "C")) or seen[-1] == "device", timeout=10)
        assert time.monotonic() - t0 > 0.5            # it really took the emulated link time
        r = agent_call(c, "C", 6)
        kv = r.usage.model_extra["kvflow"]
        # the prefetched prefix was on device when C arrived; at most one tail page (its
        # last call's, host-only) is loaded on demand, ~0.1 s instead of the prefix's ~1 s
        assert kv["device_hit_tokens"] >= 160 and kv["host_hit_tokens"] <= 16
        assert kv["load_wait_s"] < 0.5
        m = srv.cache()["metrics"]
        assert m["prefetch_issued"] >= 1 and m["prefetch_used"] >= 1 and m["load_hidden_s"] > 0.5
        text = httpx.get(srv.url + "/metrics").text
        assert 'kvflow_prefetch_total{outcome="used"} 1.0' in text


def test_recompute_aware_engine_recomputes_rather_than_wait_for_a_slow_link(serve):
    """The same workflow, recompute-aware (the default): tiny-random prefills a prompt in
    milliseconds while the emulated link needs ~1 s, so the policy core (measured prefill speed
    vs the link estimate plus one admission step) declines B's host-only tail page and drops
    C's prefetch from the plan (it would land after C starts, later than recomputing takes);
    C's request then recomputes its prefix without waiting for any load."""
    with serve(policy="kvflow", host_link_gbps=0.00018, **SMALL_POOL) as srv:
        c = srv.client()
        run_cycle(c)
        assert residency(srv.cache(), "wf", "C") == "host"
        agent_call(c, "A", 4)
        agent_call(c, "B", 5)                          # hints: C has STE 1
        assert residency(srv.cache(), "wf", "C") == "host"
        r = agent_call(c, "C", 6)
        kv = r.usage.model_extra["kvflow"]
        assert kv["host_hit_tokens"] == 0 and kv["load_wait_s"] == 0
        m = srv.cache()["metrics"]
        assert m["loads_declined"] >= 1 and m["prefetch_recompute_skips"] >= 1
        assert m["prefetch_issued"] == 0 and m["demand_loads"] == 0


@pytest.mark.parametrize("policy", ["kvflow", "hicache"])
def test_status_aware_scheduling_runs_ready_requests_while_a_prefix_loads(serve, policy):
    """An agent's request waits ~1 s for its host-only prefix (emulated link). Under kvflow a
    ready request sent after it runs meanwhile (the load is far longer than the request's own
    prefill, so it is skipped, not admitted layer-wise); under hicache it waits: the loading
    request is admitted at once and its prefill holds the step while each layer lands.
    (The link is emulated slower than tiny-random recomputes, so loads are forced here.)"""
    with serve(policy=policy, host_link_gbps=0.00018, recompute_aware=False, **SMALL_POOL) as srv:
        c = srv.client()
        run_cycle(c)
        slow = "C" if policy == "kvflow" else "A"     # the agent each policy put on host
        assert residency(srv.cache(), "wf", slow) == "host"
        done = {}

        def call(name, fn):
            fn()
            done[name] = time.monotonic()
        loaded = srv.engine.pool.stats["load_pages"]
        tc = threading.Thread(target=call, args=(slow, lambda: agent_call(c, slow, 10)))
        tc.start()
        # read off the engine thread: under hicache it sits in the prefill until the load lands
        wait_until(lambda: srv.engine.pool.stats["load_pages"] > loaded, timeout=5)
        t0 = time.monotonic()
        other = srv.client()
        call("other", lambda: other.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "a ready request"}], max_tokens=3,
            extra_body={"ignore_eos": True}))
        tc.join(15)
        assert done[slow] - t0 > 0.5                    # the load really took the link time
        if policy == "kvflow":
            # ran while the load was on the link: done before the loading call (no bound
            # on its own time: a busy CI machine makes a 3-token call take ~0.6 s)
            assert done["other"] < done[slow]
        else:                                          # head-of-line: blocked behind the load
            assert done["other"] - t0 > 0.5
        m = srv.cache()["metrics"]
        assert m["load_exposed_s"] > 0.3


@pytest.mark.parametrize("scope", ["workflow", "all"])
def test_skip_scope_holds_another_workflows_call_behind_a_loading_one(serve, scope):
    """Workflow wf's call waits ~1 s for its host-only prefix. Another workflow's ready call
    sent after it waits for it under kvflow's default skip scope (``workflow``: it would take
    the batch slot and pages the loading call needs) and runs meanwhile under ``all``."""
    with serve(policy="kvflow", host_link_gbps=0.00018, recompute_aware=False,
               skip_scope=None if scope == "workflow" else scope, **SMALL_POOL) as srv:
        assert srv.engine.call(lambda e: e.scheduler.skip_scope) == scope
        c = srv.client()
        run_cycle(c)
        assert residency(srv.cache(), "wf", "C") == "host"
        done = {}

        def call(name, fn):
            fn()
            done[name] = time.monotonic()
        tc = threading.Thread(target=call, args=("wf", lambda: agent_call(c, "C", 10)))
        tc.start()
        wait_until(lambda: srv.engine.call(lambda e: e.scheduler.counts())["loading"] == 1, timeout=5)
        t0 = time.monotonic()
        call("wf2", lambda: agent_call(srv.client(), "A", 0, workflow="wf2", user="another run"))
        tc.join(15)
        assert done["wf"] - t0 > 0.5                     # the load really took the link time
        if scope == "workflow":
            assert done["wf2"] - t0 > 0.5                # held until the loading call went in
        else:
            assert done["wf2"] < done["wf"]              # ran while the load was on the link
        passed = {line.split('"')[1]: float(line.split()[-1]) for line in
                  httpx.get(srv.url + "/metrics").text.splitlines()
                  if line.startswith("kvflow_admission_passed_over_total{")}
        assert passed["skipped"] >= 1
        assert (passed["held_for_workflow"] >= 1) is (scope == "workflow")


def test_out_of_band_transition_and_end(serve):
    with serve(policy="kvflow", **SMALL_POOL) as srv:
        c = srv.client()
        run_cycle(c)
        with srv.http() as h:
            # a tool node ran: now C is next; the out-of-band hint makes C urgent, D far away
            r = h.post("/kvflow/v1/hints", json=chat_hints("wf", "tool", {"C": 1, "D": None, "A": 2, "B": 3},
                                                           kvflow_event="transition"))
            assert r.status_code == 200 and r.headers["x-kvflow-hints"] == "accepted"
            wait_until(lambda: residency(srv.cache(), "wf", "C") == "device", timeout=5)
            agents = {a["agent"]: a for a in srv.cache()["workflows"][0]["agents"]}
            assert agents["D"]["ste"] is None and agents["C"]["ste"] == 1
            bad = h.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_workflow": "wf"})
            assert bad.status_code == 400 and bad.headers["x-kvflow-hints"].startswith("rejected: kvflow_agent")
            assert h.post("/kvflow/v1/hints", content=b"[").status_code == 400
            r = h.post("/kvflow/v1/hints", json=chat_hints("wf", "D", {}, kvflow_event="end"))
            assert r.status_code == 200
            assert all(w["workflow"] != "wf" for w in srv.cache()["workflows"])


def test_fixed_prefix_inferred_without_fixed_messages(serve):
    """No kvflow_fixed_messages: the boundary comes from the agent's hit history."""
    with serve(policy="kvflow") as srv:
        c = srv.client()
        for i in range(2):
            c.chat.completions.create(
                model="tiny-random", max_tokens=2, messages=[{"role": "system", "content": system_prompt("A")},
                                                   {"role": "user", "content": f"question number {i}"}],
                extra_body={"custom_params": {"kvflow_v": 1, "kvflow_workflow": "inf", "kvflow_agent": "A",
                                              "kvflow_ste": {"A": 0}}})
        agents = srv.cache()["workflows"][0]["agents"]
        assert agents[0]["agent"] == "A" and agents[0]["tokens"] >= 176 and agents[0]["residency"] == "device"


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)  # JSON has no inf/NaN
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                     max_leaves=6)
_keys = st.sampled_from(["kvflow_v", "kvflow_workflow", "kvflow_agent", "kvflow_step", "kvflow_ste",
                         "kvflow_next", "kvflow_fixed_messages", "kvflow_app", "kvflow_event", "kvflow_x", "other"])
_valid = st.fixed_dictionaries({"kvflow_v": st.just(1), "kvflow_workflow": st.just("fz"),
                                "kvflow_agent": st.sampled_from(["a", "b"])})
_params = st.one_of(_json, st.dictionaries(_keys, _json, max_size=6),
                    st.builds(lambda v, extra: {**v, **extra}, _valid, st.dictionaries(_keys, _json, max_size=3)))


def test_malformed_hints_never_fail_a_request(serve):
    with serve(policy="kvflow", device_tokens=1024) as srv:
        c = srv.client()
        seen = {"accepted": 0, "rejected": 0, "none": 0}

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(params=_params)
        def check(params):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny-random", messages=[{"role": "user", "content": "fuzz"}], max_tokens=1,
                extra_body={"custom_params": params})
            assert raw.http_response.status_code == 200
            assert raw.parse().usage.completion_tokens == 1
            h = raw.headers.get("x-kvflow-hints")
            seen["none" if h is None else h.split(":")[0]] += 1
            if h is not None and h != "accepted":
                assert h.startswith("rejected: ") and len(h) > len("rejected: ")
        check()
        assert seen["rejected"] > 10 and seen["accepted"] > 0
        st_ = srv.engine.call(lambda e: dict(e.counters))
        assert st_["hints_rejected"] == seen["rejected"] and st_["errors"] == 0


def test_hints_from_headers_only(serve):
    """An app that only sets X-KVFlow-Workflow / X-KVFlow-Agent still gets its agent tracked."""
    with serve(policy="kvflow") as srv:
        c = srv.client()
        for i in range(2):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny-random", max_tokens=1, messages=[{"role": "system", "content": system_prompt("B")},
                                                   {"role": "user", "content": f"{i}"}],
                extra_headers={"X-KVFlow-Workflow": "hdr", "X-KVFlow-Agent": "B"})
            assert raw.headers["x-kvflow-hints"] == "accepted"
        assert residency(srv.cache(), "hdr", "B") == "device"


@pytest.mark.parametrize("turn_gaps", [True, False])
def test_a_group_chat_agents_history_is_learned_and_kept_over_http(serve, turn_gaps):
    """A reviewer called twice in one group chat (AutoGen's shape): its second prompt is its
    first plus its reply and the next message. The server learns that from the prompts (no
    hint says it) and, once the second call ends, keeps that turn tagged at the reviewer's own
    STE; ``--no-turn-gaps`` learns nothing."""
    with serve(policy="kvflow", turn_gaps=turn_gaps, **SMALL_POOL) as srv:
        c = srv.client()
        msgs = [{"role": "system", "content": system_prompt("R")},
                {"role": "user", "content": "q: is the margin rising? " * 3}]
        hints = dict(kvflow_app="peer")
        for step in range(2):
            reply = c.chat.completions.create(
                model="tiny-random", max_tokens=4, temperature=0, messages=msgs,
                extra_body={"ignore_eos": True, "custom_params": chat_hints(
                    "q1", "R", {"R": 0, "E": 1}, step=2 * step, **hints)})
            msgs = msgs + [{"role": "assistant", "content": reply.choices[0].message.content},
                           {"role": "user", "content": "expresser: revised answer"}]
        gaps = srv.cache()["gaps"]
        assert gaps["turn_gaps"] is turn_gaps
        if turn_gaps:
            assert gaps["agents_learned"] == 1 and gaps["open_turn"] == 1, gaps
            assert residency(srv.cache(), "peer/q1", "R\u27f2") == "device"
        else:
            assert gaps["agents_learned"] == 0 and gaps["open_turn"] == 0, gaps
