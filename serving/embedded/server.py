"""The embedded engine's HTTP server: OpenAI-compatible API + KVFlow endpoints (FastAPI).

``create_app(engine, api_key=None, *, tenant_header=None, limits=None, model_aliases=())``
returns the ASGI app; ``kvflow serve`` runs it with uvicorn (``http=guarded_protocol(limits, http)``
adds the header timeout).

Endpoints:
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` or not), ``GET /v1/models``,
  ``GET /health``. ``usage.prompt_tokens_details.cached_tokens`` = prompt tokens not recomputed
  (device or host hit); ``usage.kvflow`` splits them per tier.
- ``POST /kvflow/v1/hints``: out-of-band hints v1 (flat ``kvflow_*`` dict, optional
  ``kvflow_event``: ``"transition"`` or ``"end"``; "end" releases the workflow).
- ``GET /kvflow/v1/cache``: the caller's workflows/agents: residency, STE/priority, tokens; pool
  usage (``?format=text`` for a plain table).
- ``GET /metrics``: Prometheus text.
- Gateway worker endpoints (``/model_info``, ``/server_info``, ``/v1/loads``, ``/get_load``,
  ``/flush_cache``, ``/kvflow/v1/drain``), the ``x-kvflow-instance`` header and hint-only
  completions: :mod:`.worker_api`.

Sampling: ``temperature`` (default 1.0; 0 = greedy), ``top_p``, ``seed``, ``max_tokens`` /
``max_completion_tokens``, ``stop``, ``frequency_penalty`` / ``presence_penalty``, ``logit_bias``,
``logprobs`` / ``top_logprobs``, ``n`` (up to ``openai_api.MAX_N``); extensions ``ignore_eos``,
``repetition_penalty``, ``regex``, ``ebnf``. Tool calling: ``tools``, ``tool_choice``,
``parallel_tool_calls`` (grammar-constrained, see ``grammar.py``); ``response_format``
(``json_object`` / ``json_schema``). Other OpenAI fields (user, metadata, ...) are ignored.

Invariants:
- every error is OpenAI-shaped ``{"error": {...}}``: bad JSON / types / params, a prompt over
  the limits are 400, an unknown model 404, a body over ``--max-body-bytes`` 413, a body too
  slow 408 (see ``limits.py``); no input makes a 5xx;
- one request cannot fail another: it is parsed, validated and tokenized (off the event loop, so
  ``/health`` and other requests go on) before the engine sees it, and a failure inside an engine
  step fails only the request that caused it (``engine_loop.py``);
- hints on a request never fail it: malformed ones are ignored, logged, counted and reported in
  the ``x-kvflow-hints: rejected: <reason>`` response header (``accepted`` when used); every
  response header is legal, so every response is sent;
- a client that disconnects (stream or not) aborts its request, which frees its KV pages;
- with API keys, every endpoint requires ``Authorization: Bearer <key>`` (or ``x-api-key``), and
  the key names the tenant: workflows are namespaced per tenant (``serving/tenancy.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow_agents.protocol import HEADER_REJECTED, HintError, Hints

from . import metrics_prom, worker_api
from .engine import Engine, EngineInputError
from .limits import BodyError, LimitsMiddleware, ServerLimits, json_bytes, parse_json_body
from .openai_api import (APIError, ChatRequest, ChoiceRenderer, CompletionRequest, chat_chunk,
                         chat_response_n, completion_chunk, completion_response_n, header_safe, parse,
                         parse_hints, prompt_kwargs, usage_n)
from ..tenancy import Tenancy, TenantError, scope_hints

log = logging.getLogger("kvflow.server")

INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed off the event loop
HINT_CHANNELS = ("custom_params", "metadata")  # validated by the hints parser, not as prompts
# Operator endpoints act on every tenant's cache: not open to tenants of a shared server.
OPERATOR_PATHS = ("/flush_cache", "/kvflow/v1/drain")


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: a stray lone surrogate becomes a ``\\udXXX`` escape."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def create_app(engine: Engine, api_key: "str | Sequence[str] | Mapping[str, str] | Tenancy | None" = None,
               *, tenant_header: Optional[str] = None, limits: Optional[ServerLimits] = None,
               model_aliases: Iterable[str] = ()) -> FastAPI:
    """``api_key``: one key, several, ``{tenant: key}``, or a :class:`Tenancy`."""
    limits = limits or ServerLimits()
    limits.validate()
    tenancy = api_key if isinstance(api_key, Tenancy) else Tenancy.from_options(api_key, tenant_header)
    served_models = {engine.model_name, *model_aliases}
    engine.tokenizer.offload_long_texts()  # a maximum-size prompt never stalls the event loop
    # Parsing and tokenizing run in these pools, not on the event loop. Big bodies get their own
    # two workers: they bound the memory concurrent huge prompts take, and a queue of them never
    # delays ordinary requests, which have four.
    small = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvflow-prep")
    large = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvflow-prep-big")

    def authenticate(request: Request) -> None:
        try:
            request.state.tenant = tenancy.authenticate(request.headers)
        except TenantError as e:
            if e.status == 401:
                raise APIError(401, str(e), type="authentication_error", code="invalid_api_key") from None
            raise APIError(e.status, str(e), param=tenancy.tenant_header) from None
        if tenancy.shared and request.url.path in OPERATOR_PATHS:
            raise APIError(403, f"{request.url.path} acts on every tenant's cache: not available "
                           "on a server with several tenants", type="permission_error")

    app = FastAPI(title="kvflow embedded engine", dependencies=[Depends(authenticate)],
                  docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=SafeJSONResponse)
    app.add_middleware(LimitsMiddleware, limits=limits)
    app.state.engine = engine
    app.state.tenancy = tenancy
    app.state.limits = limits
    registry = metrics_prom.make_registry(engine)
    worker = worker_api.install(app, engine)  # gateway endpoints, x-kvflow-instance, drain

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return SafeJSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail),
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return SafeJSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return SafeJSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return SafeJSONResponse(APIError(500, "internal server error", type="server_error").body(),
                                status_code=500)

    async def off_loop(big: bool, fn, *args, **kw):
        pool = large if big else small
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kw))

    async def read_json(request: Request, skip: Sequence[str] = ()) -> Any:
        raw = await request.body()
        request.state.big = len(raw) > INLINE_PARSE_BYTES
        try:
            if request.state.big:
                return await off_loop(True, parse_json_body, raw, max_depth=limits.max_json_depth, skip=skip)
            return parse_json_body(raw, max_depth=limits.max_json_depth, skip=skip)
        except BodyError as e:
            raise APIError(e.status, str(e), param=e.param) from None

    def tenant_of(request: Request) -> Optional[str]:
        return getattr(request.state, "tenant", None)

    def check_model(req) -> None:
        if req.model not in served_models:
            raise APIError(404, f"The model `{req.model}` does not exist (this server serves "
                           f"{', '.join(sorted(served_models))})", param="model", code="model_not_found")

    def hint_headers(body: dict, request: Request):
        hints, reason = parse_hints(body, request.headers)
        headers = {}
        if reason is not None:
            log.warning("ignoring malformed kvflow hints: %s", header_safe(reason))
            engine.note_hints(False)
            headers[HEADER_REJECTED] = "rejected: " + header_safe(reason)
        elif hints is not None:
            engine.note_hints(True)
            headers[HEADER_REJECTED] = "accepted"
        return scope_hints(hints, tenant_of(request)), headers

    async def build(req, kw: dict, hints, request: Request) -> list:
        """One engine request per choice (``n``); they share the prompt's cached prefix.
        Tokenized off the event loop (``off_loop``)."""
        params = req.sampling()
        n = req.n or 1
        tenant = tenant_of(request)

        def make() -> list:
            return [engine.make_request(**kw, params=dataclasses.replace(params, seed=req.choice_seed(i))
                                        if n > 1 else params, hints=hints, tenant=tenant) for i in range(n)]
        try:
            return await off_loop(getattr(request.state, "big", False), make)
        except EngineInputError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None

    def renderers(req, chat: bool) -> list:
        spec = req.grammar_spec()
        names = None
        if chat and getattr(req, "tools", None) and req.tool_choice != "none":
            from .tool_calls import tool_names
            names = tool_names(req.tools)
        elif spec is not None and spec.tool_call:
            names = []
        return [ChoiceRenderer(chat=chat, tool_names=names, tokenizer=engine.tokenizer,
                               skip_ids=engine.tokenizer.eos_token_ids) for _ in range(req.n or 1)]

    async def run(ereqs: list, request: Request, *, chat: bool, stream: bool, include_usage: bool,
                  headers: dict, rends: list) -> Response:
        model = engine.model_name
        if stream:
            return StreamingResponse(sse(ereqs, model, chat, include_usage, rends),
                                     media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})
        comps = await collect(ereqs, request)
        if comps is None:  # client went away
            return Response(status_code=499)
        for comp in comps:
            if comp.finish_reason == "error":
                raise APIError(500, comp.error or "generation failed", type="server_error")
        body = (chat_response_n if chat else completion_response_n)(comps, model, rends)
        return SafeJSONResponse(body, headers=headers)

    async def collect(ereqs: list, request: Request):
        async def last(ereq):
            async for ev in engine.stream(ereq):
                if ev.done is not None:
                    return ev.done
        task = asyncio.ensure_future(asyncio.gather(*(last(r) for r in ereqs)))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return None

    async def merged(ereqs: list):
        """``(choice index, event)`` from the streams of all choices, as they come."""
        if len(ereqs) == 1:
            async for ev in engine.stream(ereqs[0]):
                yield 0, ev
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, ereq):
            try:
                async for ev in engine.stream(ereq):
                    await q.put((i, ev))
            finally:
                await q.put((i, None))
        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(ereqs)]
        try:
            left = len(tasks)
            while left:
                i, ev = await q.get()
                if ev is None:
                    left -= 1
                    continue
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()

    async def sse(ereqs: list, model: str, chat: bool, include_usage: bool, rends: list):
        created = int(time.time())
        rid = ereqs[0].rid
        comps: list = [None] * len(ereqs)

        def line(obj) -> str:
            return "data: " + json.dumps(obj, ensure_ascii=True) + "\n\n"
        try:
            async for chunk in _events(ereqs, model, chat, include_usage, rends, rid, created, comps, line):
                yield chunk
        except Exception:  # noqa: BLE001 - the stream has started: end it with an error event
            log.exception("stream %s failed", rid)
            yield line(APIError(500, "internal server error", type="server_error").body())
        yield "data: [DONE]\n\n"

    async def _events(ereqs, model, chat, include_usage, rends, rid, created, comps, line):
        if chat:
            for i in range(len(ereqs)):
                yield line(chat_chunk(rid, model, created, delta={"role": "assistant", "content": ""}, index=i))
        async for i, ev in merged(ereqs):
            r = rends[i]
            lp = r.logprobs(list(ev.logprobs)) if ev.logprobs else None
            if chat:
                deltas = r.deltas(ev.text)
                for k, d in enumerate(deltas):
                    yield line(chat_chunk(rid, model, created, delta=d, index=i,
                                          logprobs=lp if k == len(deltas) - 1 else None))
                if not deltas and lp is not None:
                    yield line(chat_chunk(rid, model, created, delta={}, index=i, logprobs=lp))
            elif ev.text or lp is not None:
                yield line(completion_chunk(rid, model, created, text=ev.text, index=i, logprobs=lp))
            c = ev.done
            if c is None:
                continue
            if c.finish_reason == "error":
                yield line(APIError(500, c.error or "generation failed", type="server_error").body())
                break
            comps[i] = c
            rest, fr = r.final(c)
            for d in rest:
                yield line(chat_chunk(rid, model, created, delta=d, index=i))
            yield line(chat_chunk(rid, model, created, delta={}, finish=fr, index=i) if chat
                       else completion_chunk(rid, model, created, text="", finish=fr, index=i))
        if include_usage and all(c is not None for c in comps):
            u = usage_n(comps)
            yield line(chat_chunk(rid, model, created, delta={}, use=u) if chat
                       else completion_chunk(rid, model, created, text="", use=u))

    # ------------------------------------------------------------------ OpenAI API
    async def completion(request: Request, model_cls, chat: bool) -> Response:
        body = await read_json(request, skip=HINT_CHANNELS)
        if not chat:
            hint_only = worker_api.hint_only_response(engine, body, request.headers,
                                                      tenant=tenant_of(request))
            if hint_only is not None:  # an out-of-band event that came through a gateway
                return hint_only
        big = request.state.big
        req = await off_loop(True, parse, model_cls, body) if big else parse(model_cls, body)
        check_model(req)
        hints, headers = hint_headers(body, request)
        kw = {"messages": req.message_dicts(), "tools": req.tools} if chat else prompt_kwargs(req)
        ereqs = await build(req, kw, hints, request)
        return await run(ereqs, request, chat=chat, stream=bool(req.stream),
                         include_usage=req.include_usage, headers=headers, rends=renderers(req, chat))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, ChatRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, CompletionRequest, chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "kvflow-agents"} for name in
                                           [engine.model_name, *sorted(served_models - {engine.model_name})]]}

    @app.get("/health")
    async def health() -> Response:  # 503 while starting, draining or stopped
        return worker_api.health_response(engine, worker)

    # ------------------------------------------------------------------ KVFlow
    @app.post("/kvflow/v1/hints")
    async def post_hints(request: Request) -> Response:
        body = await read_json(request, skip=tuple(body_keys_of_hints()))
        try:
            hints = Hints.from_custom_params(body) if isinstance(body, dict) else None
            if hints is None:
                raise HintError("body", "expected a JSON object with kvflow_* keys")
        except (HintError, ValueError, TypeError) as e:
            reason = f"{e.key}: {e.reason}" if isinstance(e, HintError) else f"body: {type(e).__name__}"
            log.warning("rejected out-of-band hints: %s", header_safe(reason))
            engine.note_hints(False)
            err = APIError(400, f"malformed hints: {reason}", param=getattr(e, "key", None))
            return SafeJSONResponse(err.body(), status_code=400,
                                    headers={HEADER_REJECTED: "rejected: " + header_safe(reason)})
        engine.note_hints(True)
        tenant = tenant_of(request)
        engine.update_hints(scope_hints(hints, tenant), tenant=tenant)
        return SafeJSONResponse({"status": "ok", "workflow": hints.workflow, "agent": hints.agent,
                                 "event": hints.event or "transition"},
                                headers={HEADER_REJECTED: "accepted"})

    @app.get("/kvflow/v1/cache")
    async def cache(request: Request, format: str = "json") -> Response:
        from .cache_view import cache_report, render_text
        tenant = tenant_of(request)
        # a partial of a module-level function: it travels to an engine in its own process
        report = await asyncio.wait_for(engine.acall(functools.partial(cache_report, tenant=tenant)),
                                        timeout=60)
        # this (the HTTP) process's CPU so far; with the engine in a process of its own, the
        # two processes' CPU together is what the server costs
        report["http"] = {"process_cpu_s": time.process_time()}
        if format == "text":
            return Response(render_text(report).encode("utf-8", "backslashreplace"),
                            media_type="text/plain; charset=utf-8")
        return SafeJSONResponse(report)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_prom.render(registry), media_type=metrics_prom.CONTENT_TYPE)

    return app


def body_keys_of_hints() -> Iterable[str]:
    """On ``/kvflow/v1/hints`` the whole body is hints: their parser validates every id."""
    from kvflow_agents.protocol import HintsWire
    return HintsWire.model_fields.keys()
