"""``kvflow bench reliability``: the fault suite of the bundled server, with its figures.

Everything runs against real ``kvflow serve`` processes on 127.0.0.1 (tiny-random, smollm2 for the
tokenizing and determinism rows of the full run), with bounded, seeded counts, and prints one
row per check: how many cases were tried, how many failed, and the figure the check measures.

| row | what it does | fails when |
|---|---|---|
| fuzz | >= 5,000 seeded cases: malformed hints on valid requests (body and headers), out-of-band hints, mutated bodies (types, nesting, encodings, sizes), stream or not | a connection drops, a 5xx, a valid request not 200, the server dies |
| isolation | rounds of 4 valid requests batched with 1 poisoned one (seed overflow, lone surrogate, deep JSON, oversized, bad types) | a valid neighbour does not get its full answer |
| health | ``/health`` probed every 20 ms while maximum-size requests are tokenized | a probe takes > 100 ms |
| disconnects | streams and non-streams abandoned mid-way | request-owned KV pages left afterwards |
| slow clients | slowloris heads, trickled bodies, idle sockets, next to normal traffic | one is not closed in time, or normal traffic fails |
| hint memory | rounds of out-of-band posts with 1,024 agents each, then leases expire | the registry is not empty after, or RSS grows from round to round |
| flood vs quiet | a quiet tenant's device-hit share alone and while another floods (fair share on; off for comparison) | share under flood < 0.9 x alone |
| cross-tenant | another tenant reads, ends, nulls, spoofs ids/headers | any attempt succeeds |
| soak | W workflows cycling for S seconds, RSS sampled | requests fail, or RSS in the last quarter grows more than a fifth of the first quarter's growth (and more than 8 MB) |
| kill -9 | the server is killed mid-load and restarted on its port | a request fails after the restart |
| determinism | greedy outputs alone vs batched, default and ``--deterministic`` | the deterministic run differs |

The requests it sends and the seeded fuzz corpus: :mod:`.reliability_corpus`; the plan, rows and
helpers: :mod:`.reliability_base`; the tenant rows (cross-tenant, flood vs quiet):
:mod:`.reliability_tenants`.

``--quick`` runs every row with small counts (seconds; ``make test`` runs it through
``tests/reliability``); the full run is ``kvflow bench reliability`` (README "Reliability").
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import httpx

from .reliability_base import (HEALTH_BUDGET_S, Plan, Row, auth, client, keys_file, metric,
                               rss_mb, sse_ok)
from .reliability_corpus import TINY, Case, chat_body, dumps, fuzz_cases, hint
from .reliability_tenants import TenantRows
from .server import BenchServer

__all__ = ["Plan", "Row", "Suite", "to_json", "table", "markdown", "plot"]


# ================================================================ the suite
class Suite(TenantRows):
    def __init__(self, plan: Plan, *, seed: int = 0, log: Callable[[str], None] = print,
                 progress: Optional[Callable[[str, int], None]] = None) -> None:
        self.plan, self.seed, self.log = plan, seed, log
        self._hook = progress or (lambda event, n: None)
        self._advanced: dict[str, int] = {}
        self.keys_path: Optional[str] = None  # written by the first server(), removed by run()
        self.rows: list[Row] = []
        self.series: dict[str, list] = {}

    def server(self, *extra: str, model: str = TINY) -> BenchServer:
        if self.keys_path is None:
            self.keys_path = keys_file()
        args = ["--model", model, "--policy", "kvflow", "--device-tokens", "4096", "--host-tokens",
                "16384", "--log-level", "warning", "--api-keys-file", self.keys_path, *extra]
        return BenchServer(args, health_headers=auth("alice"), timeout_s=180)

    def run(self) -> list[Row]:
        p = self.plan
        try:
            main = self.server("--lease-s", str(p.lease_s), "--timeout-headers", "2",
                               "--timeout-read", "2").start()
            try:
                self._step("fuzz", p.fuzz_cases, lambda: self.fuzz(main))
                self._step("isolation", p.isolation_rounds, lambda: self.isolation(main))
                if p.health_model == TINY:
                    self._step("health", p.health_requests, lambda: self.health(main, TINY, 4096))
                self._step("disconnects", p.disconnects, lambda: self.disconnects(main))
                self._step("slow clients", 3 * p.slow_clients, lambda: self.slow_clients(main))
                self._step("cross-tenant", p.cross_tenant, lambda: self.cross_tenant(main))
                self._step("hint memory", p.hint_rounds, lambda: self.hint_memory(main))
                self._step("soak", p.soak_workflows, lambda: self.soak(main))
                self._step("kill -9", p.restarts, lambda: self.kill_restart(main))
            finally:
                main.stop()
            if p.health_model != TINY:
                srv = self.server("--device-tokens", "8192", model=p.health_model).start()
                try:
                    self._step("health", p.health_requests, lambda: self.health(srv, p.health_model, 8192))
                finally:
                    srv.stop()
            self._step("flood vs quiet", p.flood_rounds * (3 if p.flood_baseline else 2), self.flood)
            self._step("determinism", p.det_prompts, self.determinism)
        finally:
            self.close()
        return self.rows

    def close(self) -> None:
        if self.keys_path is not None:
            try:
                os.unlink(self.keys_path)
            except OSError:
                pass
            self.keys_path = None

    def progress(self, event: str, n: int) -> None:
        """Progress hook of the CLI: ``start:<row>`` (total), ``advance:<row>`` (done so far)."""
        kind, _, name = event.partition(":")
        if kind == "advance":
            self._advanced[name] = self._advanced.get(name, 0) + n
        self._hook(event, n)

    def _step(self, name: str, n: int, fn: Callable) -> None:
        self.progress(f"start:{name}", n)
        t0 = time.perf_counter()
        out = fn()
        row = asyncio.run(out) if asyncio.iscoroutine(out) else out
        row.detail["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(row)
        rest = n - self._advanced.get(name, 0)
        if rest > 0:
            self.progress(f"advance:{name}", rest)
        self.log(f"{row.name}: tried {row.tried}, failed {row.failed} -- {row.figure}")

    # ------------------------------------------------------------ fuzz
    async def fuzz(self, srv: BenchServer) -> Row:
        cases = fuzz_cases(self.seed, self.plan.fuzz_cases)
        stats = {"dropped": 0, "5xx": 0, "valid_failed": 0, "crashes": 0, "bad_header": 0}
        by_status: dict[int, int] = {}
        examples: list[str] = []
        sem = asyncio.Semaphore(8)
        limits = httpx.Limits(max_connections=16)
        async with client(srv, "fuzz", limits=limits, headers={"content-type": "application/json"}) as c:
            async def one(i: int, case: Case) -> None:
                async with sem:
                    try:
                        r = await c.post(case.path, content=case.body, headers=case.headers)
                    except httpx.TransportError as e:
                        stats["dropped"] += 1
                        examples.append(f"#{i} {case.kind}: dropped ({type(e).__name__})")
                        return
                    by_status[r.status_code] = by_status.get(r.status_code, 0) + 1
                    if r.status_code >= 500:
                        stats["5xx"] += 1
                        examples.append(f"#{i} {case.kind}: {r.status_code} {r.text[:120]}")
                    ok = r.status_code == 200 and (not case.stream or sse_ok(r.text))
                    if case.valid and not ok:
                        stats["valid_failed"] += 1
                        examples.append(f"#{i} {case.kind}: valid but {r.status_code} {r.text[:120]}")
                    v = r.headers.get("x-kvflow-hints")
                    if v is not None and (v != v.strip() or not v.isascii()):
                        stats["bad_header"] += 1
                    if (i + 1) % 100 == 0:
                        self.progress("advance:fuzz", 100)
            for start in range(0, len(cases), 400):
                await asyncio.gather(*(one(i, cs) for i, cs in enumerate(cases[start:start + 400], start)))
                if srv.proc is None or srv.proc.poll() is not None:
                    stats["crashes"] += 1
                    break
        failed = sum(stats.values())
        return Row("fuzz: hints + bodies", len(cases), failed,
                   f"{stats['crashes']} crashes, {stats['dropped']} dropped, {stats['5xx']} 5xx, "
                   f"{stats['valid_failed']} valid failed (seed {self.seed})",
                   {**stats, "by_status": dict(sorted(by_status.items())), "examples": examples[:10],
                    "valid_cases": sum(c.valid for c in cases)})

    # ------------------------------------------------------------ isolation
    async def isolation(self, srv: BenchServer) -> Row:
        poisons = [chat_body("p", seed=2**64), dumps(chat_body("a\ud800")),
                   b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "z": '
                   + b"[" * 5000 + b"]" * 5000 + b"}", chat_body("q" * 500_000), chat_body("x", max_tokens=2**40),
                   chat_body("x", temperature="0"), chat_body("x", n=3), chat_body("x", stop=["s"] * 50),
                   chat_body("x", logprobs=True), chat_body("x", custom_params=hint("w\ud800", "a", {}))]
        bad, tried, statuses = 0, 0, {}
        async with client(srv, "alice", timeout=120) as c:
            for rnd in range(self.plan.isolation_rounds):
                poison = poisons[rnd % len(poisons)]
                content = poison if isinstance(poison, bytes) else dumps(poison)
                valid = [c.post("/v1/chat/completions", json=chat_body(f"round {rnd} n {k}", max_tokens=8,
                                                                         ignore_eos=True)) for k in range(4)]
                res = await asyncio.gather(*valid, c.post("/v1/chat/completions", content=content,
                                                           headers={"content-type": "application/json"}),
                                           return_exceptions=True)
                for r in res[:4]:
                    tried += 1
                    if isinstance(r, Exception) or r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 8:
                        bad += 1
                p = res[4]
                s = "dropped" if isinstance(p, Exception) else p.status_code
                statuses[str(s)] = statuses.get(str(s), 0) + 1
                self.progress("advance:isolation", 1)
        return Row("isolation: 4 valid + 1 poisoned, batched", tried, bad,
                   f"{bad} valid requests failed beside a poisoned one; poisoned got {statuses}",
                   {"poison_statuses": statuses})

    # ------------------------------------------------------------ /health while tokenizing
    async def health(self, srv: BenchServer, model: str, device_tokens: int) -> Row:
        from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

        if model == TINY:
            tok = ChatTokenizer.byte_level()
        else:
            from kvflow_agents.serving.embedded.model.gguf_loader import ensure_converted
            tok = ChatTokenizer.from_dir(ensure_converted())
        limit = device_tokens - 1
        vocab = tok.tokenizer.get_vocab(with_added_tokens=False)
        dense = next(t for t in (tok.decode([i]) for _, i in sorted(
            ((-len(w), i) for w, i in vocab.items()))) if t and tok.encode(t * 2) == tok.encode(t) * 2)

        def sized(unit: str, tokens: int) -> str:  # ~``tokens`` tokens of repeated ``unit``
            per = len(tok.encode(unit * 64)) / 64
            return unit * int(tokens / per)
        big = [
            ("max tokens, prose", sized("The quick brown fox jumps over the lazy dog. ", limit - 64)),
            ("max characters (densest token)", sized(dense, limit - 64)),
            ("max body, over the limit", "lorem ipsum " * (7 * 1024 * 1024 // 12)),
        ]
        probes: list[tuple[float, float]] = []   # (start, latency), perf_counter seconds
        windows: list[tuple[float, float]] = []  # (sent, response started) of each big request
        statuses = []
        stop = threading.Event()
        probe_errors = [0]

        def probe() -> None:  # its own thread and connection: the sender's work is not counted
            with client(srv, "alice", timeout=30, sync=True) as h:
                h.get("/health")
                while not stop.is_set():
                    t0 = time.perf_counter()
                    try:
                        ok = h.get("/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    probes.append((t0, time.perf_counter() - t0))
                    probe_errors[0] += not ok
                    time.sleep(0.02)
        bodies = [(label, len(text), json.dumps(chat_body(text, model=model, max_tokens=1, stream=True)).encode())
                  for label, text in big]
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            async with client(srv, "alice", timeout=300) as c:
                async def idle() -> None:  # the previous request's prefill is over
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        q = (await c.get("/kvflow/v1/cache")).json()["queue"]
                        if not any(q.values()):
                            return
                        await asyncio.sleep(0.2)
                await asyncio.sleep(0.3)
                for _ in range(self.plan.health_requests):
                    for label, chars, body in bodies:
                        await idle()
                        await asyncio.sleep(0.2)
                        # streamed: the response starts once the prompt is parsed and tokenized;
                        # then the client leaves (its prefill is aborted, not waited for)
                        t0 = time.perf_counter()
                        try:
                            async with c.stream("POST", "/v1/chat/completions", content=body,
                                                headers={"content-type": "application/json"}) as r:
                                code = r.status_code
                        except httpx.TransportError:
                            code = None
                        t1 = time.perf_counter()
                        windows.append((t0, t1))
                        statuses.append((label, chars, code, round(t1 - t0, 2)))
                    self.progress("advance:health", 1)
                await idle()
        finally:
            stop.set()
            prober.join(10)
        during = [lt for st, lt in probes if any(st < b and st + lt > a for a, b in windows)]
        others = [lt for st, lt in probes if not any(st < b and st + lt > a for a, b in windows)]
        slow = sum(x > HEALTH_BUDGET_S for x in during)
        unanswered = sum(st[2] is None or st[2] >= 500 for st in statuses) + probe_errors[0]

        def pct(xs: list, q: float) -> float:
            return sorted(xs)[int(q * (len(xs) - 1))] * 1000 if xs else math.nan
        return Row(f"/health while max-size requests are tokenized ({model})", len(probes), unanswered,
                   f"while parsing + tokenizing ({len(during)} probes): p50 {pct(during, 0.5):.1f}, max "
                   f"{pct(during, 1):.1f} ms (budget {HEALTH_BUDGET_S * 1000:.0f}); otherwise, incl. the "
                   f"{limit}-token prefills that follow: p99 {pct(others, 0.99):.1f} ms",
                   {"requests": statuses, "during_max_ms": round(pct(during, 1), 1),
                    "others_p99_ms": round(pct(others, 0.99), 1), "over_budget": slow},
                   target=slow == 0)

    # ------------------------------------------------------------ disconnects
    async def disconnects(self, srv: BenchServer) -> Row:
        n = self.plan.disconnects
        errors = 0
        async with client(srv, "alice") as c:
            async def abandon(i: int) -> None:
                nonlocal errors
                body = chat_body(f"disconnect {i} " * 8, max_tokens=200, ignore_eos=True, stream=i % 2 == 0)
                try:
                    if i % 2 == 0:
                        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            async for _ in r.aiter_lines():
                                break  # first event, then go away
                    else:
                        await c.post("/v1/chat/completions", json=body, timeout=0.05 + (i % 5) * 0.05)
                except httpx.TimeoutException:
                    pass
                except httpx.TransportError:
                    errors += 1
            for start in range(0, n, 16):
                await asyncio.gather(*(abandon(i) for i in range(start, min(n, start + 16))))
                self.progress("advance:disconnects", min(16, n - start))
            leaked, deadline = None, time.monotonic() + 30
            while time.monotonic() < deadline:
                rep = (await c.get("/kvflow/v1/cache")).json()
                q, dev = rep["queue"], rep["pools"]["device"]
                leaked = dev["used_tokens"] - dev["tree_tokens"]
                if q["running"] == q["waiting"] == q["loading"] == 0 and leaked == 0:
                    break
                await asyncio.sleep(0.2)
            after = await c.post("/v1/chat/completions", json=chat_body("after"))
        failed = int(bool(leaked)) + errors + int(after.status_code != 200)
        return Row("disconnects (stream + non-stream)", n, failed,
                   f"request-owned KV left after: {leaked} tokens; queue {rep['queue']}",
                   {"leaked_tokens": leaked, "transport_errors": errors})

    # ------------------------------------------------------------ slow clients
    async def slow_clients(self, srv: BenchServer) -> Row:
        k = self.plan.slow_clients
        socks = []
        for i in range(k):
            s = socket.create_connection((srv.host, srv.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(("head", s))
            s = socket.create_connection((srv.host, srv.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\"")
            socks.append(("body", s))
            socks.append(("idle", socket.create_connection((srv.host, srv.port))))
        t0 = time.monotonic()
        ok_normal = 0
        async with client(srv, "alice") as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat_body(f"normal {i}"))
                                        for i in range(20)), return_exceptions=True)
            ok_normal = sum(not isinstance(r, Exception) and r.status_code == 200 for r in rs)

        def closed_in(s: socket.socket, budget: float) -> Optional[float]:
            s.settimeout(budget)
            try:
                while True:  # trickle a byte now and then, as a slow client does
                    data = s.recv(4096)
                    if not data or b"HTTP/1.1 408" in data:
                        return time.monotonic() - t0
            except OSError:
                return None
        closed = await asyncio.gather(*(asyncio.to_thread(closed_in, s, 10.0) for _, s in socks))
        for _, s in socks:
            s.close()
        not_closed = sum(x is None for x in closed)
        worst = max((x for x in closed if x is not None), default=math.nan)
        return Row("slow clients (slowloris, slow body, idle)", len(socks) + 20, not_closed + (20 - ok_normal),
                   f"{len(socks) - not_closed}/{len(socks)} cut off (last after {worst:.1f} s; timeouts 2 s); "
                   f"{ok_normal}/20 normal requests served meanwhile", {"not_closed": not_closed})

    # ------------------------------------------------------------ hint memory
    async def hint_memory(self, srv: BenchServer) -> Row:
        p = self.plan
        pid = srv.proc.pid
        rounds = []
        async with client(srv, "alice", timeout=120) as c:
            async def registry() -> tuple[float, float]:
                t = (await c.get("/metrics")).text
                return metric(t, "kvflow_hint_workflows"), metric(t, "kvflow_hint_agents")
            base = rss_mb(pid)
            sem = asyncio.Semaphore(4)
            for rnd in range(p.hint_rounds):
                peak_agents = 0.0

                async def post(i: int) -> None:
                    async with sem:
                        await c.post("/kvflow/v1/hints", json=hint(
                            f"mem-{rnd}-{i}", "a", {f"agent-{rnd}-{i}-{j}": j % 50 for j in range(p.hint_agents)}))
                peak_rss = base
                for start in range(0, p.hint_posts, 100):
                    await asyncio.gather(*(post(i) for i in range(start, min(p.hint_posts, start + 100))))
                    peak_rss = max(peak_rss, rss_mb(pid))
                    peak_agents = max(peak_agents, (await registry())[1])
                deadline = time.monotonic() + 60  # lease 3 s + forget 3 s
                while (await registry())[0] > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                wfs, agents = await registry()
                rounds.append({"peak_rss_mb": round(peak_rss, 1), "after_rss_mb": round(rss_mb(pid), 1),
                               "peak_agents": peak_agents, "left_workflows": wfs, "left_agents": agents})
                self.progress("advance:hint memory", 1)
        self.series["hint_rounds"] = rounds
        left = sum(r["left_workflows"] + r["left_agents"] for r in rounds)
        growth = rounds[-1]["after_rss_mb"] - rounds[0]["after_rss_mb"]
        flat = len(rounds) < 2 or growth <= max(16.0, 0.05 * rounds[0]["after_rss_mb"])
        return Row("hint memory (out-of-band posts, leases expire)", p.hint_rounds * p.hint_posts,
                   int(left > 0),
                   f"RSS {base:.0f} MB -> peak {max(r['peak_rss_mb'] for r in rounds):.0f} -> after each round "
                   f"{', '.join(str(r['after_rss_mb']) for r in rounds)} MB; registry peak "
                   f"{max(r['peak_agents'] for r in rounds):.0f} agents, after {left:.0f}",
                   {"rounds": rounds, "baseline_rss_mb": round(base, 1)}, target=flat)

    # ------------------------------------------------------------ soak
    async def soak(self, srv: BenchServer) -> Row:
        p = self.plan
        pid = srv.proc.pid
        agents = ["a0", "a1", "a2"]
        samples: list[tuple[float, float]] = []
        errors = requests = 0
        stop = asyncio.Event()
        t0 = time.monotonic()
        async with client(srv, "bob", timeout=120) as c:
            async def workflow(w: int) -> None:
                nonlocal errors, requests
                step = 0
                while not stop.is_set():
                    a = agents[step % 3]
                    ste = {b: (j - step) % 3 for j, b in enumerate(agents)}
                    try:
                        r = await c.post("/v1/chat/completions", json=chat_body(
                            f"w{w} s{step}", max_tokens=4, system=f"[{a}] agent {a} of workflow {w % 16}. " * 6,
                            custom_params=hint(f"soak-{w}", a, ste, kvflow_step=step, kvflow_fixed_messages=1)))
                        errors += r.status_code != 200
                    except httpx.HTTPError:
                        errors += 1
                    requests += 1
                    step += 1

            async def sampler() -> None:
                while not stop.is_set():
                    samples.append((time.monotonic() - t0, rss_mb(pid)))
                    await asyncio.sleep(max(0.5, p.soak_s / 60))
            tasks = [asyncio.create_task(workflow(w)) for w in range(p.soak_workflows)]
            tasks.append(asyncio.create_task(sampler()))
            while time.monotonic() - t0 < p.soak_s:
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
        samples.append((time.monotonic() - t0, rss_mb(pid)))
        self.series["soak_rss"] = samples
        self.progress("advance:soak", p.soak_workflows)
        n = len(samples)
        first, mid, last = samples[0][1], samples[n // 2][1], samples[-1][1]
        q1, q3 = samples[n // 4][1], samples[3 * n // 4][1]
        peak_t = next(t for t, r in samples if r >= max(r for _, r in samples) - 2.0)
        late_growth = last - mid
        # levels off: the last quarter grows at most a fifth as fast as the first (or < 8 MB)
        levels = last - q3 <= max(8.0, 0.2 * (q1 - first))
        return Row(f"soak: {p.soak_workflows} workflows for {p.soak_s:.0f} s", requests, errors,
                   f"{requests} requests, {errors} errors; RSS {first:.0f} -> {q1:.0f} (1/4) -> {mid:.0f} (1/2) "
                   f"-> {q3:.0f} (3/4) -> {last:.0f} MB (within 2 MB of the end from {peak_t:.0f} s on)",
                   {"rss": [(round(t, 1), round(r, 1)) for t, r in samples], "late_growth_mb": round(late_growth, 1)},
                   target=levels)

    # ------------------------------------------------------------ kill -9
    def kill_restart(self, srv: BenchServer) -> Row:
        p = self.plan
        failed, tried = 0, 0
        restart_s = []
        for _ in range(p.restarts):
            inflight = []

            def fire():
                try:
                    httpx.post(srv.url + "/v1/chat/completions", headers=auth("alice"), timeout=30, trust_env=False,
                               json=chat_body("in flight " * 20, max_tokens=64, ignore_eos=True))
                except httpx.HTTPError:
                    pass
            for _ in range(6):
                t = threading.Thread(target=fire)
                t.start()
                inflight.append(t)
            time.sleep(0.3)
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(10)
            for t in inflight:
                t.join(30)
            t0 = time.perf_counter()
            srv.stop()
            srv.start()  # the same port and flags
            restart_s.append(time.perf_counter() - t0)
            with client(srv, "alice", sync=True) as c:
                for i in range(p.restart_requests):
                    tried += 1
                    r = c.post("/v1/chat/completions", json=chat_body(f"after restart {i}"))
                    failed += r.status_code != 200
            self.progress("advance:kill -9", 1)
        return Row("kill -9 mid-load + restart", tried, failed,
                   f"{failed} errors after restart; back up in {max(restart_s):.1f} s",
                   {"restart_s": [round(x, 1) for x in restart_s]})

    # ------------------------------------------------------------ determinism
    def determinism(self) -> Row:
        from kvflow_agents.serving.embedded.engine import Engine
        from kvflow_agents.serving.embedded.model import load_model

        p = self.plan
        model = p.det_model
        loaded = load_model(model, dtype="float32" if model == TINY else None)
        name = f"{model}{' fp32' if model == TINY else ''}"
        prompts = [f"Question {i}: explain, in simple words, why the sky is blue. " * (1 + i % 5)
                   for i in range(p.det_prompts)]
        out: dict[str, Any] = {}
        for det in (False, True):
            kw = dict(model=model, policy="lru", device_tokens=16384, max_batch=16, deterministic=det)
            with Engine(loaded=loaded, **kw) as eng:
                t0 = time.perf_counter()
                alone = [eng.generate(q, max_tokens=24, temperature=0, ignore_eos=True).token_ids for q in prompts]
                t_alone = time.perf_counter() - t0
            with Engine(loaded=loaded, **kw) as eng:
                got: list = [None] * len(prompts)

                def go(i, eng=eng, got=got):
                    got[i] = eng.generate(prompts[i], max_tokens=24, temperature=0, ignore_eos=True).token_ids
                ts = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
                t0 = time.perf_counter()
                [t.start() for t in ts]
                [t.join() for t in ts]
                t_batched = time.perf_counter() - t0
            out["det" if det else "default"] = {
                "mismatches": sum(a != b for a, b in zip(alone, got)),
                "alone_tok_s": round(24 * len(prompts) / t_alone, 1),
                "batched_tok_s": round(24 * len(prompts) / t_batched, 1)}
            self.progress("advance:determinism", len(prompts) // 2)
        d, n = out["det"], out["default"]
        logits = {k: logits_differ(loaded, prompts, rows) for k, rows in (("default", None), ("det", 16))}
        out["logits_differ"] = logits
        return Row(f"determinism: greedy alone vs batched ({name})", len(prompts),
                   d["mismatches"] + logits["det"],
                   f"greedy outputs differ: default {n['mismatches']}/{len(prompts)}, --deterministic "
                   f"{d['mismatches']}/{len(prompts)}; one decode step's logits differ: default "
                   f"{logits['default']}/{len(prompts)}, --deterministic {logits['det']}/{len(prompts)}; "
                   f"cost: batched {d['batched_tok_s'] / n['batched_tok_s']:.2f}x, one at a time "
                   f"{d['alone_tok_s'] / n['alone_tok_s']:.2f}x the default's tokens/s", out)


def logits_differ(loaded, prompts: list[str], rows: Optional[int]) -> int:
    """How many sequences get other logits from one decode step in a batch of all of them than
    alone (bit for bit; ``rows``: the deterministic mode's batch-invariant decode)."""
    import torch

    from kvflow_agents.serving.embedded.kv_pool import PagedKVPool

    model, tok, cfg = loaded
    ps, seqs, nxt = 16, [], 0
    ids = [tok.encode(q) for q in prompts]
    pool = PagedKVPool(cfg, device_pages=sum(len(x) // ps + 2 for x in ids), host_pages=0, page_size=ps)
    with torch.inference_mode():
        for x in ids:
            n = len(x) // ps + 2
            pages = list(range(nxt, nxt + n))
            nxt += n
            first = int(torch.argmax(model.prefill(pool.device_kv, x, pages, 0)))
            seqs.append((first, pages, len(x)))
        batched = model.decode_batch(pool.device_kv, seqs, invariant_rows=rows)
        return sum(not torch.equal(model.decode_batch(pool.device_kv, [sq], invariant_rows=rows)[0], batched[i])
                   for i, sq in enumerate(seqs))


# ================================================================ output
def to_json(rows: list[Row], meta: dict, series: dict) -> dict:
    return {"meta": meta, "rows": [{**asdict(r), "ok": r.ok} for r in rows], "series": series,
            "all_ok": all(r.ok for r in rows)}


def table(rows: list[Row], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col, kw in (("check", {}), ("tried", {"justify": "right"}), ("failed", {"justify": "right"}),
                    ("target", {}), ("figure", {})):
        t.add_column(col, **kw)
    for r in rows:
        tgt = {None: "", True: "[green]met[/]", False: "[red]missed[/]"}[r.target]
        t.add_row(r.name, str(r.tried), f"[{'green' if r.failed == 0 else 'red'}]{r.failed}[/]", tgt, r.figure)
    return t


def markdown(rows: list[Row]) -> str:
    """The table as Markdown (what the README shows)."""
    out = ["| check | tried | failed | target | figure |", "|---|---:|---:|---|---|"]
    for r in rows:
        tgt = {None: "", True: "met", False: "**missed**"}[r.target]
        out.append(f"| {r.name} | {r.tried} | {r.failed} | {tgt} | {r.figure} |")
    return "\n".join(out)


def plot(series: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    soak = series.get("soak_rss") or []
    if soak:
        axes[0].plot([t for t, _ in soak], [r for _, r in soak], marker=".")
    axes[0].set(title="soak: server RSS", xlabel="seconds", ylabel="MB")
    rounds = series.get("hint_rounds") or []
    if rounds:
        x = range(1, len(rounds) + 1)
        axes[1].plot(x, [r["peak_rss_mb"] for r in rounds], marker="o", label="peak")
        axes[1].plot(x, [r["after_rss_mb"] for r in rounds], marker="o", label="after leases expire")
        axes[1].legend()
    axes[1].set(title="hint memory per round", xlabel="round", ylabel="RSS MB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
