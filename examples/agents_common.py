"""What the three prebuilt-agent quickstarts share: a server to talk to, a ``ChatOpenAI`` whose
requests are logged as they leave (the kvflow hints they carry) and as they come back (the tool
calls, the server's verdict on the hints), and a tool-choice policy for small models.

* :func:`server` — ``--base-url`` if given, else ``kvflow serve --model smollm2-135m`` on a
  free port (stopped at the end).
* :class:`CallLog` — httpx event hooks on the client: per LLM call the agent, step, STE and
  predicted next agents from ``custom_params`` (added by ``kvflow.instrument``, not by this
  file), the tool calls in the response and the ``x-kvflow-hints`` header (``accepted``).
* :func:`tools_first` — a LangGraph dynamic model for ``create_react_agent``: ``tool_choice=
  "required"`` on the turn that answers the user, ``"none"`` once a tool has answered (the
  answer). A model as small as SmolLM2-135M never starts a ``<tool_call>`` on its own, and
  left on ``"auto"`` after a result it calls the same tool again and again; forced, the
  server's grammar makes every call valid. With a capable model, pass the ``ChatOpenAI`` itself.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

DEFAULT_MODEL = "smollm2-135m"


def add_server_args(ap: Any) -> None:
    ap.add_argument("--base-url", help="an OpenAI-compatible server (…/v1); default: start `kvflow serve`")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--max-tokens", type=int, default=64)


@contextlib.contextmanager
def server(base_url: Optional[str], model: str = DEFAULT_MODEL, extra: Sequence[str] = ()) -> Iterator[str]:
    """Yield a base URL: ``base_url``, or a ``kvflow serve`` started for the block."""
    if base_url:
        yield base_url
        return
    from kvflow_agents.bench.server import BenchServer

    srv = BenchServer(["--model", model, "--log-level", "warning", *extra])
    print(f"(starting kvflow serve --model {model} ...)", flush=True)
    srv.start()
    try:
        yield srv.base_url
    finally:
        srv.stop()


@dataclass
class Call:
    agent: Optional[str]
    step: Optional[int]
    ste: dict
    next: list
    tools_offered: list[str]
    tool_choice: Any
    tool_calls: list[dict] = field(default_factory=list)
    content: Optional[str] = None
    hints_header: Optional[str] = None
    status: Optional[int] = None


class CallLog:
    """Every chat completion the client sends: hints out, tool calls and hint verdict back."""

    def __init__(self, echo: bool = True) -> None:
        self.calls: list[Call] = []
        self.echo = echo
        self._lock = threading.Lock()

    def _on_request(self, request: Any) -> None:
        if not request.url.path.endswith("/chat/completions"):
            return
        body = json.loads(request.content)
        hints = body.get("custom_params") or {}
        call = Call(hints.get("kvflow_agent"), hints.get("kvflow_step"), hints.get("kvflow_ste") or {},
                    hints.get("kvflow_next") or [],
                    [t["function"]["name"] for t in body.get("tools") or []], body.get("tool_choice"))
        request.extensions["kvflow_call"] = call
        with self._lock:
            self.calls.append(call)

    def _on_response(self, response: Any) -> None:
        call = response.request.extensions.get("kvflow_call")
        if call is None:
            return
        response.read()
        call.status = response.status_code
        call.hints_header = response.headers.get("x-kvflow-hints")
        try:
            msg = response.json()["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            return
        call.content = msg.get("content")
        call.tool_calls = [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                           for t in msg.get("tool_calls") or []]
        if self.echo:
            ste = " ".join(f"{a}={'·' if v is None else v}" for a, v in call.ste.items())
            what = ", ".join(f"{t['name']}({t['arguments']})" for t in call.tool_calls) or repr((call.content or "")[:70])
            print(f"step {call.step!s:>2}  {call.agent or '?':<24} -> {what}\n"
                  f"         STE {ste}\n         next {call.next}  hints: {call.hints_header}")

    def client(self, **kw: Any) -> Any:
        """An ``httpx`` client (the library the ``openai`` SDK uses) with the hooks."""
        import importlib

        from kvflow_agents.transport import default_http_library

        lib = importlib.import_module(default_http_library())
        return lib.Client(event_hooks={"request": [self._on_request], "response": [self._on_response]},
                          timeout=600, **kw)

    @property
    def all_hinted(self) -> bool:
        """Every call carried hints, and the server accepted them."""
        return bool(self.calls) and all(c.agent and c.hints_header == "accepted" for c in self.calls)


def chat_model(base_url: str, model: str, log: CallLog, api_key: str = "none", max_tokens: int = 64) -> Any:
    """An ordinary ``ChatOpenAI`` (greedy, so a run is repeatable), logging through ``log``."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=base_url, api_key=api_key, temperature=0, max_tokens=max_tokens,
                      max_retries=0, timeout=600, http_client=log.client())


