"""Stock SGLang's real server, with and without the plugin, for the end-to-end tests.

Every server of a session runs the same tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV
heads, SmolLM2's tokenizer and chat template, bf16 safetensors, written at test time), the same
``--max-total-tokens`` and HiCache host size, the same emulated host link, on this CPU under
the import-time shims (``tests/sglang/support/sglang_shims.py``). They differ only in the
cache:

- ``stock``: SGLang + HiCache as shipped (LRU, demand load-back);
- ``kvflow``: SGLang + HiCache + the plugin (``--radix-cache-backend kvflow
  --radix-eviction-policy kvflow``), with the link poisoning in-flight rows (a request that
  read KV before it landed would decode garbage, so identical outputs prove it never does);
- ``retract``: the plugin's configuration with SGLang's ``SGLANG_TEST_RETRACT`` (a decoding
  request is retracted and queued again every 3 forward steps), for the re-queue test;
- ``serial`` / ``serial-fcfs``: the plugin's configuration with ``--max-running-requests 1``,
  with workflow-ordered admission (the default) and with ``KVFLOW_ADMISSION=fcfs``, for the
  admission order test.

A server start costs 35-100 s on this shared 2-core box, so each configuration is started once
per session (:class:`ServerPool`), both main ones concurrently, and restarted only if a test
killed it. Servers run in their own process group and are stopped by it.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx

from kvflow_agents.bench.sglang_engine import (SGLangLaunch, SGLangServer, TinyLlamaSpec,
                                               write_tiny_llama)

# Sizes (tokens). The 4-agent cycle's fixed prompts are ~FIXED tokens each, so the device pool
# holds about 2.5 of the 4 (KVFlow's memory-constrained regime); the host pool holds them all.
DEVICE_TOKENS = 3072
HOST_RATIO = 4.0
FIXED = 1000
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 2     # layers x (K,V) x kv_heads x head_dim x bf16
LOAD_S_PER_FIXED = 1.0                      # a fixed prompt takes this long on the link
LINK_GBPS = FIXED * KV_BYTES_PER_TOKEN / LOAD_S_PER_FIXED / 1e9
RECOMPUTE_S_PER_TOKEN = 5 * LOAD_S_PER_FIXED / FIXED   # the plugin server's (see CONFIGS)

MODEL = TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                      tokenizer="smollm2", seed=0)


def launch(model_dir: str, python: str) -> SGLangLaunch:
    return SGLangLaunch(model_path=model_dir, python=python, device="cpu",
                        max_total_tokens=DEVICE_TOKENS, host_ratio=HOST_RATIO, page_size=1,
                        host_link_gbps=LINK_GBPS, lookahead=1, extra=["--sleep-on-idle"],
                        startup_timeout_s=600.0)


CONFIGS: dict[str, dict[str, Any]] = {
    "stock": {"policy": "hicache"},
    # The recompute estimate is pinned, not measured: this tiny model prefills 1000 tokens in
    # ~40 ms on this CPU, against the link's 1 s, so a measured estimate (correctly) recomputes
    # every host-only prefix instead of loading it, and the cycle test's regime (loads worth
    # their time: KVFlow's) would depend on the machine's speed (it did: one CI box loaded,
    # another recomputed). 5 ms per token: a prefill 5x slower than the link, as for a large
    # model on a GPU (serving/sglang/cache.py reads it from --radix-eviction-policy-config).
    "kvflow": {"policy": "kvflow", "env": {"KVFLOW_HOST_LINK_POISON": "1"},
               "extra": ["--radix-eviction-policy-config",
                         json.dumps({"recompute_s_per_token": RECOMPUTE_S_PER_TOKEN})]},
    # SGLang's own test switch: retract a decoding request every 3 forward steps (what memory
    # pressure does, on a schedule)
    "retract": {"policy": "kvflow", "env": {"SGLANG_TEST_RETRACT": "1"}},
    # one running request at a time: what arrives meanwhile waits in the queue, in the order
    # the plugin's admission hook leaves it (the admission test)
    "serial": {"policy": "kvflow", "extra": ["--max-running-requests", "1"]},
    "serial-fcfs": {"policy": "kvflow", "extra": ["--max-running-requests", "1"],
                    "env": {"KVFLOW_ADMISSION": "fcfs"}},
}


class ServerPool:
    """One running server per configuration name, started on first use."""

    def __init__(self, base: SGLangLaunch) -> None:
        self.base = base
        self.servers: dict[str, SGLangServer] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _new(self, name: str) -> SGLangServer:
        cfg = CONFIGS[name]
        launch = SGLangLaunch(**{**self.base.__dict__, "env": {**self.base.env, **cfg.get("env", {})},
                                 "extra": [*self.base.extra, *cfg.get("extra", ())]})
        return SGLangServer.for_policy(launch, cfg["policy"])

    def start(self, *names: str) -> None:
        """Start the named servers that are not running, concurrently; raise on any failure."""
        todo = [n for n in names if not self._alive(n)]
        errors: dict[str, BaseException] = {}

        def run(n: str) -> None:
            try:
                srv = self._new(n)
                self.servers[n] = srv
                srv.start()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[n] = e

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("; ".join(f"{n}: {e}" for n, e in errors.items()))

    def _alive(self, name: str) -> bool:
        srv = self.servers.get(name)
        return srv is not None and srv.proc is not None and srv.proc.poll() is None

    def get(self, name: str) -> SGLangServer:
        with self._lock:
            if not self._alive(name):
                old = self.servers.pop(name, None)
                if old is not None:
                    old.stop()
                self.start(name)
            return self.servers[name]

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(f"----- {n} server log (last {lines} lines) -----\n{s.log_tail(lines)}"
                         for n, s in self.servers.items())

    def close(self) -> None:
        for srv in list(self.servers.values()):
            srv.stop()
        self.servers.clear()


def build_model(directory: Path) -> Path:
    return write_tiny_llama(directory, MODEL)


# ------------------------------------------------------------------------------ client side
class Client:
    """What the tests send to one server: OpenAI chat (the real ``openai`` client), native
    ``/generate`` with ``input_ids``, the plugin's endpoints."""

    def __init__(self, server: SGLangServer, model: str) -> None:
        self.server, self.model = server, model
        self.http = httpx.Client(base_url=server.url, timeout=300.0, trust_env=False)
        import openai

        self.openai = openai.OpenAI(base_url=server.base_url, api_key="none", timeout=300.0,
                                    max_retries=0)

    def close(self) -> None:
        self.http.close()
        self.openai.close()

    def chat(self, messages: list[dict], *, hints: Optional[dict] = None, max_tokens: int = 8):
        """One greedy chat completion; returns the ``ChatCompletion``."""
        extra = {"custom_params": hints} if hints else None
        return self.openai.chat.completions.create(model=self.model, messages=messages,
                                                   max_tokens=max_tokens, temperature=0,
                                                   extra_body=extra)

    def generate(self, input_ids: list[int], *, max_new_tokens: int = 8,
                 custom_params: Optional[dict] = None, **sp: Any) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, **sp}
        if custom_params:
            params["custom_params"] = custom_params
        r = self.http.post("/generate", json={"input_ids": input_ids, "sampling_params": params})
        r.raise_for_status()
        return r.json()

    def snapshot(self) -> dict:
        r = self.http.get("/kvflow/v1/cache")
        r.raise_for_status()
        return r.json()

    def post_hints(self, doc: dict) -> httpx.Response:
        return self.http.post("/kvflow/v1/hints", json=doc)

    def healthy(self) -> bool:
        try:
            return self.http.get("/health_generate", timeout=60).status_code == 200
        except httpx.HTTPError:
            return False

    def flush(self) -> None:
        self.http.post("/flush_cache").raise_for_status()


