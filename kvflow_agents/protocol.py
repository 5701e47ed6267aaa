"""Hints v1: what an instrumented app tells the serving engine with every LLM request.

On the wire the hints are one flat dict of ``kvflow_*`` keys, carried in the OpenAI request body
in two places (:data:`CHANNELS`; clients send both by default, servers read the first present):

- ``custom_params`` (the dict itself): what SGLang hands to ``Req`` unchanged; kept for direct
  connections;
- ``metadata["kvflow"]`` (the same dict as one compact JSON string, at most
  :data:`MAX_METADATA_CHARS` characters): OpenAI's ``metadata`` is a string-to-string map, the
  one extension field SGLang's gateway (``sglang-router`` / ``smg``) forwards on
  ``/v1/chat/completions`` in every version (0.3.2 rebuilds the body and drops
  ``custom_params``). With ``x-smg-routing-key`` (the workflow id) it routes and hints a workflow
  through the gateway; the key also stands in for ``kvflow_workflow`` when the dict lacks it.

The custom_params form: SGLang's ``custom_params`` accepts only scalars, lists of scalars and flat
dicts (it must stay msgpack-safe), so this form reaches SGLang's ``Req`` unchanged::

    {"custom_params": {"kvflow_v": 1, "kvflow_workflow": "thread-7", "kvflow_app": "peer",
                       "kvflow_agent": "planner", "kvflow_step": 3,
                       "kvflow_ste": {"planner": 0, "executor": 1, "reviewer": null},
                       "kvflow_next": ["executor"], "kvflow_fixed_messages": 1}}

``null`` in ``kvflow_ste`` means infinity: the agent cannot run again in this workflow, so its
cache may go first. Optional ``kvflow_tool_s`` (``{agent: seconds}``) says *when*: these agents
wait on a tool step expected to take that long (measured per tool by the client), so the server
keeps each one's last turn (prompt + what it generated, the start of its resumed turn) and brings
it back in time (``serving/policy/toolgap.py``). The ids are mirrored in headers ``X-KVFlow-Workflow`` / ``X-KVFlow-Agent``
for routers and logs (a gateway drops them). The same flat dict (plus ``kvflow_event``) is the
body of the server's out-of-band endpoint ``POST /kvflow/v1/hints`` for transitions that send no
LLM request. A gateway forwards no such route, so the same event also travels as a *hint-only
completion* (:func:`hint_only_completion`): ``POST /v1/completions`` with the event in the hints
and the routing key header; a kvflow server applies it and answers at once without running the
model, and the gateway routes it to the instance holding the workflow.

Hints are advisory. A server reads them with :meth:`Hints.from_request` (all channels; or
:meth:`Hints.from_custom_params` for one flat dict), which raises
:class:`HintError` naming the bad key; the server then ignores the hints and still answers.
Values from the wire are not trusted: ids and maps are bounded, STE values are clipped.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

PROTOCOL_VERSION = 1
PREFIX = "kvflow_"
HEADER_WORKFLOW = "X-KVFlow-Workflow"
HEADER_AGENT = "X-KVFlow-Agent"
HEADER_REJECTED = "x-kvflow-hints"  # response header: "rejected: <reason>"
# SGLang's model gateway (sgl-model-gateway) routes on this header: sending the workflow id
# keeps one workflow's requests, and so its agents' cached prefixes, on one instance.
HEADER_ROUTING_KEY = "x-smg-routing-key"

MAX_ID_LEN = 256
MAX_STE_AGENTS = 1024
MAX_STE = 1_000_000  # larger finite values are clipped; they mean "far away" anyway
MAX_STEP = 2**31 - 1
MAX_FIXED_MESSAGES = 4096
MAX_TOOL_S = 3600.0  # a longer tool wait is "no plan": the resume tag would expire anyway

EVENTS = ("transition", "end")

METADATA_KEY = "kvflow"
# One metadata value; far above a 10-agent workflow's ~400 characters. (OpenAI's own API caps a
# value at 512; SGLang's gateway enforces no length.) Clients trim the STE map to the agents
# closest to running to stay under it; servers refuse longer values unparsed.
MAX_METADATA_CHARS = 8192
CHANNELS = ("both", "metadata", "custom_params")


class HintError(ValueError):
    """Malformed hints. ``key`` names the offending wire key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.reason = message


_BAD_ID_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _check_id(key: str, value: Any, *, optional: bool = False) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise HintError(key, f"must be a non-empty string, got {type(value).__name__}")
    if len(value) > MAX_ID_LEN:
        raise HintError(key, f"longer than {MAX_ID_LEN} characters")
    if _BAD_ID_CHARS.search(value):  # ids end up in JSON, logs, headers and tables
        raise HintError(key, "contains a control character or a lone surrogate")
    return value


