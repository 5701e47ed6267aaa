"""What a gateway needs from a worker: SGLang's worker endpoints on the embedded server.

SGLang's model gateway (``smg`` 1.13 / ``sglang-router`` 0.3.2) registers a worker by calling
``/server_info`` + ``/model_info`` (or the deprecated ``get_`` twins; without them the model is
listed as ``unknown``), probes ``/health`` (a 503 takes the worker out of rotation), polls load
for load-aware policies (``/v1/loads`` in smg 1.13, ``/get_load`` in 0.3.2; without them the
load is -1), scrapes ``/metrics`` for its ``/engine_metrics`` and forwards ``/flush_cache``.
:func:`worker_router` serves all of them from the engine's published snapshot (no engine step is
waited for), and :func:`install` adds the ``x-kvflow-instance`` response header (which instance
answered: what a benchmark behind a gateway needs to measure affinity).

Life cycle (:class:`WorkerState`): ``starting`` until the engine thread runs, ``ready``,
``draining`` after ``POST /kvflow/v1/drain`` (``/health`` answers 503 so the gateway stops
routing here; requests already routed are still served; ``DELETE`` undoes it), ``stopped``
once the engine thread is gone.

Hint-only completions (:func:`hint_only_response`): ``POST /v1/completions`` whose hints carry
``kvflow_event`` is an out-of-band transition that came through a gateway (which forwards no
``/kvflow/v1/hints``): applied like one, answered with an empty completion, no model step.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from typing import Any, Mapping, Optional

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from kvflow_agents.protocol import HEADER_REJECTED

INSTANCE_HEADER = "x-kvflow-instance"
STATES = ("starting", "ready", "draining", "stopped")


class WorkerState:
    """``starting`` → ``ready`` ⇄ ``draining``; ``stopped`` when the engine thread died."""

    def __init__(self, engine, instance_id: Optional[str] = None) -> None:
        self.engine = engine
        self.instance_id = instance_id or os.environ.get("KVFLOW_INSTANCE_ID") or uuid.uuid4().hex[:12]
        self.draining = False
        self.started_at = time.time()

    @property
    def status(self) -> str:
        if not self.engine.alive:
            return "stopped" if self.engine.started else "starting"
        return "draining" if self.draining else "ready"


def load_snapshot(engine) -> dict[str, Any]:
    """Live load in SGLang's ``LoadSnapshot`` field names (one data-parallel rank).

    ``num_used_tokens`` counts the KV that requests hold, not the evictable cache, as SGLang
    does: a kvflow worker keeps its pool full of cached prefixes on purpose, and a gateway that
    saw that as "KV usage 100%" would call every worker overloaded (smg routes around workers
    above 0.8) and break workflow affinity."""
    s = engine.stats()
    q = s.get("queue", {})
    dev = s.get("device_pages", {})
    page = s.get("page_size", 1)
    running = int(q.get("running", 0))
    waiting = int(q.get("waiting", 0)) + int(q.get("loading", 0))
    held = max(0, int(dev.get("used", 0)) - int(dev.get("evictable", 0)))
    used, cap = held * page, int(dev.get("capacity", 0)) * page
    max_running = engine.config.max_batch
    hit = (s.get("cache") or {}).get("device_hit_rate") or 0.0
    return {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": running,
            "num_waiting_reqs": waiting, "num_used_tokens": used, "num_total_tokens": used,
            "max_total_num_tokens": cap, "max_running_requests": max_running,
            "token_usage": used / cap if cap else 0.0,
            "cache_hit_rate": float(hit) if isinstance(hit, (int, float)) and math.isfinite(hit) else 0.0,
            "utilization": running / max_running if max_running else 0.0}


def model_info(engine) -> dict[str, Any]:
    cfg = engine.config
    return {"model_path": cfg.model_path or cfg.model, "served_model_name": engine.model_name,
            "tokenizer_path": cfg.model_path or cfg.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def server_info(engine, state: WorkerState) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("kvflow-agents")
    except PackageNotFoundError:  # running from a source tree
        ver = "0"
    cfg = engine.config
    return {"engine": "kvflow-embedded", "version": ver, "instance_id": state.instance_id,
            "status": state.status, "model_path": cfg.model_path or cfg.model,
            "served_model_name": engine.model_name, "policy": engine.policy.name,
            "page_size": cfg.page_size, "max_total_num_tokens": cfg.device_tokens,
            "host_tokens": cfg.host_tokens if engine.policy.host_tier else 0,
            "max_running_requests": cfg.max_batch, "device": cfg.device,
            "startup_time": state.started_at, "internal_states": [load_snapshot(engine)]}


def flush(engine) -> tuple[bool, str]:
    """Drop every cached prefix (device, then host) when no request is in flight, as SGLang's
    ``/flush_cache`` does; refused otherwise (a running request holds its prefix)."""
    return engine.call(flush_when_idle)


def flush_when_idle(eng) -> tuple[bool, str]:
    """:func:`flush` on the engine thread (a module-level function: it travels to an engine in
    its own process)."""
    q = eng.scheduler.counts()
    if sum(q.values()) or eng.manager.loads_in_flight:
        return False, "requests or loads in flight; nothing flushed"
    dev, host = eng.manager.flush()
    return True, f"flushed {dev} device and {host} host pages"


def health_response(engine, state: WorkerState) -> Response:
    status = state.status
    body = {"status": "ok" if status == "ready" else status, "model": engine.model_name,
            "policy": engine.policy.name, "instance": state.instance_id}
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


def worker_router(engine, state: WorkerState) -> APIRouter:
    r = APIRouter()

    @r.get("/model_info")
    @r.get("/get_model_info")
    async def _model_info() -> dict:
        return model_info(engine)

    @r.get("/server_info")
    @r.get("/get_server_info")
    async def _server_info() -> dict:
        return server_info(engine, state)

    @r.get("/get_load")
    async def _get_load() -> list:
        snap = load_snapshot(engine)  # SGLang < 0.5's shape (sglang-router 0.3.2 reads it)
        return [{"dp_rank": 0, "num_reqs": snap["num_running_reqs"] + snap["num_waiting_reqs"],
                 "num_waiting_reqs": snap["num_waiting_reqs"], "num_tokens": snap["num_used_tokens"]}]

    @r.get("/v1/loads")
    async def _loads() -> dict:
        from datetime import datetime, timezone
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": "kvflow",
                "accelerator": None, "num_accelerators": 0, "loads": [load_snapshot(engine)]}

    @r.get("/version")
    async def _version() -> dict:
        return {"version": server_info(engine, state)["version"]}

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush() -> Response:
        import asyncio
        ok, msg = await asyncio.get_running_loop().run_in_executor(None, flush, engine)
        return Response(msg + "\n", status_code=200 if ok else 400, media_type="text/plain")

    @r.post("/kvflow/v1/drain")
    async def _drain() -> dict:
        state.draining = True
        return {"status": state.status, "instance": state.instance_id}

    @r.delete("/kvflow/v1/drain")
    async def _undrain() -> dict:
        state.draining = False
        return {"status": state.status, "instance": state.instance_id}

    return r


def hint_only_response(engine, body: Any, headers: Mapping[str, str],
                       tenant: Optional[str] = None) -> Optional[Response]:
    """The answer to a hint-only completion, or ``None`` for an ordinary request. ``tenant``:
    the caller's (its workflow ids are scoped to it, ``serving/tenancy.py``)."""
    from ..tenancy import scope_hints
    from .openai_api import parse_hints

    if not isinstance(body, dict):
        return None
    hints, reason = parse_hints(body, headers, allow_event=True)
    if hints is None or hints.event is None:
        return None  # no event: an LLM request (a malformed hint is reported by it)
    engine.note_hints(True)
    engine.update_hints(scope_hints(hints, tenant), tenant=tenant)
    return JSONResponse(
        {"id": f"cmpl-hint-{uuid.uuid4().hex[:12]}", "object": "text_completion",
         "created": int(time.time()), "model": engine.model_name, "system_fingerprint": None,
         "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
         "kvflow": {"event": hints.event, "workflow": hints.workflow}},
        headers={HEADER_REJECTED: "accepted"})


def install(app: FastAPI, engine, instance_id: Optional[str] = None) -> WorkerState:
    """Mount the worker endpoints and the instance header on ``app``; the state is
    ``app.state.worker``."""
    state = WorkerState(engine, instance_id)
    app.state.worker = state
    app.include_router(worker_router(engine, state))
    app.add_middleware(InstanceHeader, instance_id=state.instance_id)
    return state


class InstanceHeader:
    """Pure ASGI middleware (streams pass through untouched): adds ``x-kvflow-instance``."""

    def __init__(self, app, instance_id: str) -> None:
        self.app = app
        self.header = (INSTANCE_HEADER.encode(), instance_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)
        await self.app(scope, receive, send_with_header)