def tools_first(llm: Any, tools: Sequence[Any]) -> Any:
    """A dynamic model for ``create_react_agent(model=tools_first(llm, tools), tools=tools)``:
    on the user's turn a tool call is required (any tool, hand-offs included); just handed off
    to, one of the agent's own tools is required (OpenAI's ``allowed_tools``: no hand-off
    straight back); after a tool result, ``"none"``: the answer. The tool list is the same in
    every request, so the agent's cached prefix never changes."""
    from langchain_core.messages import HumanMessage, ToolMessage

    from kvflow_agents.adapters.langgraph_asg import HANDOFF_KEY

    own = [t.name for t in tools if HANDOFF_KEY not in (getattr(t, "metadata", None) or {})]
    required = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    work = llm.bind_tools(tools, parallel_tool_calls=False, tool_choice={
        "type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": n}} for n in own]}})
    answer = llm.bind_tools(tools, tool_choice="none")

    def choose(state: Any, runtime: Any) -> Any:
        msgs = state["messages"] if isinstance(state, dict) else state.messages
        last = msgs[-1] if msgs else None
        if isinstance(last, HumanMessage):
            return required
        if isinstance(last, ToolMessage) and (getattr(last, "response_metadata", None) or {}).get(HANDOFF_KEY) \
                or str(getattr(last, "content", "")).startswith("Successfully transferred to"):
            return work if own else answer
        return answer

    return choose


def check_tool_calls(calls: Sequence[Call], tools: Sequence[Any]) -> list[str]:
    """Problems with the tool calls the server returned (empty: every call names a tool that was
    offered, and its arguments parse and validate against that tool's schema, as LangChain
    checks them before running the tool)."""
    by_name = {t.name: t for t in tools}
    bad = []
    for c in calls:
        for t in c.tool_calls:
            if t["name"] not in c.tools_offered or t["name"] not in by_name:
                bad.append(f"{c.agent}: {t['name']} was not offered")
                continue
            try:
                by_name[t["name"]].tool_call_schema.model_validate(json.loads(t["arguments"]))
            except Exception as e:  # noqa: BLE001 — reported, not raised
                bad.append(f"{c.agent}: {t['name']}({t['arguments']}): {e}")
    return bad


def main(doc: str, run: Any, question: str, argv: Optional[list[str]] = None) -> int:
    """A quickstart's command line: server options and ``--question``; runs ``run(base_url,
    model, question, ...)`` and prints the graph, the conversation and the hint summary."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_server_args(ap)
    ap.add_argument("--question", default=question)
    args = ap.parse_args(argv)
    with server(args.base_url, args.model) as base_url:
        res = run(base_url, args.model, args.question, api_key=args.api_key, max_tokens=args.max_tokens)
    print("Agent Step Graph:", ", ".join(res["app"].kvflow_graph.agents))
    for m in res["messages"]:
        calls = getattr(m, "tool_calls", None)
        print(f"{getattr(m, 'name', None) or m.type:>28}: {calls if calls else m.content}")
    log = res["log"]
    if res.get("active"):
        print(f"active agent at the end: {res['active']}")
    print(f"done: {len(log.calls)} LLM calls, hints on every call accepted: {log.all_hinted}")
    return 0