def _ste_value(key: str, agent: str, v: Any) -> float:
    if v is None:
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HintError(key, f"STE of {agent!r} must be an integer or null, got {v!r}")
    if isinstance(v, float):
        if math.isnan(v):
            raise HintError(key, f"STE of {agent!r} is NaN")
        if math.isinf(v):
            return math.inf if v > 0 else 0
    if v < 0:
        raise HintError(key, f"STE of {agent!r} is negative ({v})")
    return min(int(v), MAX_STE)


class Hints(BaseModel):
    """Hints v1 for one LLM request (or one out-of-band transition)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workflow: str = Field(description="One workflow instance: a LangGraph thread, an AutoGen run.")
    agent: str = Field(description="The agent sending this request.")
    step: int = Field(0, ge=0, description="Workflow step (Pregel super-step) of this request.")
    ste: dict[str, float] = Field(default_factory=dict,
                                  description="Steps-to-execution per agent; inf = never again.")
    next: list[str] = Field(default_factory=list, description="Agents expected to run next.")
    app: Optional[str] = Field(None, description="Shared by all instances of one app.")
    fixed_messages: Optional[int] = Field(
        None, ge=0, description="How many leading messages are the agent's fixed prompt.")
    event: Optional[Literal["transition", "end"]] = Field(
        None, description="Out-of-band only: 'end' releases the workflow.")
    tool_s: dict[str, float] = Field(
        default_factory=dict,
        description="Agents waiting on a tool step -> its expected seconds (they resume after it).")

    @field_validator("workflow", "agent")
    @classmethod
    def _ids(cls, v: str, info) -> str:
        return _check_id(PREFIX + info.field_name, v)  # type: ignore[return-value]

    @field_validator("ste", mode="before")
    @classmethod
    def _ste_none_is_inf(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return {a: (math.inf if x is None else x) for a, x in v.items()}
        return v

    # ---------------------------------------------------------------- wire form
    def to_custom_params(self) -> dict[str, Any]:
        """Flat ``kvflow_*`` keys; values are scalars, lists of scalars or flat dicts."""
        out: dict[str, Any] = {
            "kvflow_v": PROTOCOL_VERSION,
            "kvflow_workflow": self.workflow,
            "kvflow_agent": self.agent,
            "kvflow_step": self.step,
            "kvflow_ste": {a: (None if math.isinf(v) else int(v)) for a, v in self.ste.items()},
            "kvflow_next": list(self.next),
        }
        if self.app is not None:
            out["kvflow_app"] = self.app
        if self.fixed_messages is not None:
            out["kvflow_fixed_messages"] = self.fixed_messages
        if self.event is not None:
            out["kvflow_event"] = self.event
        if self.tool_s:
            out["kvflow_tool_s"] = {a: round(float(v), 4) for a, v in self.tool_s.items()}
        return out

    def headers(self) -> dict[str, str]:
        """Headers mirroring the ids, for routers and access logs (ASCII-safe); the workflow id
        doubles as the routing key of SGLang's gateway."""
        def safe(s: str) -> str:
            return s.encode("ascii", "backslashreplace").decode("ascii")[:MAX_ID_LEN]

        wf = safe(self.workflow)
        return {HEADER_WORKFLOW: wf, HEADER_AGENT: safe(self.agent), HEADER_ROUTING_KEY: wf}

    def to_metadata_value(self, extra: Mapping[str, Any] | None = None) -> str:
        """The compact JSON string carried in ``metadata["kvflow"]`` (``extra``: more flat keys,
        e.g. ``kvflow_fixed_messages``). Over :data:`MAX_METADATA_CHARS` the STE map keeps the
        agents closest to running (an agent left out is "unknown", never "never again")."""
        return metadata_value({**self.to_custom_params(), **(extra or {})})

    @classmethod
    def from_custom_params(cls, params: Mapping[str, Any] | None, *,
                           workflow: Optional[str] = None) -> Optional["Hints"]:
        """Parse and validate wire hints. ``None`` when the request carries no ``kvflow_*``
        key at all (an uninstrumented client); :class:`HintError` when they are malformed.
        Unknown ``kvflow_*`` keys are ignored (forward compatibility within v1). ``workflow``
        (the routing key) is used when ``kvflow_workflow`` is absent."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise HintError("custom_params", f"must be an object, got {type(params).__name__}")
        if not any(isinstance(k, str) and k.startswith(PREFIX) for k in params):
            return None
        v = params.get("kvflow_v", None)
        if v is None:
            raise HintError("kvflow_v", "missing protocol version")
        if isinstance(v, bool) or v != PROTOCOL_VERSION:
            raise HintError("kvflow_v", f"unsupported protocol version {v!r} (this server speaks {PROTOCOL_VERSION})")
        workflow = _check_id("kvflow_workflow", params.get("kvflow_workflow", workflow))
        agent = _check_id("kvflow_agent", params.get("kvflow_agent"))
        app = _check_id("kvflow_app", params.get("kvflow_app"), optional=True)

        step = params.get("kvflow_step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise HintError("kvflow_step", f"must be a non-negative integer, got {step!r}")
        step = min(step, MAX_STEP)

        raw_ste = params.get("kvflow_ste", {})
        if not isinstance(raw_ste, Mapping):
            raise HintError("kvflow_ste", f"must be an object of agent -> int|null, got {type(raw_ste).__name__}")
        if len(raw_ste) > MAX_STE_AGENTS:
            raise HintError("kvflow_ste", f"more than {MAX_STE_AGENTS} agents")
        ste = {}
        for a, val in raw_ste.items():
            _check_id("kvflow_ste", a)
            ste[a] = _ste_value("kvflow_ste", a, val)

        nxt = params.get("kvflow_next", [])
        if not isinstance(nxt, list) or len(nxt) > MAX_STE_AGENTS:
            raise HintError("kvflow_next", f"must be a list of at most {MAX_STE_AGENTS} agent names")
        nxt = [_check_id("kvflow_next", a) for a in nxt]

        fixed = params.get("kvflow_fixed_messages", None)
        if fixed is not None:
            if isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 0:
                raise HintError("kvflow_fixed_messages", f"must be a non-negative integer, got {fixed!r}")
            fixed = min(fixed, MAX_FIXED_MESSAGES)

        event = params.get("kvflow_event", None)
        if event is not None and event not in EVENTS:
            raise HintError("kvflow_event", f"must be one of {EVENTS}, got {event!r}")

        raw_tool = params.get("kvflow_tool_s", None) or {}
        if not isinstance(raw_tool, Mapping) or len(raw_tool) > MAX_STE_AGENTS:
            raise HintError("kvflow_tool_s", f"must be an object of at most {MAX_STE_AGENTS} agent -> seconds")
        tool_s = {}
        for a, val in raw_tool.items():
            _check_id("kvflow_tool_s", a)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val < 0:
                raise HintError("kvflow_tool_s", f"{a}: must be a non-negative number of seconds, got {val!r}")
            tool_s[a] = min(float(val), MAX_TOOL_S)
        return cls(workflow=workflow, agent=agent, step=step, ste=ste, next=nxt, app=app,  # type: ignore[arg-type]
                   fixed_messages=fixed, event=event, tool_s=tool_s)

    @classmethod
    def from_metadata(cls, metadata: Any, *, workflow: Optional[str] = None) -> Optional["Hints"]:
        """Hints from OpenAI ``metadata`` (``{"kvflow": "<compact JSON>"}``), or ``None``."""
        doc = metadata_hints(metadata)
        return None if doc is None else cls.from_custom_params(doc, workflow=workflow)

    @classmethod
    def from_request(cls, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
                     ) -> Optional["Hints"]:
        """Hints from an OpenAI request, whatever channel carried them: ``custom_params``, else
        ``metadata["kvflow"]``, else the ``X-KVFlow-Workflow`` + ``X-KVFlow-Agent`` headers.
        The workflow id falls back to ``X-KVFlow-Workflow``, then ``x-smg-routing-key``.
        ``headers`` must be case-insensitive or lower-cased. Raises :class:`HintError`."""
        if not isinstance(body, Mapping):
            raise HintError("body", f"must be an object, got {type(body).__name__}")
        headers = headers or {}
        header_wf = headers.get(HEADER_WORKFLOW.lower()) or None
        routing_wf = header_wf or headers.get(HEADER_ROUTING_KEY) or None
        h = cls.from_custom_params(body.get("custom_params"), workflow=routing_wf)
        if h is None:
            h = cls.from_metadata(body.get("metadata"), workflow=routing_wf)
        if h is None:
            agent = headers.get(HEADER_AGENT.lower())
            if header_wf and agent:
                h = cls(workflow=header_wf, agent=agent)
        return h

    @classmethod
    def from_request_body(cls, body: Mapping[str, Any]) -> Optional["Hints"]:
        """Hints from an OpenAI request body (``custom_params`` or ``metadata``), or ``None``."""
        return cls.from_request(body)


def metadata_value(flat: Mapping[str, Any]) -> str:
    """``flat`` (a custom_params dict) as one compact JSON string of at most
    :data:`MAX_METADATA_CHARS` characters: the STE map is cut to the agents closest to running
    (then ``kvflow_next``) until it fits."""
    def dump(d: Mapping[str, Any]) -> str:
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False)

    out = dump(flat)
    if len(out) <= MAX_METADATA_CHARS:
        return out
    doc = dict(flat)
    ste = doc.get("kvflow_ste") or {}
    order = sorted(ste, key=lambda a: (math.inf if ste[a] is None else ste[a], a))
    lo, hi = 0, len(order)  # the most agents that fit (binary search on the prefix length)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        doc["kvflow_ste"] = {a: ste[a] for a in order[:mid]}
        if len(dump(doc)) <= MAX_METADATA_CHARS:
            lo = mid
        else:
            hi = mid - 1
    doc["kvflow_ste"] = {a: ste[a] for a in order[:lo]}
    while len(dump(doc)) > MAX_METADATA_CHARS and doc.get("kvflow_next"):
        doc["kvflow_next"] = doc["kvflow_next"][:-1]
    return dump(doc)


def metadata_hints(metadata: Any) -> Optional[dict[str, Any]]:
    """The flat hints dict inside OpenAI ``metadata``; ``None`` when there is none. Raises
    :class:`HintError` (key ``metadata.kvflow``) for a value that is not a bounded JSON object."""
    if not isinstance(metadata, Mapping) or METADATA_KEY not in metadata:
        return None
    raw = metadata[METADATA_KEY]
    key = f"metadata.{METADATA_KEY}"
    if not isinstance(raw, str):
        raise HintError(key, f"must be a JSON string, got {type(raw).__name__}")
    if len(raw) > MAX_METADATA_CHARS:
        raise HintError(key, f"longer than {MAX_METADATA_CHARS} characters")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise HintError(key, f"not valid JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise HintError(key, f"must encode a JSON object, got {type(doc).__name__}")
    return doc


def hint_only_completion(hints: "Hints", event: str, model: Optional[str] = None) -> dict[str, Any]:
    """Body of a hint-only completion: an out-of-band event (``"transition"`` / ``"end"``) sent
    as ``POST /v1/completions``, the one route every gateway forwards with its routing key. A
    kvflow server applies the hints and answers an empty completion without running the model;
    the hints ride in both channels so either survives the gateway."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}")
    flat = {**hints.to_custom_params(), "kvflow_event": event}
    body: dict[str, Any] = {"prompt": "", "max_tokens": 1, "temperature": 0,
                            "custom_params": flat,
                            "metadata": {METADATA_KEY: metadata_value(flat)}}
    if model:
        body["model"] = model
    return body


