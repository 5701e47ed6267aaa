"""Helpers shared by the serving tests (imported by module name; tests/serving is on sys.path)."""

from __future__ import annotations

import socket
import threading
import time


def run_concurrently(worker, n: int, timeout: float = 120.0) -> list:
    """``worker(k)`` for k in range(n), each on its own thread; returns what they raised."""
    errors: list = []

    def run(k: int) -> None:
        try:
            worker(k)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    return errors


def chat_hints(workflow, agent, ste, fixed_messages=1, step=0, **extra):
    """``custom_params`` for one agent's request (hints v1)."""
    return {"kvflow_v": 1, "kvflow_workflow": workflow, "kvflow_agent": agent, "kvflow_step": step,
            "kvflow_ste": ste, "kvflow_fixed_messages": fixed_messages, **extra}


AGENTS = ("A", "B", "C", "D")


def system_prompt(agent: str) -> str:
    """A fixed agent prompt of ~185 tokens (tiny-random is byte-level), distinct from the start."""
    return f"[{agent}] " + f"Agent {agent} follows rule {agent}{agent}. " * 7


def cycle_ste(running: str, agents=AGENTS) -> dict:
    """STE on the paper's cycle A -> B -> C -> D -> A: 0 for the running agent, 1 for the next..."""
    i = agents.index(running)
    return {agents[(i + k) % len(agents)]: k for k in range(len(agents))}


def agent_call(client, agent: str, step: int, workflow: str = "wf", user: str | None = None,
               max_tokens: int = 4, raw: bool = False, **extra):
    """One agent's chat request on the cycle, with hints v1 in custom_params."""
    create = client.chat.completions.with_raw_response.create if raw else client.chat.completions.create
    return create(
        model="tiny-random", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system_prompt(agent)},
                  # distinct from the first character: only the fixed prompt's pages are shared
                  {"role": "user", "content": user or f"{chr(97 + step % 26)}: task {step}"}],
        extra_body={"ignore_eos": True,
                    "custom_params": chat_hints(workflow, agent, cycle_ste(agent), step=step)},
        **extra)


def residency(report: dict, workflow: str, agent: str) -> str:
    from kvflow_agents.serving.embedded.cache_view import residency_of
    return residency_of(report, workflow, agent)


class RunningServer:
    def __init__(self, engine, app, **uvicorn_kw) -> None:
        import uvicorn

        self.engine = engine
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        cfg = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                             **uvicorn_kw)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()
        self.sock.close()

    def client(self, api_key: str = "unused", **kw):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60, **kw)

    def http(self, **kw):
        import httpx
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def cache(self) -> dict:
        with self.http(headers=self._auth) as h:
            r = h.get("/kvflow/v1/cache")
            r.raise_for_status()
            return r.json()

    _auth: dict = {}
