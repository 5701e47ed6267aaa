"""OpenAI request parsing and response shapes for the embedded server (no FastAPI here).

Parsing is strict where OpenAI's API is: JSON types are checked, not coerced (``"temperature":
"0"``, ``"stream": "yes"``, ``"max_tokens": 1.5`` or ``true`` are 400, see :data:`FIELD_TYPES`),
``model`` is required (an unknown one is 404, checked by the server), messages follow their
role's rules (a ``tool`` message needs ``tool_call_id``, user/system need ``content``, content
parts are text), values are in range (``n``, ``max_tokens``, ``temperature``, ``top_p``,
``stop``, penalties, ``logprobs``, ``tools``/``tool_choice``, ``response_format``). It is
lenient where OpenAI is: unknown fields are ignored, as OpenAI clients send many. Errors raise
:class:`APIError`, rendered with OpenAI's error schema
``{"error": {"message", "type", "param", "code"}}``.

Structured output (:mod:`.grammar`): ``tools`` + ``tool_choice`` (``auto`` / ``required`` /
named / ``none``, ``parallel_tool_calls``), ``response_format`` (``json_object``,
``json_schema``), SGLang's ``regex`` / ``ebnf``. :class:`ChoiceRenderer` turns a choice's output
into OpenAI's shapes: ``message.tool_calls`` + ``finish_reason: "tool_calls"``, stream deltas
with ``tool_calls[{index, id, type, function}]``, ``logprobs.content[{token, logprob, bytes,
top_logprobs}]`` (chat) or the legacy ``tokens/token_logprobs/top_logprobs/text_offset``
(completions). ``n`` up to :data:`MAX_N` choices (sampled as separate requests that share the
prompt's cached prefix).

Hints (:func:`parse_hints`) never fail a request: malformed hints (``custom_params`` or
``metadata["kvflow"]``) come back as a rejection reason, which the server logs, counts and reports in the ``x-kvflow-hints`` header.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from kvflow_agents.protocol import HintError, Hints

from .scheduler import Completion, SamplingParams

MAX_N = 8                  # choices per request (``n``); more is a 400 naming the limit


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_INT, _NUM, _BOOL, _STR, _LIST, _OBJ = "integer", "number", "boolean", "string", "array", "object"
# JSON types OpenAI accepts per request field (null is accepted too: the field is then unset).
# Checked before pydantic, which would coerce "0" -> 0.0, 1.0 -> 1 and true -> 1.
FIELD_TYPES: dict[str, tuple[str, ...]] = {
    "model": (_STR,), "max_tokens": (_INT,), "max_completion_tokens": (_INT,), "n": (_INT,),
    "temperature": (_NUM,), "top_p": (_NUM,), "seed": (_INT,), "stream": (_BOOL,),
    "stop": (_STR, _LIST), "stream_options": (_OBJ,), "logprobs": (_BOOL, _INT), "top_logprobs": (_INT,),
    "presence_penalty": (_NUM,), "frequency_penalty": (_NUM,), "logit_bias": (_OBJ,),
    "user": (_STR,), "echo": (_BOOL,), "best_of": (_INT,), "suffix": (_STR,),
    "tools": (_LIST,), "tool_choice": (_STR, _OBJ), "parallel_tool_calls": (_BOOL,),
    "response_format": (_OBJ,), "metadata": (_OBJ,), "store": (_BOOL,),
    "messages": (_LIST,), "prompt": (_STR, _LIST), "ignore_eos": (_BOOL,),
}


def json_type(v: Any) -> str:
    if isinstance(v, bool):
        return _BOOL
    if isinstance(v, int):
        return _INT
    if isinstance(v, float):
        return _NUM
    return {str: _STR, list: _LIST, dict: _OBJ}.get(type(v), type(v).__name__)


def check_field_types(body: Mapping[str, Any]) -> None:
    """400 for a known field of the wrong JSON type (an integer is also a number)."""
    for key, allowed in FIELD_TYPES.items():
        v = body.get(key)
        if v is None:
            continue
        t = json_type(v)
        if t in allowed or (t == _INT and _NUM in allowed):
            continue
        raise APIError(400, f"Invalid type for '{key}': expected {' or '.join(allowed)}, got {t}",
                       param=key, code="invalid_type")
    p = body.get("prompt")
    if isinstance(p, list) and not (all(type(x) is int for x in p) or all(isinstance(x, str) for x in p)):
        raise APIError(400, "Invalid type for 'prompt': a string, a list of strings or a list of "
                       "token ids", param="prompt", code="invalid_type")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
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
    top_logprobs: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None   # extension (vLLM/SGLang)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict] = None
    regex: Optional[str] = None                  # extension (SGLang)
    ebnf: Optional[str] = None                   # extension (SGLang)
    custom_params: Any = None           # hints: parsed separately, never fails the request
    ignore_eos: bool = False            # extension (as in SGLang/vLLM), for benchmarks

    def grammar_spec(self) -> Any:
        from .grammar import GrammarError, spec_for_request
        if "_spec" not in self.__dict__:
            try:
                self.__dict__["_spec"] = spec_for_request(
                    tools=getattr(self, "tools", None), tool_choice=getattr(self, "tool_choice", None),
                    parallel_tool_calls=getattr(self, "parallel_tool_calls", None),
                    response_format=self.response_format, regex=self.regex, ebnf=self.ebnf)
            except GrammarError as e:
                raise APIError(400, str(e), param=e.param) from None
        return self.__dict__["_spec"]

    def logprob_settings(self) -> tuple[bool, int]:
        """``(logprobs, top_logprobs)`` — chat: a bool + ``top_logprobs``."""
        lp = self.logprobs
        if lp not in (None, False, True):
            raise APIError(400, "logprobs: must be a boolean (use top_logprobs for alternatives)",
                           param="logprobs")
        return bool(lp), int(self.top_logprobs or 0)

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        lp, top = self.logprob_settings()
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, stop=stop,
                              seed=self.seed, ignore_eos=self.ignore_eos,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              presence_penalty=self.presence_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=bias, logprobs=lp, top_logprobs=top, grammar=self.grammar_spec())

    def choice_seed(self, i: int) -> Optional[int]:
        """Choice ``i`` of ``n`` samples with its own seed (``seed + i`` when one is given)."""
        return None if self.seed is None else self.seed + i

    @model_validator(mode="before")
    @classmethod
    def _json_types(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            check_field_types(data)
        return data

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true",
                           param="stream_options")
        n = 1 if self.n is None else self.n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise APIError(400, f"n: must be an integer in 1..{MAX_N} (this server samples at most "
                                f"{MAX_N} choices per request)", param="n")
        sp = self.sampling()
        if n > 1 and sp.temperature == 0:
            raise APIError(400, "n: more than one choice needs temperature > 0 (greedy choices are "
                                "identical)", param="n")
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
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _role_rules(self) -> "ChatMessage":
        """OpenAI's per-role rules: a tool result names its call, a user/system/developer
        message has content, content parts are text (this server's models read text only)."""
        extra = self.model_extra or {}
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("missing_tool_call_id", "a tool message needs a string tool_call_id")
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise PydanticCustomError("missing_content", "a {role} message needs content",
                                      {"role": self.role})
        if self.role == "assistant" and self.content is None and not (
                self.tool_calls or extra.get("function_call")):
            raise PydanticCustomError("missing_content",
                                      "an assistant message needs content or tool_calls")
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise PydanticCustomError(
                        "unsupported_content",
                        "content.{i}: only text parts are supported, got type {t}",
                        {"i": i, "t": repr(part.get("type"))})
        return self


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(include={"role", "content", "name", "tool_calls", "tool_call_id"},
                             exclude_none=True) for m in self.messages]


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    echo: Optional[bool] = False

    def logprob_settings(self) -> tuple[bool, int]:
        """``(logprobs, top)`` — completions: ``logprobs`` is the number of alternatives (0..5)."""
        lp = self.logprobs
        if lp is None or lp is False:
            return False, 0
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5:
            raise APIError(400, "logprobs: must be an integer in 0..5", param="logprobs")
        return True, lp


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
    """A header value h11 will send: printable ASCII, no surrounding spaces, bounded."""
    from .limits import header_value
    return header_value(reason, limit).decode("ascii")


