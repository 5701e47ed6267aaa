"""OpenAI request parsing and response shapes for the embedded server (no FastAPI here).

Parsing is strict where a wrong value changes the answer (``n``, ``max_tokens``, ``temperature``,
``top_p``, ``stop``, ``messages``) and lenient elsewhere: unknown fields are ignored, as OpenAI
clients send many. Errors raise :class:`APIError`, rendered with OpenAI's error schema
``{"error": {"message", "type", "param", "code"}}``.

Hints (:func:`parse_hints`) never fail a request: malformed hints (``custom_params`` or
``metadata["kvflow"]``) come back as a rejection reason, which the server logs, counts and reports in the ``x-kvflow-hints`` header.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvflow_agents.protocol import HintError, Hints

from .scheduler import Completion, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict] = None
    logprobs: Optional[Any] = None
    custom_params: Any = None           # hints: parsed separately, never fails the request
    ignore_eos: bool = False            # extension (as in SGLang/vLLM), for benchmarks

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, stop=stop,
                              seed=self.seed, ignore_eos=self.ignore_eos)

    def check(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, "n: only n=1 is supported", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        sp = self.sampling()
        try:
            SamplingParams(**{**sp.__dict__, "max_tokens": sp.max_tokens or 1}).validate()
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict]]] = None
    name: Optional[str] = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(include={"role", "content", "name"}, exclude_none=True) for m in self.messages]


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    echo: Optional[bool] = False


def parse(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), param=loc or None) from None
    req.check()
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
        if isinstance(p, list) and not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
    return req


def prompt_kwargs(req: CompletionRequest) -> dict:
    p = req.prompt
    if isinstance(p, str):
        return {"prompt": p}
    if p and isinstance(p[0], str):
        return {"prompt": p[0]}
    return {"prompt_ids": p}


def parse_hints(body: Mapping[str, Any], headers: Mapping[str, str], *,
                allow_event: bool = False) -> tuple[Optional[Hints], Optional[str]]:
    """(hints, None), (None, None) when there are none, or (None, reason) when malformed.
    Every channel (``custom_params``, ``metadata["kvflow"]``, headers): :meth:`Hints.from_request`.
    ``allow_event``: a hint-only completion (``/v1/completions``) may carry ``kvflow_event``."""
    try:
        h = Hints.from_request(body, headers)
        if h is not None and h.event is not None and not allow_event:
            raise HintError("kvflow_event", "only valid on POST /kvflow/v1/hints or /v1/completions")
        return h, None
    except HintError as e:
        return None, f"{e.key}: {e.reason}"
    except (ValidationError, ValueError, TypeError) as e:
        return None, f"custom_params: {type(e).__name__}"


def header_safe(reason: str, limit: int = 200) -> str:
    s = reason.encode("ascii", "backslashreplace").decode("ascii")
    s = "".join(c if 32 <= ord(c) < 127 else " " for c in s)
    return s[:limit]


# ---------------------------------------------------------------- responses
def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
            "kvflow": c.usage_kvflow()}


def finish_reason(c: Completion) -> str:
    return c.finish_reason if c.finish_reason in ("stop", "length") else "stop"


def chat_response(c: Completion, model: str) -> dict:
    return {"id": f"chatcmpl-{c.id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": finish_reason(c)}],
            "usage": usage(c)}


def completion_response(c: Completion, model: str) -> dict:
    return {"id": f"cmpl-{c.id}", "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish_reason(c)}],
            "usage": usage(c)}


def chat_chunk(rid: str, model: str, created: int, *, delta: dict, finish: Optional[str] = None,
               use: Optional[dict] = None) -> dict:
    out = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
           "model": model, "system_fingerprint": None,
           "choices": [] if use is not None else
           [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def completion_chunk(rid: str, model: str, created: int, *, text: str, finish: Optional[str] = None,
                     use: Optional[dict] = None) -> dict:
    out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None,
           "choices": [] if use is not None else
           [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out
