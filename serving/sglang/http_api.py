"""The HTTP side of the plugin (SGLang's main process: FastAPI app + tokenizer manager).

- ``POST /kvflow/v1/hints``: a flat hints v1 dict (``kvflow_*`` keys, ``kvflow_event`` allowed)
  for transitions that send no LLM request. Validated here (400 with the bad key), then sent to
  the schedulers as a :class:`KVFlowControl` on SGLang's tokenizer -> scheduler socket.
- ``GET /kvflow/v1/cache``: the scheduler's (TP rank 0) :meth:`KVFlowRadixCache.kvflow_snapshot`.
- Gateway-proof hints (:class:`HintIntake`, an ASGI middleware on SGLang's app): SGLang's OpenAI
  request models have no ``metadata`` field, so hints that came as ``metadata["kvflow"]`` (the
  form SGLang's gateway forwards; the workflow may come as ``x-smg-routing-key``) are copied into
  ``custom_params`` before SGLang parses the body; a hint-only completion (``kvflow_event`` on
  ``/v1/completions``: an out-of-band event routed by the gateway) goes to the schedulers like
  ``/kvflow/v1/hints`` and is answered at once, without running the model.
- Chat requests: ``kvflow_fixed_messages`` (how many leading messages are the agent's fixed
  prompt) is turned into ``kvflow_fixed_prefix_tokens`` with the server's chat template, and
  the workflow id becomes SGLang's ``routing_key`` (unless the client set one), so a
  multi-instance router keeps a workflow on one instance.

Tenancy and limits, the same rules as the embedded server (``serving/tenancy.py``): with
``KVFLOW_API_KEYS_FILE`` (tenant -> key; then leave SGLang's own ``--api-key`` unset) and/or
``KVFLOW_TENANT_HEADER`` (the launcher's ``--kvflow-api-keys-file`` / ``--kvflow-tenant-header``),
the endpoints authenticate the tenant, hints on chat and completion requests (:class:`HintIntake`,
hint-only completions included) and out-of-band hints are scoped to it (another tenant's ids
name other workflows: it cannot end or alter them) and ``/kvflow/v1/cache`` lists only its
workflows. Bodies of ``/kvflow/v1/hints`` are bounded (``MAX_HINT_BODY``) and parsed
strictly (UTF-8, depth, no lone surrogates); every error is a 4xx JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import uuid

from kvflow_agents.serving.policy.boundary import common_prefix_len

from .messages import FIXED_TOKENS_KEY, KVFlowControl

logger = logging.getLogger(__name__)

TARGET_LAUNCH = "sglang.srt.entrypoints.http_server.launch_server"
TARGET_CHAT = ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat."
               "_convert_to_internal_request")
SNAPSHOT_TIMEOUT_S = 5.0
MAX_HINT_BODY = 1 << 20  # a hint with 1,024 agents is ~30 KB

_routes_added = False
_tenancy = None


def tenancy():
    """The tenancy configured by the environment (read once per process)."""
    global _tenancy
    if _tenancy is None:
        from kvflow_agents.serving.tenancy import Tenancy, load_keys_file
        path = os.environ.get("KVFLOW_API_KEYS_FILE")
        _tenancy = Tenancy(load_keys_file(path) if path else {}, os.environ.get("KVFLOW_TENANT_HEADER"))
    return _tenancy


# ------------------------------------------------------------------------------ chat hook
def fixed_prefix_tokens(tokenizer, messages: list, n_fixed: int, prompt_ids: list) -> int:
    """Token length of the first ``n_fixed`` messages as the chat template renders them
    inside ``prompt_ids``: render those messages alone, take the common prefix with the full
    prompt (templates may append tokens after the last message that the full prompt lacks)."""
    if n_fixed <= 0 or not messages:
        return 0
    head = messages[:n_fixed]
    ids = tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=False)
    if not isinstance(ids, list) and hasattr(ids, "keys") and "input_ids" in ids.keys():
        ids = ids["input_ids"]  # a BatchEncoding (transformers 5 returns one), not a dict
    return common_prefix_len(list(ids), list(prompt_ids))


def fixed_prefix_tokens_of_text(tokenizer, messages: list, n_fixed: int, prompt_text: str) -> int:
    """The same for a request SGLang passes on as rendered ``text`` (text-only models): its
    tokenizer manager encodes that text with ``tokenizer(text)``; encode the rendered first
    ``n_fixed`` messages the same way and take the common prefix."""
    if n_fixed <= 0 or not messages:
        return 0
    head = tokenizer.apply_chat_template(messages[:n_fixed], tokenize=False,
                                         add_generation_prompt=False)
    if not isinstance(head, str) or not prompt_text.startswith(head[:1]):
        return 0
    enc = lambda s: list(tokenizer(s)["input_ids"])  # noqa: E731  (what SGLang runs)
    return common_prefix_len(enc(head), enc(prompt_text))


def after_convert_to_internal_request(result, serving, request, *args, **kwargs):
    """AFTER hook on OpenAIServingChat._convert_to_internal_request."""
    try:
        adapted, _ = result
        params = getattr(request, "custom_params", None)
        if not isinstance(params, dict) or not any(str(k).startswith("kvflow_") for k in params):
            return None
        from kvflow_agents.protocol import HintError, Hints
        from kvflow_agents.serving.policy import workflow_key

        try:  # (already scoped to the tenant by HintIntake when tenancy is on)
            hints = Hints.from_custom_params(params)
        except HintError:
            return None  # the scheduler counts and ignores it; the request proceeds
        if hints is None:
            return None
        sp = adapted.sampling_params
        if getattr(adapted, "routing_key", None) is None:
            adapted.routing_key = workflow_key(hints.workflow, hints.app)
        ids = getattr(adapted, "input_ids", None)
        text = getattr(adapted, "text", None)
        if (hints.fixed_messages and ((isinstance(ids, list) and ids) or isinstance(text, str))
                and isinstance(sp, dict) and FIXED_TOKENS_KEY not in (sp.get("custom_params") or {})):
            msgs = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                    for m in request.messages]
            tok = serving.tokenizer_manager.tokenizer
            if isinstance(ids, list) and ids:
                n = fixed_prefix_tokens(tok, msgs, hints.fixed_messages, ids)
            else:  # text-only models: SGLang sends the rendered text; its tokenizer runs later
                n = fixed_prefix_tokens_of_text(tok, msgs, hints.fixed_messages, text)
            if n > 0:
                cp = dict(sp.get("custom_params") or {})
                cp[FIXED_TOKENS_KEY] = n
                sp["custom_params"] = cp
    except Exception:  # advisory: never fail the request
        logger.exception("kvflow: chat hint processing failed")
    return None


# ------------------------------------------------------------------------------ routes
async def send_control(tokenizer_manager, msg: KVFlowControl) -> None:
    """Send a control message the way SGLang sends requests: the tokenizer manager's own
    (async) dispatch to the scheduler socket, wrapped for SGLang's IPC encoding."""
    from sglang.srt.managers.io_struct import async_sock_send, sock_send, wrap_as_pickle

    obj = wrap_as_pickle(msg)
    dispatch = getattr(tokenizer_manager, "_async_dispatch_to_scheduler", None)
    if dispatch is not None:
        await dispatch(obj)
        return
    sock = getattr(tokenizer_manager, "send_to_scheduler", None)
    if sock is None:
        raise RuntimeError("this SGLang tokenizer mode has no scheduler socket")
    import zmq.asyncio

    if isinstance(sock, zmq.asyncio.Socket):
        await async_sock_send(sock, obj)
    else:
        sock_send(sock, obj)