# ---------------------------------------------------------------- responses
def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
            "kvflow": c.usage_kvflow()}


def finish_reason(c: Completion) -> str:
    return c.finish_reason if c.finish_reason in ("stop", "length") else "stop"


def usage_n(cs: list[Completion]) -> dict:
    """Usage of ``n`` choices of one prompt: the prompt counts once (as OpenAI bills it)."""
    u = usage(cs[0])
    if len(cs) > 1:
        u["completion_tokens"] = sum(c.completion_tokens for c in cs)
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


def chat_response_n(cs: list[Completion], model: str, renderers: list["ChoiceRenderer"]) -> dict:
    choices = []
    for i, (c, r) in enumerate(zip(cs, renderers)):
        msg, fr = r.message(c)
        choices.append({"index": i, "message": msg, "logprobs": r.logprobs(c.logprobs),
                        "finish_reason": fr})
    return {"id": f"chatcmpl-{cs[0].id}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None, "choices": choices, "usage": usage_n(cs)}


def completion_response_n(cs: list[Completion], model: str, renderers: list["ChoiceRenderer"]) -> dict:
    return {"id": f"cmpl-{cs[0].id}", "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "text": c.text, "logprobs": r.logprobs(c.logprobs),
                         "finish_reason": finish_reason(c)} for i, (c, r) in enumerate(zip(cs, renderers))],
            "usage": usage_n(cs)}


