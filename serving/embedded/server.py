"""The embedded engine's HTTP server: OpenAI-compatible API + KVFlow endpoints (FastAPI).

``create_app(engine, api_key=None)`` returns the ASGI app; ``kvflow serve`` runs it with uvicorn.

Endpoints:
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` or not), ``GET /v1/models``,
  ``GET /health``. ``usage.prompt_tokens_details.cached_tokens`` = prompt tokens not recomputed
  (device or host hit); ``usage.kvflow`` splits them per tier.
- ``POST /kvflow/v1/hints``: out-of-band hints v1 (flat ``kvflow_*`` dict, optional
  ``kvflow_event``: ``"transition"`` or ``"end"``; "end" releases the workflow).
- ``GET /kvflow/v1/cache``: per workflow/agent residency, STE/priority, tokens; pool usage
  (``?format=text`` for a plain table).
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
- every error is OpenAI-shaped ``{"error": {...}}``; bad JSON / bad params / a prompt over the
  device pool's capacity are 400;
- hints on a request never fail it: malformed ones are ignored, logged, counted and reported in
  the ``x-kvflow-hints: rejected: <reason>`` response header (``accepted`` when used);
- a client that disconnects (stream or not) aborts its request, which frees its KV pages;
- with ``api_key`` set, every endpoint requires ``Authorization: Bearer <key>`` (or ``x-api-key``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from typing import Any, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow_agents.protocol import HEADER_REJECTED, HintError, Hints

from . import metrics_prom, worker_api
from .engine import Engine, EngineInputError
from .openai_api import (APIError, ChatRequest, ChoiceRenderer, CompletionRequest, chat_chunk,
                         chat_response_n, completion_chunk, completion_response_n, header_safe, parse,
                         parse_hints, prompt_kwargs, usage_n)

log = logging.getLogger("kvflow.server")


def create_app(engine: Engine, api_key: Optional[str] = None) -> FastAPI:
    def check_key(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", type="authentication_error",
                           code="invalid_api_key")

    app = FastAPI(title="kvflow embedded engine", dependencies=[Depends(check_key)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    registry = metrics_prom.make_registry(engine)
    worker = worker_api.install(app, engine)  # gateway endpoints, x-kvflow-instance, drain

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail),
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(),
                            status_code=500)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as e:
            raise APIError(400, f"invalid JSON body: {e}") from None

    def hint_headers(body: dict, request: Request):
        hints, reason = parse_hints(body, request.headers)
        headers = {}
        if reason is not None:
            log.warning("ignoring malformed kvflow hints: %s", reason)
            engine.note_hints(False)
            headers[HEADER_REJECTED] = "rejected: " + header_safe(reason)
        elif hints is not None:
            engine.note_hints(True)
            headers[HEADER_REJECTED] = "accepted"
        return hints, headers

    def build(req, kw: dict, hints) -> list:
        """One engine request per choice (``n``); they share the prompt's cached prefix."""
        params = req.sampling()
        n = req.n or 1
        try:
            return [engine.make_request(**kw, params=dataclasses.replace(params, seed=req.choice_seed(i))
                                        if n > 1 else params, hints=hints) for i in range(n)]
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
        return JSONResponse(body, headers=headers)

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
            return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
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
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ OpenAI API
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        req: ChatRequest = parse(ChatRequest, body)
        hints, headers = hint_headers(body, request)
        ereqs = build(req, {"messages": req.message_dicts(), "tools": req.tools}, hints)
        return await run(ereqs, request, chat=True, stream=bool(req.stream),
                         include_usage=req.include_usage, headers=headers, rends=renderers(req, True))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        hint_only = worker_api.hint_only_response(engine, body, request.headers)
        if hint_only is not None:  # an out-of-band event that came through a gateway
            return hint_only
        req: CompletionRequest = parse(CompletionRequest, body)
        hints, headers = hint_headers(body, request)
        ereqs = build(req, prompt_kwargs(req), hints)
        return await run(ereqs, request, chat=False, stream=bool(req.stream),
                         include_usage=req.include_usage, headers=headers, rends=renderers(req, False))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                            "created": 0, "owned_by": "kvflow-agents"}]}

    @app.get("/health")
    async def health() -> Response:  # 503 while starting, draining or stopped
        return worker_api.health_response(engine, worker)

    # ------------------------------------------------------------------ KVFlow
    @app.post("/kvflow/v1/hints")
    async def post_hints(request: Request) -> Response:
        body = await read_json(request)
        try:
            hints = Hints.from_custom_params(body) if isinstance(body, dict) else None
            if hints is None:
                raise HintError("body", "expected a JSON object with kvflow_* keys")
        except (HintError, ValueError, TypeError) as e:
            reason = f"{e.key}: {e.reason}" if isinstance(e, HintError) else f"body: {type(e).__name__}"
            log.warning("rejected out-of-band hints: %s", reason)
            engine.note_hints(False)
            err = APIError(400, f"malformed hints: {reason}", param=getattr(e, "key", None))
            return JSONResponse(err.body(), status_code=400,
                                headers={HEADER_REJECTED: "rejected: " + header_safe(reason)})
        engine.note_hints(True)
        engine.update_hints(hints)
        return JSONResponse({"status": "ok", "workflow": hints.workflow, "agent": hints.agent,
                             "event": hints.event or "transition"}, headers={HEADER_REJECTED: "accepted"})

    @app.get("/kvflow/v1/cache")
    async def cache(format: str = "json") -> Response:
        from .cache_view import cache_report, render_text
        report = await asyncio.wait_for(engine.acall(cache_report), timeout=60)
        if format == "text":
            return Response(render_text(report), media_type="text/plain")
        return JSONResponse(report)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_prom.render(registry), media_type=metrics_prom.CONTENT_TYPE)

    return app