async def request_snapshot(tokenizer_manager, timeout: float = SNAPSHOT_TIMEOUT_S) -> dict:
    import zmq
    import zmq.asyncio

    path = os.path.join(tempfile.gettempdir(), f"kvflow-snap-{uuid.uuid4().hex}")
    addr = f"ipc://{path}"
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    try:
        await send_control(tokenizer_manager, KVFlowControl("snapshot", {}, addr))
        data = await asyncio.wait_for(sock.recv(), timeout)
        return json.loads(data)
    finally:
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def visible_snapshot(snap: dict, tenant) -> dict:
    """The scheduler's snapshot as ``tenant`` may see it: its workflows only, its own ids."""
    from kvflow_agents.serving.tenancy import visible_key

    if tenant is None:
        return snap
    wfs = {visible_key(k, tenant): v for k, v in (snap.get("workflows") or {}).items()}
    agents = [{**a, "workflow": visible_key(a["workflow"], tenant)} for a in snap.get("agents") or ()]
    return {**snap, "workflows": {k: v for k, v in wfs.items() if k is not None},
            "agents": [a for a in agents if a["workflow"] is not None]}


def add_routes(app, get_tokenizer_manager) -> None:
    from fastapi import Request
    from fastapi.responses import Response

    from kvflow_agents.protocol import HintError, Hints, HintsWire
    from kvflow_agents.serving.embedded.limits import BodyError, json_bytes, parse_json_body
    from kvflow_agents.serving.tenancy import TenantError, scope_params

    def reply(obj: dict, status: int = 200) -> Response:
        return Response(json_bytes(obj), status_code=status, media_type="application/json")

    def tenant_of(request):
        """(tenant, None) or (None, error response)."""
        try:
            return tenancy().authenticate(request.headers), None
        except TenantError as e:
            return None, reply({"error": str(e)}, e.status)

    async def post_hints(request: Request):
        tenant, err = tenant_of(request)
        if err is not None:
            return err
        if int(request.headers.get("content-length") or 0) > MAX_HINT_BODY:
            return reply({"error": f"body over {MAX_HINT_BODY} bytes"}, 413)
        raw = await request.body()
        if len(raw) > MAX_HINT_BODY:
            return reply({"error": f"body over {MAX_HINT_BODY} bytes"}, 413)
        try:
            body = parse_json_body(raw, skip=HintsWire.model_fields.keys())
            hints = Hints.from_custom_params(body) if isinstance(body, dict) else None
        except BodyError as e:
            return reply({"error": str(e)}, e.status)
        except HintError as e:
            return reply({"error": str(e), "key": e.key}, 400)
        if hints is None:
            return reply({"error": "no kvflow_* keys"}, 400)
        try:
            await send_control(get_tokenizer_manager(),
                               KVFlowControl("hints", scope_params(hints.to_custom_params(), tenant)))
        except Exception as e:
            return reply({"error": str(e)}, 503)
        return reply({"accepted": True, "workflow": hints.workflow, "event": hints.event})

    # this module uses postponed annotations; FastAPI needs the real class to inject Request
    post_hints.__annotations__["request"] = Request

    async def get_cache(request: Request):
        tenant, err = tenant_of(request)
        if err is not None:
            return err
        try:
            snap = await request_snapshot(get_tokenizer_manager())
        except asyncio.TimeoutError:
            return reply({"error": "scheduler did not answer"}, 504)
        except Exception as e:
            return reply({"error": str(e)}, 503)
        return reply(visible_snapshot(snap, tenant))

    get_cache.__annotations__["request"] = Request

    app.add_api_route("/kvflow/v1/hints", post_hints, methods=["POST"])
    app.add_api_route("/kvflow/v1/cache", get_cache, methods=["GET"])


