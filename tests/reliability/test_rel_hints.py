"""Bounded hint state (issue #17, reproducer 5): expired workflows are removed, not only ignored;
the registry's size, agents per workflow and agents in all are capped (oldest quiet workflows go
first); the manager drops the tags of removed workflows; /metrics shows the counts."""

from __future__ import annotations

import math
import time

from kvflow_agents.serving.policy import KVCacheManager
from kvflow_agents.serving.policy.hints import HintRegistry

INF = math.inf


def test_expired_workflows_are_forgotten_after_the_grace():
    reg = HintRegistry(lease_s=10, forget_after_s=5)
    reg.update("w1", {"a": 1}, now=0, client="t1")
    reg.update("w2", {"a": 1, "b": 2}, now=8, client="t2")
    assert reg.active_clients() == 2
    assert reg.expire(11) == ["w1"] and reg.ste("w1", "a") == INF
    assert reg.active_clients() == 1 and reg.workflows["w1"].expired
    assert reg.expire(15) == [] and "w1" in reg.workflows  # within the grace: revivable
    assert reg.expire(16.5) == [] and "w1" not in reg.workflows
    assert reg.drain_removed() == ["w1"] and reg.drain_removed() == []
    assert reg.stats() == {"workflows": 1, "live": 1, "expired": 0, "agents": 2, "clients": 1,
                           "evicted": 0, "forgotten": 1, "released": 0, "agents_dropped": 0}
    _, revived = reg.update("w2", {"a": 0}, now=17)  # a hint in time keeps it live
    assert not revived and reg.ste("w2", "a") == 0


def test_full_registry_evicts_the_oldest_quiet_workflow_first():
    reg = HintRegistry(lease_s=10, max_workflows=3)
    reg.update("w1", {"a": 1}, now=0)
    reg.update("w2", {"a": 1}, now=1)
    reg.update("w3", {"a": 1}, now=5)
    reg.update("w1", {"a": 2}, now=6)     # w1 hinted again: w2 is now the oldest live
    reg.update("w4", {"a": 1}, now=7)
    assert set(reg.workflows) == {"w1", "w3", "w4"} and reg.drain_removed() == ["w2"]
    reg.expire(16)                        # w3 expires (last hint 5)
    reg.update("w5", {"a": 1}, now=16.5)  # an expired one goes before any live one
    assert set(reg.workflows) == {"w1", "w4", "w5"} and reg.drain_removed() == ["w3"]
    assert reg.counters["evicted"] == 2


def test_agents_per_workflow_and_in_all_are_bounded():
    reg = HintRegistry(max_agents_per_workflow=4, max_agents=6)
    reg.update("w", {"a": 0, "b": 1, "c": None}, now=0)
    changed, _ = reg.update("w", {"d": 2, "e": 3}, now=1)
    # over 4: the unreachable agent goes first, then the farthest not in this hint
    assert set(reg.workflows["w"].ste) == {"a", "b", "d", "e"}
    assert changed["c"] == INF and reg.num_agents == 4
    reg.update("v", {"x": 0, "y": 0, "z": 0}, now=2)  # 7 agents in all > 6: the oldest quiet goes
    assert "w" not in reg.workflows and reg.num_agents == 3
    assert reg.drain_removed() == ["w"]


def test_manager_drops_the_tags_of_removed_workflows():
    mgr = KVCacheManager("kvflow", page_size=4, device_pages=64, host_pages=64, lease_s=1.0)
    toks = list(range(32))
    pages = mgr.allocate(8)
    mgr.insert(toks, pages)
    mgr.update_hints("w", {"a": 0, "b": 1}, now=0.0)
    mgr.tag_fixed_prefix(toks, 16, "w", "a")
    assert [a["workflow"] for a in mgr.snapshot()["agents"]] == ["w"]
    mgr.tick(now=1.5)                      # lease over: expired, still listed, +inf
    snap = mgr.snapshot()
    assert snap["workflows"]["w"]["expired"] and snap["agents"][0]["ste"] is None
    mgr.tick(now=2.6)                      # one more lease: forgotten, tags dropped
    snap = mgr.snapshot()
    assert snap["workflows"] == {} and snap["agents"] == []
    assert mgr.hints.num_agents == 0
    mgr.check_invariants()


def test_metrics_show_hint_state_returning_to_zero(rserve):
    with rserve(lease_s=3.0, forget_after_s=0.5) as srv, srv.http() as h:
        for i in range(20):
            r = h.post("/kvflow/v1/hints", json={
                "kvflow_v": 1, "kvflow_workflow": f"w{i}", "kvflow_agent": "a",
                "kvflow_ste": {f"agent-{j}": j for j in range(50)}})
            assert r.status_code == 200

        def gauge(name: str) -> float:
            text = h.get("/metrics").text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(name) and line[len(name)] in "{ ")
        peak, deadline = 0.0, time.monotonic() + 30
        while time.monotonic() < deadline:
            agents = gauge("kvflow_hint_agents")
            peak = max(peak, agents)
            if peak and agents == 0:
                break
            time.sleep(0.1)
        assert peak == 20 * 50  # all live at once, then every one forgotten
        assert gauge("kvflow_hint_workflows") == 0 and gauge("kvflow_hint_agents") == 0
        assert gauge('kvflow_hint_workflows_removed_total{reason="forgotten"}') == 20
        assert h.get("/kvflow/v1/cache").json()["workflows"] == []
