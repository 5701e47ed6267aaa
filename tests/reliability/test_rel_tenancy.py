"""Tenant isolation (issue #17, reproducers 6 and 7): a tenant is the API key (or a declared
header under a shared key); workflows are namespaced per tenant, so another tenant can neither
read, end nor alter them; the per-tenant cap of the policy core is a fair share by default."""

from __future__ import annotations

import time

import pytest

from kvflow_agents.serving.tenancy import Tenancy, TenantError, scope_hints, visible_key

KEYS = {"alice": "key-a", "bob": "key-b"}
SYSTEM = "You are the planner. " * 12


def call(h, workflow: str, agent: str = "planner", ste=None, app=None):
    params = {"kvflow_v": 1, "kvflow_workflow": workflow, "kvflow_agent": agent,
              "kvflow_ste": ste or {agent: 0, "coder": 1}, "kvflow_fixed_messages": 1}
    if app:
        params["kvflow_app"] = app
    r = h.post("/v1/chat/completions", json={
        "model": "tiny-random", "max_tokens": 2, "temperature": 0, "custom_params": params,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]})
    assert r.status_code == 200 and r.headers["x-kvflow-hints"] == "accepted", r.text
    return r


def agents(h) -> dict:
    return {(w["workflow"], a["agent"]): a["ste"] for w in h.get("/kvflow/v1/cache").json()["workflows"]
            for a in w["agents"]}


def test_tenants_cannot_read_end_or_alter_each_other(rserve):
    with rserve(api_key=KEYS) as srv:
        alice = srv.http(headers={"Authorization": "Bearer key-a"})
        bob = srv.http(headers={"Authorization": "Bearer key-b"})
        call(alice, "w1")
        call(alice, "w2", app="peer")
        assert agents(alice) == {("w1", "planner"): 0, ("peer/w2", "planner"): 0}
        assert agents(bob) == {}  # alice's ids, apps and agents are not bob's to see
        assert "w1" not in bob.get("/kvflow/v1/cache", params={"format": "text"}).text
        # bob ends / nulls "w1" and "peer/w2": he names his own workflows, not alice's
        for body in ({"kvflow_workflow": "w1", "kvflow_event": "end"},
                     {"kvflow_workflow": "w1", "kvflow_ste": {"planner": None}},
                     {"kvflow_workflow": "w2", "kvflow_app": "peer", "kvflow_event": "end"},
                     {"kvflow_workflow": "w2", "kvflow_app": "peer", "kvflow_ste": {"planner": None}}):
            r = bob.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_agent": "x", **body})
            assert r.status_code == 200
        time.sleep(0.3)  # out-of-band hints are applied between engine steps
        assert agents(alice) == {("w1", "planner"): 0, ("peer/w2", "planner"): 0}
        # alice can end her own
        alice.post("/kvflow/v1/hints", json={"kvflow_v": 1, "kvflow_workflow": "w1",
                                             "kvflow_agent": "x", "kvflow_event": "end"})
        time.sleep(0.3)
        assert agents(alice) == {("peer/w2", "planner"): 0}
        # operator endpoints act on every tenant's cache: closed on a shared server
        assert bob.post("/flush_cache").status_code == 403
        assert bob.post("/kvflow/v1/drain").status_code == 403
        assert agents(alice) == {("peer/w2", "planner"): 0}
        # a hint-only completion (the gateway's out-of-band form) is scoped like the rest
        r = bob.post("/v1/completions", json={"model": "tiny-random", "prompt": "", "max_tokens": 1,
                                              "custom_params": {"kvflow_v": 1, "kvflow_workflow": "w2",
                                                                "kvflow_app": "peer", "kvflow_agent": "x",
                                                                "kvflow_event": "end"}})
        assert r.status_code == 200 and r.json()["kvflow"]["event"] == "end"
        time.sleep(0.3)
        assert agents(alice) == {("peer/w2", "planner"): 0}
        for h in (alice, bob):
            h.close()
        with srv.http() as anon:
            assert anon.get("/kvflow/v1/cache").status_code == 401
            assert anon.get("/kvflow/v1/cache", headers={"x-api-key": "key-c"}).status_code == 401


def test_declared_tenant_header_splits_a_shared_key(rserve):
    with rserve(api_key="shared", tenant_header="x-kvflow-tenant") as srv:
        t1 = srv.http(headers={"Authorization": "Bearer shared", "x-kvflow-tenant": "team-1"})
        t2 = srv.http(headers={"Authorization": "Bearer shared", "x-kvflow-tenant": "team-2"})
        call(t1, "w")
        assert agents(t1) == {("w", "planner"): 0} and agents(t2) == {}
        r = t1.get("/kvflow/v1/cache", headers={"x-kvflow-tenant": "no spaces allowed"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-kvflow-tenant"
        t1.close()
        t2.close()


def test_fair_share_caps_a_tenant_only_when_others_are_active(rserve):
    with rserve(api_key=KEYS, device_tokens=4096, lease_s=1.0) as srv:
        alice = srv.http(headers={"Authorization": "Bearer key-a"})
        bob = srv.http(headers={"Authorization": "Bearer key-b"})
        mgr = srv.engine.manager
        call(alice, "w1")
        assert srv.engine.call(lambda e: e.manager.tags.client_cap_pages) is None  # one tenant: no cap
        call(bob, "w1")
        assert srv.engine.call(lambda e: e.manager.tags.client_cap_pages) == mgr.device.capacity // 2
        deadline = time.monotonic() + 10  # both leases lapse: back to no cap
        while srv.engine.call(lambda e: e.manager.tags.client_cap_pages) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        alice.close()
        bob.close()


def test_tenancy_unit_rules():
    t = Tenancy.from_options({"alice": "ka"}, tenant_header="X-Sub")
    assert t.authenticate({"authorization": "Bearer ka"}) == "alice+default"
    assert t.authenticate({"x-api-key": "ka", "x-sub": "s1"}) == "alice+s1"
    with pytest.raises(TenantError):
        t.authenticate({"authorization": "Bearer kb"})
    assert Tenancy.from_options(None).authenticate({}) is None  # single-tenant: no namespace
    with pytest.raises(ValueError):
        Tenancy({"a:b": "k"})
    with pytest.raises(ValueError):
        Tenancy({"a": "k", "b": "k"})
    from kvflow_agents.protocol import Hints
    h = Hints(workflow="w", agent="a")
    assert scope_hints(h, "t").workflow == "t::w" and scope_hints(h, None) is h
    ha = Hints(workflow="w", agent="a", app="peer")
    assert scope_hints(ha, "t").app == "t::peer" and scope_hints(ha, "t").workflow == "w"
    assert visible_key("t::peer/w", "t") == "peer/w" and visible_key("u::w", "t") is None