# ------------------------------------------------------------------------------ gateway-proof intake
INTAKE_PATHS = ("/v1/chat/completions", "/v1/completions")


def intake(body: bytes, headers: dict, path: str) -> tuple[bytes, "dict | None"]:
    """(body to pass on, control payload of a hint-only completion or ``None``). Hints in
    ``metadata["kvflow"]`` (or with the workflow in the routing key) are merged into
    ``custom_params``; anything malformed or unhinted passes unchanged (advisory). With tenancy
    on, the hints are scoped to the caller's tenant (an unknown caller's are dropped)."""
    from kvflow_agents.protocol import HintError, Hints
    from kvflow_agents.serving.tenancy import TenantError, scope_params

    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, None
    if not isinstance(doc, dict):
        return body, None
    try:
        hints = Hints.from_request(doc, headers)
    except (HintError, ValueError, TypeError):
        return body, None  # the request proceeds; custom_params (if any) is counted downstream
    if hints is None:
        return body, None
    scoped = tenancy().enabled
    if scoped:
        try:
            tenant = tenancy().authenticate(headers)
        except TenantError:
            tenant = None
        if tenant is None:  # hints of an unknown tenant are dropped; the request proceeds
            cp = doc.get("custom_params")
            if isinstance(cp, dict):
                doc["custom_params"] = {k: v for k, v in cp.items() if not str(k).startswith("kvflow_")}
            if isinstance(doc.get("metadata"), dict):
                doc["metadata"] = {k: v for k, v in doc["metadata"].items() if k != "kvflow"}
            return json.dumps(doc).encode(), None
    if hints.event is not None and path == "/v1/completions":
        return body, scope_params(hints.to_custom_params(), tenant) if scoped else hints.to_custom_params()
    cp = doc.get("custom_params")
    if cp is not None and not isinstance(cp, dict):
        return body, None
    if not scoped and cp and Hints.from_custom_params(cp, workflow=hints.workflow) == hints:
        return body, None  # custom_params already carries them (a direct connection)
    merged = {**(cp or {}), **hints.to_custom_params()}
    doc["custom_params"] = scope_params(merged, tenant) if scoped else merged
    return json.dumps(doc).encode(), None


