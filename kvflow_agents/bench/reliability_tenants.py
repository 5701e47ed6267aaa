"""The tenant rows of ``kvflow bench reliability`` (:mod:`.reliability`): another tenant's
attempts to read or change one tenant's state, and a quiet tenant's device hits while another
floods the server (fair share on, and off for comparison)."""

from __future__ import annotations

import asyncio
import math
from typing import Callable

from kvflow_agents.protocol import Hints, hint_only_completion

from .reliability_base import Plan, Row, client
from .reliability_corpus import TINY, chat_body, hint
from .server import BenchServer


class TenantRows:
    """Mixed into :class:`.reliability.Suite`, whose plan, servers and progress hook it uses."""

    plan: Plan
    progress: Callable[[str, int], None]
    server: Callable[..., BenchServer]

    async def cross_tenant(self, srv: BenchServer) -> Row:
        secret_wf, secret_app = "alpha-secret-workflow", "alpha-secret-app"
        private = "alpha-private-workflow-7f3e"  # bob never names this one: seeing it is a leak
        system = "You are the alpha planner with a private prompt. " * 6
        async with client(srv, "alice") as a, \
                client(srv, "bob") as b:
            async def alice_state() -> dict:
                rep = (await a.get("/kvflow/v1/cache")).json()
                return {(w["workflow"], x["agent"]): x["ste"] for w in rep["workflows"] for x in w["agents"]}

            async def refresh() -> None:
                for wf, app in ((secret_wf, None), ("w2", secret_app), (private, None)):
                    params = hint(wf, "planner", {"planner": 0, "coder": 1}, kvflow_fixed_messages=1)
                    if app:
                        params["kvflow_app"] = app
                    r = await a.post("/v1/chat/completions", json=chat_body("go", system=system, custom_params=params))
                    assert r.status_code == 200
            attempts = [
                ("GET", "/kvflow/v1/cache", None, {}), ("GET", "/kvflow/v1/cache?format=text", None, {}),
                ("GET", "/metrics", None, {}),
                ("POST", "/kvflow/v1/hints", hint(secret_wf, "x", {}, kvflow_event="end"), {}),
                ("POST", "/kvflow/v1/hints", hint(secret_wf, "x", {"planner": None, "coder": None}), {}),
                ("POST", "/kvflow/v1/hints", hint("w2", "x", {}, kvflow_app=secret_app, kvflow_event="end"), {}),
                ("POST", "/kvflow/v1/hints", hint("w2", "x", {"planner": None}, kvflow_app=secret_app), {}),
                ("POST", "/kvflow/v1/hints", hint(f"alice::{secret_wf}", "x", {}, kvflow_event="end"), {}),
                ("POST", "/kvflow/v1/hints", hint(secret_wf, "x", {}, kvflow_app="alice::", kvflow_event="end"), {}),
                ("POST", "/kvflow/v1/hints", hint(secret_wf, "x", {"planner": None}), {"x-kvflow-tenant": "alice"}),
                ("POST", "/v1/chat/completions",
                 chat_body("hi", custom_params=hint(secret_wf, "planner", {"planner": None, "coder": None})), {}),
                ("POST", "/v1/chat/completions", chat_body("hi"),
                 {"X-KVFlow-Workflow": secret_wf, "X-KVFlow-Agent": "coder"}),
                ("POST", "/v1/completions", {**hint_only_completion(Hints(workflow=secret_wf, agent="x"), "end"),
                                             "model": TINY}, {}),
                ("POST", "/flush_cache", None, {}),       # operator endpoints: every tenant's cache
                ("POST", "/kvflow/v1/drain", None, {}),
            ]
            successes, tried, examples = 0, 0, []
            secrets = (private, "alpha planner")
            for i in range(self.plan.cross_tenant):
                method, path, body, hdrs = attempts[i % len(attempts)]
                await refresh()  # alice's lease runs from here: her state is only bob's to change
                expected = await alice_state()
                r = await b.request(method, path, json=body, headers=hdrs)
                tried += 1
                leaked = any(s in r.text for s in secrets)
                await asyncio.sleep(0.05)
                changed = (await alice_state()) != expected
                if path in ("/flush_cache", "/kvflow/v1/drain"):
                    changed |= r.status_code < 400
                    await a.delete("/kvflow/v1/drain")
                if leaked or changed:
                    successes += 1
                    examples.append(f"{method} {path} {body}: leaked={leaked} changed={changed}")
                self.progress("advance:cross-tenant", 1)
        return Row("cross-tenant attempts (read / end / null / spoof)", tried, successes,
                   f"{successes} succeeded", {"examples": examples[:5]})

    async def _quiet_share(self, srv: BenchServer, flood: bool) -> tuple[float, dict]:
        """Device-hit share of the quiet tenant's cycle of 3 agents (fixed prompts), alone or
        while the flood tenant runs ``flood_workflows`` workflows at STE 0 and floods hints."""
        p = self.plan
        agents = ["plan", "code", "review"]
        prompts = {a: f"[{a}] You are the {a} agent of the quiet team. Rule {a}. " * 4 for a in agents}
        stop = asyncio.Event()
        stats = {"flood_requests": 0, "flood_posts": 0, "quiet_errors": 0}
        async with client(srv, "quiet", timeout=120) as q, \
                client(srv, "flood", timeout=120) as f:
            async def flood_requests() -> None:
                i = 0
                while not stop.is_set():
                    wf = f"flood-{i % p.flood_workflows}"
                    params = hint(wf, "hog", {"hog": 0}, kvflow_fixed_messages=1)
                    await f.post("/v1/chat/completions", json=chat_body(
                        f"{i}", max_tokens=2, system=f"[flood {wf}] Hog the cache. " * 20, custom_params=params))
                    stats["flood_requests"] += 1
                    i += 1

            async def flood_hints() -> None:
                i = 0
                while not stop.is_set() and stats["flood_posts"] < p.flood_posts:
                    wf = f"flood-{i % p.flood_workflows}"
                    await f.post("/kvflow/v1/hints", json=hint(wf, "tool", {"hog": 0, **{f"x{j}": 0 for j in range(40)}}))
                    stats["flood_posts"] += 1
                    i += 1
                    await asyncio.sleep(0.005)
            tasks = [asyncio.create_task(t()) for t in (flood_requests, flood_hints)] if flood else []
            if flood:
                await asyncio.sleep(2.0)  # let the flood fill the cache first
            dev = total = 0
            for rnd in range(p.flood_rounds):
                for k, a in enumerate(agents):
                    ste = {b: (j - k) % len(agents) for j, b in enumerate(agents)}
                    r = await q.post("/v1/chat/completions", json=chat_body(
                        f"round {rnd} step {k}", system=prompts[a],
                        custom_params=hint("quiet-wf", a, ste, kvflow_step=3 * rnd + k, kvflow_fixed_messages=1)))
                    if r.status_code != 200:
                        stats["quiet_errors"] += 1
                        continue
                    u = r.json()["usage"]
                    if rnd > 0:  # round 0 fills the cache
                        dev += u["kvflow"]["device_hit_tokens"]
                        total += u["prompt_tokens"]
                    await asyncio.sleep(0.05)  # the quiet tenant is quiet
                self.progress("advance:flood vs quiet", 1)
            stop.set()
            for t in tasks:
                await t
        return (dev / total if total else math.nan), stats

    def flood(self) -> Row:
        p = self.plan
        base = ("--lease-s", "30",)
        shares: dict[str, float] = {}
        stats: dict = {}
        runs = [("alone", (), False), ("flood, fair share", (), True)]
        if p.flood_baseline:
            runs.append(("flood, --client-cap off", ("--client-cap", "off"), True))
        for label, extra, flood in runs:
            srv = self.server(*base, *extra).start()
            try:
                shares[label], stats[label] = asyncio.run(self._quiet_share(srv, flood))
            finally:
                srv.stop()
        ratio = shares["flood, fair share"] / shares["alone"] if shares["alone"] else math.nan
        fig = f"quiet device-hit share {shares['alone']:.2f} alone, {shares['flood, fair share']:.2f} " \
              f"under flood = {ratio:.2f}x (target >= 0.9)"
        if "flood, --client-cap off" in shares:
            fig += f"; without the cap {shares['flood, --client-cap off']:.2f}"
        return Row("flood vs quiet tenant", p.flood_rounds * 3 * len(runs), sum(s["quiet_errors"] for s in stats.values()),
                   fig, {"shares": shares, "ratio": ratio, "flood": stats}, target=ratio >= 0.9)