class ChoiceRenderer:
    """One choice's output in OpenAI's shapes (whole or streamed). ``tool_names``: parse tool
    calls (the request forced or allowed them); ``tokenizer``: renders logprob tokens;
    ``skip_ids``: tokens left out of logprobs (EOS)."""

    def __init__(self, *, chat: bool = True, tool_names: Optional[list[str]] = None,
                 tokenizer: Any = None, skip_ids: Any = ()) -> None:
        from .tool_calls import ToolCallStream

        self.chat = chat
        self.tool_names = tool_names
        self.tokenizer = tokenizer
        self.skip_ids = frozenset(skip_ids)
        self.stream = ToolCallStream(tool_names) if tool_names is not None else None
        self._offset = 0

    # -- whole
    def message(self, c: Completion) -> tuple[dict, str]:
        from .tool_calls import parse_tool_calls

        fr = finish_reason(c)
        if self.tool_names is None:
            return {"role": "assistant", "content": c.text}, fr
        content, calls = parse_tool_calls(c.text, self.tool_names)
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [call.as_openai() for call in calls]
            if fr == "stop":
                fr = "tool_calls"
        return msg, fr

    # -- stream
    def deltas(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.stream is None:
            return [{"content": text}]
        return self.stream.push(text)

    def final(self, c: Completion) -> tuple[list[dict], str]:
        fr = finish_reason(c)
        if self.stream is None:
            return [], fr
        out = self.stream.finish()
        if self.stream.calls and fr == "stop":
            fr = "tool_calls"
        return out, fr

    # -- logprobs
    def _token(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)

    def logprobs(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        entries = [e for e in entries if e.token_id not in self.skip_ids]
        if self.chat:
            def item(tid: int, lp: float) -> dict:
                tok = self._token(tid)
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            return {"content": [{**item(e.token_id, e.logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
                    "refusal": None}
        toks = [self._token(e.token_id) for e in entries]
        offsets = []
        for t in toks:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": toks, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}


def chat_chunk(rid: str, model: str, created: int, *, delta: dict, finish: Optional[str] = None,
               use: Optional[dict] = None, index: int = 0, logprobs: Optional[dict] = None) -> dict:
    out = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
           "model": model, "system_fingerprint": None,
           "choices": [] if use is not None else
           [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out


def completion_chunk(rid: str, model: str, created: int, *, text: str, finish: Optional[str] = None,
                     use: Optional[dict] = None, index: int = 0, logprobs: Optional[dict] = None) -> dict:
    out = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
           "system_fingerprint": None,
           "choices": [] if use is not None else
           [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:
        out["usage"] = use
    return out
