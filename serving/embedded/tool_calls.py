"""The tool-call wire format of the embedded engine, and its parsers (complete and streaming).

One format, Hermes/Qwen-2.5 style (the one SGLang's ``qwen25`` parser and xgrammar's
``"qwen_3"`` structural tag implement), used in three places that must agree:

* the chat template (``model/tokenizer.py``) lists the tools inside ``<tools></tools>`` in the
  system block and renders earlier assistant calls and ``role: tool`` results in it;
* the grammar (``grammar.py``) constrains generation to it (xgrammar structural tag);
* the parsers here turn the generated text back into OpenAI ``tool_calls``::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

Several blocks in a row are parallel calls. Text outside the blocks is the message ``content``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str            # a JSON document, as OpenAI sends it (a string)
    id: str = field(default_factory=new_call_id)

    def as_openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _parse_block(body: str) -> Optional[ToolCall]:
    """``{"name": ..., "arguments": {...}}`` -> a :class:`ToolCall` (arguments re-serialized
    compactly); ``None`` when the block is not a call (then it stays text)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(doc["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: Optional[Iterable[str]] = None) -> tuple[Optional[str], list[ToolCall]]:
    """``(content, calls)`` from a whole generation. A block that does not parse as a call to a
    known function (``names``; any name when ``None``) is left in the content as written."""
    known = set(names) if names is not None else None
    calls: list[ToolCall] = []
    parts: list[str] = []
    pos = 0
    while True:
        i = text.find(CALL_OPEN, pos)
        if i < 0:
            parts.append(text[pos:])
            break
        j = text.find(CALL_CLOSE, i + len(CALL_OPEN))
        if j < 0:  # unterminated (max_tokens): not a call
            parts.append(text[pos:])
            break
        call = _parse_block(text[i + len(CALL_OPEN):j].strip())
        if call is not None and (known is None or call.name in known):
            parts.append(text[pos:i])
            calls.append(call)
        else:
            parts.append(text[pos:j + len(CALL_CLOSE)])
        pos = j + len(CALL_CLOSE)
    content = "".join(parts).strip() if calls else "".join(parts)
    return (content or None) if calls else content, calls


class ToolCallStream:
    """Incremental :func:`parse_tool_calls` for ``stream=True``.

    ``push(text) -> [delta, ...]`` where a delta is ``{"content": str}`` or a whole call
    ``{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`` (OpenAI's
    stream shape; clients concatenate ``arguments`` per index, and one chunk carrying all of it
    is valid). Text that could be the start of ``<tool_call>`` is held back until it is not;
    a call is emitted when its ``</tool_call>`` arrives. ``finish()`` flushes what is held
    (an unterminated block is content). ``calls`` counts the calls emitted.
    """

    def __init__(self, names: Optional[Iterable[str]] = None) -> None:
        self.names = set(names) if names is not None else None
        self.buf = ""
        self.calls = 0

    @staticmethod
    def _content(s: str) -> list[dict]:
        return [{"content": s}] if s else []

    def push(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            i = self.buf.find(CALL_OPEN)
            if i < 0:
                hold = 0
                for k in range(min(len(CALL_OPEN) - 1, len(self.buf)), 0, -1):
                    if self.buf.endswith(CALL_OPEN[:k]):
                        hold = k
                        break
                emit, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                out += self._content(emit)
                return out
            if i:
                out += self._content(self.buf[:i])
                self.buf = self.buf[i:]
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return out  # inside a block: wait for its end
            block = self.buf[:j + len(CALL_CLOSE)]
            self.buf = self.buf[j + len(CALL_CLOSE):]
            call = _parse_block(block[len(CALL_OPEN):-len(CALL_CLOSE)].strip())
            if call is not None and (self.names is None or call.name in self.names):
                out.append({"tool_calls": [call.as_openai(index=self.calls)]})
                self.calls += 1
            else:
                out += self._content(block)

    def finish(self) -> list[dict]:
        rest, self.buf = self.buf, ""
        return self._content(rest)


def tool_names(tools: Optional[list[dict]]) -> list[str]:
    return [t["function"]["name"] for t in tools or () if isinstance(t, dict) and t.get("function")]


def render_call(name: str, arguments: Any) -> str:
    """One call as the template writes it (``arguments``: a dict or its JSON string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # keep the string: the history shows what was sent
    return f'{CALL_OPEN}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{CALL_CLOSE}'
