"""Per-agent usage and cache accounting, from the ``usage`` of each LLM response.

:class:`UsageByAgent` is a LangChain callback handler: attach it to the chat model
(``ChatOpenAI(callbacks=[handler])``). LangGraph puts the running node's name in the run
metadata (``langgraph_node``), which LangChain passes to ``on_chat_model_start``; the handler
remembers it per run id and files the response's usage under it in ``on_llm_end``:

* ``usage.prompt_tokens``, ``usage.completion_tokens``
* ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits, OpenAI's field)
* ``usage.kvflow`` when the server adds it (numbers are summed per agent, nested keys dotted)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler


@dataclass
class AgentUsage:
    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    calls_with_hit: int = 0
    seconds: float = 0.0
    kvflow: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _flatten(doc: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(doc, bool):
        out[prefix[:-1]] = float(doc)
    elif isinstance(doc, (int, float)):
        out[prefix[:-1]] = float(doc)
    return out


def _int(x: Any) -> int:
    try:
        return int(x or 0)
    except (TypeError, ValueError):
        return 0


def extract_usage(response: Any) -> Optional[dict[str, Any]]:
    """The OpenAI ``usage`` dict of a LangChain ``LLMResult``, or ``None``."""
    llm_output = getattr(response, "llm_output", None) or {}
    usage = llm_output.get("token_usage") if isinstance(llm_output, dict) else None
    if isinstance(usage, dict) and usage:
        return usage
    for gens in getattr(response, "generations", None) or []:
        for gen in gens:
            msg = getattr(gen, "message", None)
            meta = getattr(msg, "response_metadata", None) or {}
            if isinstance(meta.get("token_usage"), dict):
                return meta["token_usage"]
            um = getattr(msg, "usage_metadata", None)
            if um:  # LangChain's normalized form
                details = um.get("input_token_details") or {}
                return {"prompt_tokens": um.get("input_tokens", 0),
                        "completion_tokens": um.get("output_tokens", 0),
                        "prompt_tokens_details": {"cached_tokens": details.get("cache_read", 0)}}
    return None


def usage_of_error(error: BaseException) -> Optional[dict[str, Any]]:
    """The OpenAI ``usage`` of a call LangChain reports as an error although the server
    answered: a structured reply cut by ``max_tokens`` (langchain-openai's
    ``LengthFinishReasonError`` carries the completion). ``None`` for real failures."""
    usage = getattr(getattr(error, "completion", None), "usage", None)
    return usage.model_dump(exclude_none=True) if hasattr(usage, "model_dump") else None


def agent_of(metadata: Optional[dict[str, Any]]) -> str:
    """The PEER agent an LLM call belongs to: the outermost LangGraph node of its checkpoint
    namespace (``executor:<id>|agent:<id>`` -> ``executor``), else ``langgraph_node``."""
    md = metadata or {}
    ns = md.get("langgraph_checkpoint_ns")
    if isinstance(ns, str) and ns:
        return ns.split("|", 1)[0].split(":", 1)[0]
    return str(md.get("langgraph_node") or "?")


class UsageByAgent(BaseCallbackHandler):
    """Aggregates response usage per LangGraph node (agent)."""

    raise_error = False

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._runs: dict[UUID, tuple[str, float]] = {}
        self.agents: dict[str, AgentUsage] = {}
        self.raw: list[tuple[str, dict[str, Any]]] = []  # (agent, usage) per response

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            metadata: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        agent = agent_of(metadata)
        with self._lock:
            self._runs[run_id] = (agent, time.perf_counter())

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID,
                     metadata: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        self.on_chat_model_start(serialized, prompts, run_id=run_id, metadata=metadata)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        usage = usage_of_error(error)
        if usage is not None:
            self._record(run_id, usage)
            return
        with self._lock:
            self._runs.pop(run_id, None)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._record(run_id, extract_usage(response) or {})

    def _record(self, run_id: UUID, usage: dict[str, Any]) -> None:
        with self._lock:
            agent, t0 = self._runs.pop(run_id, ("?", time.perf_counter()))
        details = usage.get("prompt_tokens_details") or {}
        cached = _int(details.get("cached_tokens") if isinstance(details, dict) else 0)
        with self._lock:
            a = self.agents.setdefault(agent, AgentUsage())
            a.calls += 1
            a.prompt_tokens += _int(usage.get("prompt_tokens"))
            a.completion_tokens += _int(usage.get("completion_tokens"))
            a.cached_tokens += cached
            a.calls_with_hit += int(cached > 0)
            a.seconds += time.perf_counter() - t0
            for k, v in _flatten(usage.get("kvflow")).items():
                a.kvflow[k] = a.kvflow.get(k, 0.0) + v
            self.raw.append((agent, usage))

    def snapshot(self) -> dict[str, AgentUsage]:
        with self._lock:
            return {k: AgentUsage(**{**v.__dict__, "kvflow": dict(v.kvflow)}) for k, v in self.agents.items()}


class CacheSampler:
    """Polls ``GET /kvflow/v1/cache`` in a background thread while the workflows run.

    Finished workflows are released by the server (their agents leave the report), so a single
    read at the end shows little; sampling shows where each agent's fixed prefix lived *during*
    the run. Per agent it counts, over all samples and workflows, how often the prefix was on
    ``device``, ``loading``, ``host`` or ``none``, the largest prefix size and the last STE.
    A 404 stops the sampler (the endpoint is optional); timeouts are skipped.
    """

    def __init__(self, server_root: str, interval_s: float = 0.5, timeout_s: float = 10.0) -> None:
        self.url = server_root.rstrip("/") + "/kvflow/v1/cache"
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.samples = 0
        self.available: Optional[bool] = None
        self.last: Optional[dict[str, Any]] = None
        self.agents: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def sample(self, client: Any) -> bool:
        """One read. ``available`` becomes ``False`` only on a definite "no such endpoint"
        (404/405/501, or a non-JSON answer); a timeout (the engine may be busy) just skips."""
        try:
            r = client.get(self.url)
        except Exception:  # noqa: BLE001 — busy or gone: try again next time
            return False
        if r.status_code in (404, 405, 501):
            self.available = self.available or False
            return False
        try:
            doc = r.json() if r.status_code == 200 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if r.status_code == 200:
                self.available = self.available or False
            return False
        self.available = True
        with self._lock:
            self.last = doc
            self.samples += 1
            for wf in doc.get("workflows") or []:
                for a in (wf.get("agents") or []) if isinstance(wf, dict) else []:
                    if not isinstance(a, dict) or "agent" not in a:
                        continue
                    row = self.agents.setdefault(str(a["agent"]), {
                        "seen": 0, "device": 0, "loading": 0, "host": 0, "none": 0, "tokens": 0, "ste": None})
                    row["seen"] += 1
                    res = str(a.get("residency") or "none")
                    row[res] = row.get(res, 0) + 1
                    row["tokens"] = max(row["tokens"], int(a.get("tokens") or 0))
                    row["ste"] = a.get("ste")
        return True

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s, trust_env=False) as client:
            while not self._stop.is_set():
                if not self.sample(client) and self.available is False:
                    return  # no such endpoint
                self._stop.wait(self.interval_s)
            if self.available:
                self.sample(client)  # a final read: pools and metrics after the run

    def start(self) -> "CacheSampler":
        self._thread = threading.Thread(target=self._run, name="kvflow-cache-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.timeout_s + 1)
            self._thread = None
