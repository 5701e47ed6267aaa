"""The requests of ``kvflow bench reliability``: how its checks build request bodies and hints,
and the seeded fuzz corpus (the same ``(seed, n)`` gives the same cases, in order).

A :class:`Case` says whether a correct server must answer it 200 (``valid``); the rest may get
a 4xx, none a 5xx or a dropped connection. Mixture (``fuzz_cases``): 42 % valid requests with
malformed hints in ``custom_params``, 5 % hints in headers, 20 % out-of-band hints, 33 %
mutated bodies (wrong types, bad messages, BOM, invalid UTF-8, truncated JSON, ``NaN``, deep
nesting, oversized fields, legacy completions).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

TINY = "tiny-random"


def hint(workflow: str, agent: str, ste: dict, **kw) -> dict:
    return {"kvflow_v": 1, "kvflow_workflow": workflow, "kvflow_agent": agent, "kvflow_ste": ste, **kw}


def chat_body(content: str, *, model: str = TINY, max_tokens: int = 2, system: Optional[str] = None,
              custom_params: Any = None, **extra) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, **extra}
    if custom_params is not None:
        body["custom_params"] = custom_params
    return body


def dumps(obj: Any) -> bytes:
    """JSON as a client would send it; lone surrogates travel as ``\\udXXX`` escapes."""
    return json.dumps(obj, ensure_ascii=True).encode()


# ================================================================ the fuzz corpus
@dataclass
class Case:
    kind: str
    path: str
    body: bytes
    valid: bool                      # a correct server must answer 200
    stream: bool = False
    headers: dict = field(default_factory=dict)


def _nasty(rng: random.Random) -> Any:
    pool = [" " * rng.randint(1, 400), "\t", "x" * rng.choice([257, 5000]), "é\u2028\u0000z", "w\ud800",
            "\udfff", "a\r\nX-Injected: 1", "<script>", "../../etc/passwd", "", "🙂" * 50, "1",
            -1, 0, 2**70, -(2**63), 1.5, 1e308, True, False, None, [], {}, [1, [2, [3]]],
            {"a": {"b": {"c": 1}}}, {f"agent-{i}": i for i in range(rng.choice([3, 1100, 2000]))},
            ["x"] * 1500, {"x": None}, {"\ud800": 1}, {"a": "b"}, {"a": -5}, {"a": 1.5}]
    v = rng.choice(pool)
    if isinstance(v, dict) and len(v) < 10 and rng.random() < 0.3:
        v = {**v, "kvflow_v": 1}
    return v


def fuzz_hints(rng: random.Random) -> Any:
    keys = ["kvflow_v", "kvflow_workflow", "kvflow_agent", "kvflow_app", "kvflow_step", "kvflow_ste",
            "kvflow_next", "kvflow_fixed_messages", "kvflow_event", "kvflow_future", "other"]
    if rng.random() < 0.1:
        return _nasty(rng)
    h = hint(f"wf-{rng.randint(0, 30)}", rng.choice(["a", "b", "planner"]),
             {"a": rng.randint(0, 3), "b": None}, kvflow_step=rng.randint(0, 9))
    for _ in range(rng.randint(1, 3)):
        h[rng.choice(keys)] = _nasty(rng)
    return h


_BAD_FIELDS = [("temperature", "0"), ("temperature", 5), ("temperature", -1), ("stream", "yes"),
               ("stream", 1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", 0),
               ("max_tokens", -3), ("max_tokens", 2**64), ("max_tokens", 10**9), ("seed", 2**64),
               ("seed", "1"), ("seed", 1.5), ("n", 2), ("n", "1"), ("stop", 5), ("stop", [1]),
               ("stop", [""]), ("stop", ["x" * 300]), ("stop", ["s"] * 20), ("top_p", 0), ("top_p", 2),
               ("messages", []), ("messages", {}), ("messages", "x"), ("logprobs", True),
               ("logprobs", "yes"), ("stream_options", {"include_usage": True}), ("model", "gpt-4o"),
               ("model", None), ("model", 5), ("temperature", 1e400)]
_GOOD_FIELDS = [("user", "u-1"), ("metadata", {"k": "v"}), ("some_future_field", {"x": [1, 2]}),
                ("seed", 2**63 - 1), ("seed", 7), ("stop", ["\n\n", "END"]), ("top_p", 0.9),
                ("max_completion_tokens", 2), ("presence_penalty", 0), ("response_format", {"type": "text"}),
                ("x-extra", None)]
_BAD_MESSAGES = [[{"role": "wizard", "content": "x"}], [{"role": "tool", "content": "r"}],
                 [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": "a\ud800"}], [{"role": "user", "content": 5}],
                 [{"content": "x"}], ["x"], [{"role": "assistant"}],
                 [{"role": "user", "content": "y" * 300_000}]]
_GOOD_MESSAGES = [[{"role": "user", "content": "héllo 🙂 \u2028 \t end"}],
                  [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "t"}]}],
                  [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c", "content": "42"}],
                  [{"role": "developer", "content": "d"}, {"role": "user", "content": "<|im_start|>"}]]


def _structural(rng: random.Random, good: bytes) -> bytes:
    k = rng.randrange(9)
    if k == 0:
        return b""
    if k == 1:
        return rng.choice([b"null", b"[]", b"42", b'"str"', b"{"])
    if k == 2:
        return good[:rng.randrange(1, len(good))]
    if k == 3:
        return b"\xef\xbb\xbf" + good
    if k == 4:
        return good[:-1] + b', "bad": "\xff\xfe"}'
    if k == 5:
        d = rng.choice([80, 1200, 20000])
        return good[:-1] + b', "deep": ' + b"[" * d + b"]" * d + b"}"
    if k == 6:
        return good[:-1] + b', "temperature": NaN}'
    if k == 7:
        return good.replace(b'"messages"', b'"messages"', 1)[:-1] + b', "messages": 1}'  # duplicate key
    return good[:-1] + b', "pad": "' + b"p" * rng.choice([1000, 200_000]) + b'"}'


def fuzz_cases(seed: int, n: int) -> list[Case]:
    """The seeded corpus: the same ``(seed, n)`` gives the same cases, in order."""
    rng = random.Random(seed)
    out: list[Case] = []
    for i in range(n):
        r = rng.random()
        stream = rng.random() < 0.2
        if r < 0.42:      # valid request, malformed hints: must still be served
            body = chat_body(f"case {i}", custom_params=fuzz_hints(rng), stream=stream)
            out.append(Case("hint", "/v1/chat/completions", dumps(body), True, stream))
        elif r < 0.47:    # hints in headers (what httpx can send: printable ASCII)
            hdr = {"X-KVFlow-Workflow": rng.choice(["w", " w ", "x" * 2000, "a b", "!@#$%^&*()"]),
                   "X-KVFlow-Agent": rng.choice(["a", "  ", "y" * 300, "<b>", "a=b; c"])}
            hdr = {k: v.strip() or "z" for k, v in hdr.items()}
            out.append(Case("hint-header", "/v1/chat/completions", dumps(chat_body(f"h{i}", stream=stream)),
                            True, stream, hdr))
        elif r < 0.67:    # out-of-band hints: 200 or 400, never more
            out.append(Case("oob", "/kvflow/v1/hints", dumps(fuzz_hints(rng)), False))
        else:             # mutated bodies
            good = chat_body(f"body {i}", stream=stream)
            m = rng.random()
            if m < 0.3:
                key, val = rng.choice(_BAD_FIELDS)
                out.append(Case("body-field", "/v1/chat/completions", dumps({**good, key: val}), False, stream))
            elif m < 0.5:
                key, val = rng.choice(_GOOD_FIELDS)
                out.append(Case("body-ok", "/v1/chat/completions", dumps({**good, key: val}), True, stream))
            elif m < 0.62:
                out.append(Case("messages-bad", "/v1/chat/completions",
                                dumps({**good, "messages": rng.choice(_BAD_MESSAGES)}), False, stream))
            elif m < 0.72:
                out.append(Case("messages-ok", "/v1/chat/completions",
                                dumps({**good, "messages": rng.choice(_GOOD_MESSAGES)}), True, stream))
            elif m < 0.82:
                p = rng.choice(["plain", [1, 2, 3], ["one"], "a\ud800", [1, "a"], [], [-1], [10**9], True])
                body = {"model": TINY, "prompt": p, "max_tokens": 2, "stream": stream}
                ok = p in ("plain", [1, 2, 3], ["one"])
                out.append(Case("completion", "/v1/completions", dumps(body), ok, stream))
            else:
                out.append(Case("structural", "/v1/chat/completions", _structural(rng, dumps(good)), False))
    return out
