"""Tokenizers and chat templates for the embedded engine.

:class:`ChatTokenizer` wraps a ``tokenizers.Tokenizer`` plus a jinja2 chat template:

- ``ChatTokenizer.from_gguf(path_or_reader)``: rebuilt from a GGUF's GPT-2 BPE vocab (SmolLM2):
  BPE + Digits(individual) -> ByteLevel(add_prefix_space=False), ByteLevel decoder, CONTROL
  tokens as specials, the GGUF's ``tokenizer.chat_template``.
- ``ChatTokenizer.byte_level()``: 256 byte tokens + ChatML specials (tiny-random presets).
- ``ChatTokenizer.from_dir(dir)``: ``tokenizer.json`` + ``tokenizer_config.json`` (HF layout).
- ``save(dir)`` writes that HF layout back (used for the converted-GGUF cache).

Key methods: ``encode``, ``decode``, ``apply_chat_template``, ``encode_chat``,
``fixed_prefix_tokens(messages, n)`` (token length of an agent's fixed prompt), ``eos_token_ids``,
``stream(stop=...)`` -> :class:`DetokenizeStream` for incremental detokenization with stop strings.

Tools: ``apply_chat_template(messages, tools=[...])`` (OpenAI ``tools``), assistant messages with
``tool_calls`` and ``role: "tool"`` results render in the Hermes/Qwen-2.5 ChatML layout of
:mod:`..tool_calls` (tools listed in the system block, so an agent's tools are part of its fixed,
cacheable prefix). A model whose own template is tool-aware (mentions ``tools``) gets its own
template with HF's conventions instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BYTE_VOCAB_SIZE = 256 + len(CHATML_SPECIALS)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-char map (the ByteLevel alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _tool_aware(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _has_tool_turns(messages: Sequence[dict]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


TOOLS_DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_POSTAMBLE = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_chatml_tools(messages: Sequence[dict], tools: Sequence[dict] | None,
                        add_generation_prompt: bool = True) -> str:
    """ChatML with tools (Hermes/Qwen-2.5 layout): the tool list goes in the system block;
    assistant ``tool_calls`` become ``<tool_call>`` blocks; consecutive ``tool`` results become
    one user turn of ``<tool_response>`` blocks. Written in Python (not jinja) so the exact bytes
    are easy to see: they must match what the grammar lets the model write."""
    from ..tool_calls import render_call

    def turn(role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    out: list[str] = []
    msgs = list(messages)
    first_system = bool(msgs) and msgs[0].get("role") in ("system", "developer")
    if tools:
        system = _message_text(msgs[0].get("content")) if first_system else TOOLS_DEFAULT_SYSTEM
        listing = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)
        out.append(turn("system", system + TOOLS_PREAMBLE + listing + TOOLS_POSTAMBLE))
        msgs = msgs[1:] if first_system else msgs
    i = 0
    while i < len(msgs):
        m = msgs[i]
        role = m.get("role")
        if role == "tool":
            results = []
            while i < len(msgs) and msgs[i].get("role") == "tool":
                results.append(f"<tool_response>\n{_message_text(msgs[i].get('content'))}\n</tool_response>")
                i += 1
            out.append(turn("user", "\n".join(results)))
            continue
        text = _message_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = [render_call((tc.get("function") or {}).get("name", ""),
                                 (tc.get("function") or {}).get("arguments", {}))
                     for tc in m["tool_calls"] if isinstance(tc, dict)]
            text = "\n".join(([text] if text else []) + calls)
        out.append(turn("system" if role == "developer" else str(role), text))
        i += 1
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _message_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: keep the text parts
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, *,
                 eos_tokens: Sequence[str] = (), bos_token: str | None = None,
                 extra_eos_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_tokens = [t for t in eos_tokens if tokenizer.token_to_id(t) is not None]
        ids = {tokenizer.token_to_id(t) for t in self.eos_tokens} | set(extra_eos_ids)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._template = None
        self._max_token_bytes: int | None = None
        self._offload = None  # tokenize_worker.OffloadEncoder, see offload_long_texts

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def byte_level(cls) -> "ChatTokenizer":
        """Bytes 0..255 are ids 0..255; ChatML specials are 256, 257, 258."""
        b2u = _bytes_to_unicode()
        tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                for s in CHATML_SPECIALS])
        return cls(tok, CHATML_TEMPLATE, eos_tokens=("<|im_end|>", "<|endoftext|>"),
                   bos_token="<|im_start|>")

    @classmethod
    def from_gguf(cls, path_or_reader) -> "ChatTokenizer":
        """Rebuild a GPT-2-style (``tokenizer.ggml.model == 'gpt2'``) tokenizer from a GGUF."""
        from gguf import GGUFReader
        r = path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(path_or_reader)

        def field(key, default=None):
            f = r.fields.get(key)
            return default if f is None else f.contents()

        if field("tokenizer.ggml.model") != "gpt2":
            raise ValueError("only GPT-2-style BPE GGUF tokenizers are supported")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        specials = [tokens[i] for i, t in enumerate(types) if t == 3]  # CONTROL
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        eos = field("tokenizer.ggml.eos_token_id")
        bos = field("tokenizer.ggml.bos_token_id")
        eos_tokens = [tokens[eos]] if eos is not None else []
        eos_tokens += [s for s in ("<|im_end|>", "<|endoftext|>") if s in specials]
        return cls(tok, field("tokenizer.chat_template"), eos_tokens=eos_tokens,
                   bos_token=tokens[bos] if bos is not None else None)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTokenizer":
        """HF layout: ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``,
        ``chat_template.jinja``)."""
        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if template is None and tok.token_to_id("<|im_start|>") is not None:
            template = CHATML_TEMPLATE

        def content(v):
            return v.get("content") if isinstance(v, dict) else v

        eos_tokens = [content(cfg.get("eos_token"))] if cfg.get("eos_token") else []
        eos_tokens += [s for s in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>")
                       if tok.token_to_id(s) is not None]
        gen = _read_json(path / "generation_config.json")
        extra = gen.get("eos_token_id", [])
        extra = [extra] if isinstance(extra, int) else list(extra)
        return cls(tok, template, eos_tokens=eos_tokens, bos_token=content(cfg.get("bos_token")),
                   extra_eos_ids=extra)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path / "tokenizer.json"))
        cfg = {"chat_template": self.chat_template, "bos_token": self.bos_token,
               "eos_token": self.eos_tokens[0] if self.eos_tokens else None}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
        (path / "generation_config.json").write_text(
            json.dumps({"eos_token_id": sorted(self.eos_token_ids)}))

    # -- tokens ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the text bytes one token stands for: the longest vocabulary entry
        in UTF-8 (specials included). Byte-level BPE spells each byte as one character and
        SentencePiece / byte-fallback spellings are no shorter than their text, so a text of
        ``b`` bytes has at least ``b / max_token_bytes`` tokens (the server's size check)."""
        if self._max_token_bytes is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab),
                                        default=1)
        return self._max_token_bytes

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Special tokens written in ``text`` (e.g. ``<|im_start|>``) map to their ids."""
        if self._offload is not None and len(text) >= self._offload.min_chars:
            return self._offload.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def offload_long_texts(self, min_chars: int = 64 * 1024) -> None:
        """Encode texts of ``min_chars`` or more in a helper process (``spawn``ed at the first).

        Why: ``tokenizers`` does not always release the GIL while it encodes (measured: a 650k
        character prompt held it for ~0.8 s in one call, not in the next), and a server's event
        loop must not stall while a maximum-size prompt is tokenized. A process costs one IPC
        round trip (the text is pickled, ids come back), only for long texts."""
        if self._offload is None:
            from ..tokenize_worker import OffloadEncoder
            self._offload = OffloadEncoder(self.tokenizer, min_chars)

    def close(self) -> None:
        if self._offload is not None:
            self._offload.close()
            self._offload = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None, **kwargs) -> str:
        if (tools or _has_tool_turns(messages)) and not _tool_aware(self.chat_template) \
                and self.token_to_id("<|im_start|>") is not None:
            return render_chatml_tools(messages, tools, add_generation_prompt)
        if tools:
            kwargs["tools"] = list(tools)
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        msgs = [{**m, "content": _message_text(m.get("content"))} for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "",
                                     eos_token=self.eos_tokens[0] if self.eos_tokens else "",
                                     **kwargs)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools=tools))

    def fixed_prefix_tokens(self, messages: Sequence[dict], n_fixed_messages: int,
                            full_ids: Sequence[int] | None = None,
                            tools: Sequence[dict] | None = None) -> int:
        """Token length of the first ``n_fixed_messages`` rendered, i.e. where an agent's fixed
        prompt ends inside ``encode_chat(messages)`` (pass it as ``full_ids`` to skip re-encoding).

        If rendering/tokenizing the first n messages alone is not a token prefix of the whole
        (a merge across the boundary, a template that looks ahead), the longest common token
        prefix is returned, so the result is always a valid prefix length of ``full_ids``.
        """
        n = min(max(int(n_fixed_messages), 0), len(messages))
        if n == 0:
            return 0
        from kvflow_agents.serving.policy import common_prefix_len

        prefix = self.encode(self.apply_chat_template(messages[:n], add_generation_prompt=False, tools=tools))
        full = list(full_ids) if full_ids is not None else self.encode_chat(messages, tools=tools)
        return common_prefix_len(list(prefix), full)

    # -- streaming ---------------------------------------------------------------------------
    def stream(self, stop: Sequence[str] = (), skip_special_tokens: bool = True,
               stop_token_ids: Iterable[int] | None = None) -> "DetokenizeStream":
        return DetokenizeStream(self, stop, skip_special_tokens, stop_token_ids)


class DetokenizeStream:
    """Incremental detokenization with stop handling for one generated sequence.

    ``push(token_id) -> str`` returns the newly safe text (never half a UTF-8 character, never
    text that might be the start of a stop string); once ``finished`` (an EOS id, or a stop
    string found; ``finish_reason == "stop"``) further pushes return "". ``finish()`` returns
    what was held back. ``text`` is the full output, cut before any stop string.
    """

    def __init__(self, tok: ChatTokenizer, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, stop_token_ids: Iterable[int] | None = None):
        self.tok = tok
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        self.skip = skip_special_tokens
        self.stop_ids = frozenset(tok.eos_token_ids if stop_token_ids is None else stop_token_ids)
        self.ids: list[int] = []
        self.text = ""
        self.finished = False
        self.finish_reason: str | None = None
        self._p = self._r = 0  # prefix/read offsets into ids
        self._emitted = 0

    def push(self, token_id: int) -> str:
        if self.finished:
            return ""
        if token_id in self.stop_ids:
            self.finished, self.finish_reason = True, "stop"
            return self._emit(len(self.text))
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self._p:self._r], self.skip)
        after = self.tok.decode(self.ids[self._p:], self.skip)
        if after.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for more tokens
            return ""
        start = len(self.text)
        self.text += after[len(before):]
        self._p, self._r = self._r, len(self.ids)
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0:
                self.text = self.text[:i]
                self.finished, self.finish_reason = True, "stop"
        if self.finished:
            return self._emit(len(self.text))
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._emit(len(self.text) - hold)

    def finish(self) -> str:
        """End of generation: release held-back text."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}