def hint_only_completion_response(model: str, event: str) -> bytes:
    import time

    return json.dumps({"id": f"cmpl-hint-{uuid.uuid4().hex[:12]}", "object": "text_completion",
                       "created": int(time.time()), "model": model,
                       "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                       "kvflow": {"event": event}}).encode()


class HintIntake:
    """ASGI middleware: :func:`intake` on POST ``/v1/chat/completions`` and ``/v1/completions``
    (the body is read once and replayed); everything else passes untouched."""

    def __init__(self, app, get_tokenizer_manager) -> None:
        self.app = app
        self.get_tokenizer_manager = get_tokenizer_manager

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in INTAKE_PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            new_body, control = intake(body, headers, scope["path"])
        except Exception:  # advisory: never fail the request
            logger.exception("kvflow: hint intake failed")
            new_body, control = body, None
        if control is not None:
            try:
                await send_control(self.get_tokenizer_manager(), KVFlowControl("hints", control))
                status, out = 200, hint_only_completion_response(
                    json.loads(body).get("model") or "default", control.get("kvflow_event", ""))
            except Exception as e:
                status, out = 503, json.dumps({"error": {"message": str(e), "type": "server_error"}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(out)).encode()),
                                    (b"x-kvflow-hints", b"accepted" if status == 200 else b"rejected")]})
            await send({"type": "http.response.body", "body": out})
            return
        if new_body is not body:
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(new_body)).encode())]}
        from kvflow_agents.serving.embedded.limits import replay_body
        await self.app(scope, replay_body(new_body, receive), send)


def before_launch_server(*args, **kwargs):
    """BEFORE hook on http_server.launch_server: add the routes and the hint intake to SGLang's
    FastAPI app."""
    global _routes_added
    if not _routes_added:
        from sglang.srt.entrypoints import http_server

        def tm():
            return http_server.get_global_state().tokenizer_manager
        add_routes(http_server.app, tm)
        try:
            http_server.app.add_middleware(HintIntake, get_tokenizer_manager=tm)
        except RuntimeError:  # the app already started (tests that reuse SGLang's module app)
            logger.warning("kvflow: SGLang's app already started; metadata hint intake not installed")
        _routes_added = True
    return None