def hints(workflow: str, agent: str, ste: dict, *, step: int, app: str = "e2e",
          fixed_messages: Optional[int] = 1, next: Sequence[str] = (),
          event: Optional[str] = None) -> dict:
    """Hints v1 as ``custom_params`` (the protocol's own model: inf STE -> null)."""
    from kvflow_agents.protocol import Hints

    return Hints(workflow=workflow, agent=agent, step=step, ste=dict(ste), next=list(next),
                 app=app, fixed_messages=fixed_messages, event=event).to_custom_params()


class SnapshotSampler:
    """Polls ``/kvflow/v1/cache`` in a thread while a workload runs (finished workflows are
    released by the server, so a read at the end no longer shows their agents)."""

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self.url, self.interval_s = url.rstrip("/") + "/kvflow/v1/cache", interval_s
        self.snapshots: list[dict] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        with httpx.Client(timeout=30.0, trust_env=False) as c:
            while not self._stop.is_set():
                try:
                    r = c.get(self.url)
                    if r.status_code == 200:
                        self.snapshots.append(r.json())
                except httpx.HTTPError:
                    pass
                self._stop.wait(self.interval_s)

    def __enter__(self) -> "SnapshotSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)


def random_ids(seed: int, n: int, vocab: int = 40000) -> list[int]:
    """``n`` token ids drawn with ``seed`` (distinct prompts whose KV nothing else shares)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def agent_rows(snapshot: dict, workflow_key: str) -> dict[str, dict]:
    return {a["agent"]: a for a in snapshot.get("agents", []) if a["workflow"] == workflow_key}


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]


def sglang_python() -> Optional[str]:
    return os.environ.get("KVFLOW_SGLANG_PYTHON") or None