class HintsWire(BaseModel):
    """kvflow hints v1: one flat object, sent as the request's ``custom_params`` and/or as
    ``metadata["kvflow"]`` (this object as one compact JSON string of at most 8192 characters;
    the form SGLang's gateway forwards). ``kvflow_workflow`` may be left out when the request
    carries the ``x-smg-routing-key`` (or ``X-KVFlow-Workflow``) header: the header is the
    workflow id then. Schema file: ``kvflow_agents/schemas/hints_v1.schema.json``."""

    model_config = ConfigDict(extra="allow", title="kvflow hints v1")

    kvflow_v: Literal[1]
    kvflow_workflow: Optional[str] = Field(
        None, min_length=1, max_length=MAX_ID_LEN,
        description="workflow instance id; default: the x-smg-routing-key header")
    kvflow_agent: str = Field(min_length=1, max_length=MAX_ID_LEN)
    kvflow_app: Optional[str] = Field(None, min_length=1, max_length=MAX_ID_LEN)
    kvflow_step: int = Field(0, ge=0)
    kvflow_ste: dict[str, Optional[int]] = Field(
        default_factory=dict, max_length=MAX_STE_AGENTS,
        description="agent -> steps until it runs; null = never again (infinity)")
    kvflow_next: list[str] = Field(default_factory=list, max_length=MAX_STE_AGENTS)
    kvflow_fixed_messages: Optional[int] = Field(None, ge=0)
    kvflow_event: Optional[Literal["transition", "end"]] = None
    kvflow_tool_s: dict[str, float] = Field(
        default_factory=dict, max_length=MAX_STE_AGENTS,
        description="agents waiting on a tool step -> its expected duration in seconds")


SCHEMA_PATH = Path(__file__).parent / "schemas" / "hints_v1.schema.json"


def json_schema() -> dict[str, Any]:
    return HintsWire.model_json_schema()


def write_json_schema(path: Path = SCHEMA_PATH) -> None:
    path.write_text(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n")
