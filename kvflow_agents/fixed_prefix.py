"""Where an agent's fixed prompt ends in a chat request: the fixed-prefix boundary.

The boundary is counted in *messages* (the server owns the chat template and turns it into a
token length). Rules, first match wins:

1. **kvflow marker** — a content part carrying ``"kvflow_fixed_end": true``::

       {"role": "user", "content": [
           {"type": "text", "text": "Tools: ...", "kvflow_fixed_end": True}]}

   The message holding the *last* such part ends the fixed prefix (boundary = its index + 1).
   The key is not part of the OpenAI API, so it is stripped from the body before sending.
   LangChain users write the same part in a message's ``content`` list; a plain
   ``"kvflow_fixed_end": true`` key on a message dict works too (also stripped).
2. **OpenAI's** ``prompt_cache_breakpoint`` on a content part (``{"mode": "explicit"}``,
   "marks the exact end of a reusable prompt prefix"). The message holding the *first* one
   ends the fixed prefix: later breakpoints usually mark a growing conversation, not the
   agent's own prompt. The part is left untouched (servers that support it use it).
3. Otherwise the leading run of ``system`` / ``developer`` messages.

Explicit hints (``kvflow.hints(fixed_messages=N)``) bypass all three.
"""

from __future__ import annotations

from typing import Any, Optional

MARKER = "kvflow_fixed_end"
OPENAI_BREAKPOINT = "prompt_cache_breakpoint"
FIXED_ROLES = ("system", "developer")


def _parts(msg: Any) -> list[Any]:
    content = msg.get("content") if isinstance(msg, dict) else None
    return content if isinstance(content, list) else []


def analyze(messages: Any) -> tuple[Optional[int], Optional[list[Any]]]:
    """``(fixed_messages, cleaned_messages)`` for an OpenAI ``messages`` list.

    ``fixed_messages`` is ``None`` when ``messages`` is not a list. ``cleaned_messages`` is a
    copy without kvflow markers, or ``None`` when there was nothing to strip (the common case:
    no copy is made)."""
    if not isinstance(messages, list):
        return None, None
    kvflow_end: Optional[int] = None
    openai_end: Optional[int] = None
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get(MARKER):
            kvflow_end = i + 1
        for part in _parts(msg):
            if not isinstance(part, dict):
                continue
            if part.get(MARKER):
                kvflow_end = i + 1
            if openai_end is None and part.get(OPENAI_BREAKPOINT):
                openai_end = i + 1
    if kvflow_end is not None:
        fixed = kvflow_end
    elif openai_end is not None:
        fixed = openai_end
    else:
        fixed = 0
        for msg in messages:
            if isinstance(msg, dict) and msg.get("role") in FIXED_ROLES:
                fixed += 1
            else:
                break
    return fixed, strip_markers(messages)


def strip_markers(messages: list[Any]) -> Optional[list[Any]]:
    """A copy of ``messages`` without ``kvflow_fixed_end`` keys, or ``None`` if none occur."""
    dirty = any(
        (isinstance(m, dict) and MARKER in m)
        or any(isinstance(p, dict) and MARKER in p for p in _parts(m))
        for m in messages)
    if not dirty:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if k != MARKER}
        parts = _parts(m)
        if parts:
            m["content"] = [{k: v for k, v in p.items() if k != MARKER} if isinstance(p, dict) else p
                            for p in parts]
        out.append(m)
    return out


def marker_part(text: str) -> dict[str, Any]:
    """A text content part that ends the fixed prefix: ``{"type": "text", "text": text,
    "kvflow_fixed_end": True}`` (stripped before the request leaves the client)."""
    return {"type": "text", "text": text, MARKER: True}


def apply(doc: dict[str, Any]) -> Optional[int]:
    """Analyze ``doc["messages"]`` in place: strip markers, return the boundary (or ``None``
    for a body without ``messages``, e.g. ``/completions``)."""
    fixed, cleaned = analyze(doc.get("messages"))
    if cleaned is not None:
        doc["messages"] = cleaned
    return fixed
