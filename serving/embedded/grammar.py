"""Grammar-constrained decoding for the embedded engine, with xgrammar (what SGLang and vLLM use).

What a request can ask for (:class:`GrammarSpec`, built by :func:`spec_for_request`):

* ``tools`` + ``tool_choice`` ``"auto"`` / ``"required"`` / ``{"type": "function", ...}``: an
  xgrammar structural tag in the :mod:`.tool_calls` format (xgrammar's ``"qwen_3"`` builtin,
  reasoning off): free text until the model writes ``<tool_call>``, then a call whose
  ``arguments`` follow that function's JSON schema (``auto``); at least one call, and nothing but
  calls (``required``: every call tag begins at once); exactly one call to the named function
  (named). ``parallel_tool_calls=false`` stops after the first call. ``"none"``: the tools stay
  in the prompt (the agent's cached prefix does not change) and the text may not contain
  ``<tool_call`` (a call ban, as NVIDIA Dynamo's). In ``auto`` and ``none`` the free text may
  not contain ``<tool_response`` either: only the template writes tool results (a small model
  imitates the turn it just read).
* ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}}``; ``"text"``: none.
* SGLang's extensions ``regex`` and ``ebnf`` (one constraint per request).

How it runs (:class:`GrammarBackend`, one per engine): the tokenizer's vocabulary is handed to
xgrammar once (``TokenizerInfo``, byte-level BPE; special tokens other than the stop tokens are
never allowed inside a grammar); specs compile with a cache (``GrammarCompiler``) when the request
is built, so a bad schema is a 400 before anything is queued; each admitted request gets a
``GrammarMatcher``; each decode step fills one bitmask row per constrained request and applies
it to the batch's logits in place (``sampling.py``), then the sampled token is accepted.

Invariants: a matcher only ever accepts tokens its own mask allowed (so it never rejects one);
once the grammar is complete only stop tokens are allowed, so generation ends with EOS and
``finish_reason`` is ``stop``/``tool_calls`` (or ``length`` when ``max_tokens`` cut it short).

xgrammar is an optional dependency of ``kvflow serve``: without it, requests that need a grammar
get a 400 naming the package, and everything else works.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .tool_calls import tool_names

MAX_WHITESPACE = 1   # inside tool-call arguments: a small model otherwise pads JSON with newlines
SEPARATOR = ""       # between parallel calls ("" keeps a small model from looping on "\n<tool_call>")
NEVER_WRITTEN = ("<tool_response", "</tool_response")  # template-only markers (auto mode)
INSTALL_HINT = "pip install --no-deps 'xgrammar>=0.2.8' apache-tvm-ffi transformers"


class GrammarError(ValueError):
    """A constraint the engine cannot compile (HTTP 400); ``param`` names the request field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """One decoding constraint, before compilation. ``kind``: ``json_schema`` | ``json_object`` |
    ``structural_tag`` | ``regex`` | ``ebnf``; ``value``: the schema / tag as JSON text, or the
    regex / EBNF source. ``tool_call``: the output is parsed into ``tool_calls``."""

    kind: str
    value: str = ""
    strict: bool = True
    tool_call: bool = False
    param: str = "response_format"


# ------------------------------------------------------------------ request -> spec
def tool_choice_mode(tool_choice: Any, tools: Optional[Sequence[dict]]) -> tuple[str, Any]:
    """``(mode, names)``: mode ``none`` | ``auto`` | ``required`` | ``named`` (names: the one
    name) | ``allowed_auto`` / ``allowed_required`` (names: the allowed subset, OpenAI's
    ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``). OpenAI's default is
    ``auto`` with tools and ``none`` without."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise GrammarError("tool_choice needs tools", "tool_choice")
        return "none", None
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in tool_names(tools):
            raise GrammarError(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return "named", name
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        spec = tool_choice.get("allowed_tools") or tool_choice  # chat shape, or the flat one
        mode = spec.get("mode", "auto")
        refs = spec.get("tools")
        if mode not in ("auto", "required") or not isinstance(refs, list) or not refs:
            raise GrammarError("tool_choice.allowed_tools: needs mode 'auto'|'required' and a non-empty "
                               "tools list", "tool_choice")
        names = [(r.get("function") or {}).get("name", r.get("name")) if isinstance(r, dict) else None
                 for r in refs]
        unknown = [n for n in names if n not in tool_names(tools)]
        if unknown:
            raise GrammarError(f"tool_choice.allowed_tools: not in tools: {unknown}", "tool_choice")
        return f"allowed_{mode}", names
    raise GrammarError("tool_choice: must be 'none', 'auto', 'required', "
                       "{'type': 'function', 'function': {'name': ...}} or {'type': 'allowed_tools', ...}",
                       "tool_choice")


def _check_tools(tools: Sequence[dict]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GrammarError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}",
                               f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise GrammarError(f"tools[{i}].function.parameters: must be a JSON schema object",
                               f"tools[{i}].function.parameters")
        if fn["name"] in seen:
            raise GrammarError(f"tools[{i}]: duplicate function name {fn['name']!r}", f"tools[{i}]")
        seen.add(fn["name"])


def tool_call_spec(tools: Sequence[dict], tool_choice: Any, parallel: Optional[bool]) -> GrammarSpec:
    """The structural tag for a tool-calling request (for ``tool_choice="none"``: the call ban,
    ``tool_call=False``)."""
    _check_tools(tools)
    mode, name = tool_choice_mode(tool_choice, tools)
    import_xgrammar()
    if mode == "none":
        from xgrammar.structural_tag import AnyTextFormat, StructuralTag

        ban = StructuralTag(format=AnyTextFormat(excludes=["<tool_call", *NEVER_WRITTEN]))
        return GrammarSpec("structural_tag", ban.model_dump_json(), param="tool_choice")
    from xgrammar import get_model_structural_tag

    norm = []
    for t in tools:
        fn = dict(t["function"])
        fn.setdefault("parameters", {"type": "object", "properties": {}})
        if not mode.startswith("allowed_") or fn["name"] in name:
            norm.append({"type": "function", "function": fn})
    if mode.startswith("allowed_"):  # the prompt lists every tool; the grammar only these
        mode = mode.removeprefix("allowed_")
    choice: Any = {"type": "function", "function": {"name": name}} if mode == "named" else mode
    try:
        tag = get_model_structural_tag("qwen_3", tools=norm, tool_choice=choice, reasoning="disabled",
                                       parallel_tool_calls=parallel is not False,
                                       max_whitespace_cnt=MAX_WHITESPACE)
    except Exception as e:  # noqa: BLE001 — a schema xgrammar's builder rejects
        raise GrammarError(f"tools: {e}", "tools") from None
    if mode in ("required", "named"):
        tag = _calls_only(tag, mode == "named" or parallel is False)
    else:
        _exclude_from_text(tag, NEVER_WRITTEN)
    return GrammarSpec("structural_tag", tag.model_dump_json(), tool_call=True, param="tools")


def _exclude_from_text(tag: Any, strings: Sequence[str]) -> None:
    """``auto``: the free text around calls may not contain ``strings`` (what only the chat
    template writes: a small model otherwise imitates the ``<tool_response>`` turn it just read)."""
    fmt = tag.format
    while getattr(fmt, "type", None) == "sequence":
        fmt = fmt.elements[-1]
    if hasattr(fmt, "excludes"):
        fmt.excludes = list(dict.fromkeys([*fmt.excludes, *strings]))


def _calls_only(tag: Any, single: bool) -> Any:
    """``required``: no free text before or between calls — a 135M model asked for a call
    otherwise writes prose and never reaches the trigger."""
    from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat, TriggeredTagsFormat

    fmt = tag.format
    while getattr(fmt, "type", None) == "sequence":  # a (disabled) reasoning prefix + the calls
        fmt = fmt.elements[-1]
    if isinstance(fmt, TriggeredTagsFormat):
        fmt = TagsWithSeparatorFormat(tags=fmt.tags, separator=SEPARATOR, at_least_one=True,
                                      stop_after_first=single)
    return StructuralTag(format=fmt)


def response_format_spec(rf: Any) -> Optional[GrammarSpec]:
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise GrammarError("response_format: type must be 'text', 'json_object' or 'json_schema'",
                           "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
        raise GrammarError("response_format.json_schema: expected {'name': ..., 'schema': {...}}",
                           "response_format.json_schema")
    schema = js.get("schema", {})
    return GrammarSpec("json_schema", json.dumps(schema), strict=bool(js.get("strict", False)))


def spec_for_request(*, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None,
                     response_format: Any = None, regex: Optional[str] = None,
                     ebnf: Optional[str] = None) -> Optional[GrammarSpec]:
    """The request's one constraint, or ``None``. Raises :class:`GrammarError`."""
    specs = []
    ban = None
    if tools:
        s = tool_call_spec(tools, tool_choice, parallel_tool_calls)
        if s.tool_call:
            specs.append(s)
        else:
            ban = s  # tool_choice="none": only when nothing else constrains the output
    elif tool_choice not in (None, "none", "auto"):
        raise GrammarError("tool_choice needs tools", "tool_choice")
    rf = response_format_spec(response_format)
    if rf is not None:
        specs.append(rf)
    if regex is not None:
        specs.append(GrammarSpec("regex", regex, param="regex"))
    if ebnf is not None:
        specs.append(GrammarSpec("ebnf", ebnf, param="ebnf"))
    if len(specs) > 1:
        raise GrammarError("only one of forced tool calls, response_format, regex and ebnf per request "
                           f"(got {', '.join(s.param for s in specs)})", specs[1].param)
    return specs[0] if specs else ban


# ------------------------------------------------------------------ xgrammar
def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarError(f"structured output and tool calls need xgrammar ({INSTALL_HINT}): {e}",
                           "tools") from None
    return xgrammar


class GrammarBackend:
    """xgrammar over one tokenizer + model vocabulary. Thread-safe (compiles happen on the
    request threads; matchers live on the engine thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._xgr = None
        self._compiler = None
        self._lock = threading.Lock()

    def _ensure(self):
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                tok = self.tokenizer.tokenizer
                n = tok.get_vocab_size(with_added_tokens=True)
                stop = sorted(self.tokenizer.eos_token_ids)
                specials = set(tok.get_added_tokens_decoder())
                # Special tokens as "" = never allowed by a grammar (only the stop tokens end it).
                vocab = ["" if (i in specials and i not in stop) else (tok.id_to_token(i) or "")
                         for i in range(n)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=max(self.vocab_size, n),
                                         stop_token_ids=stop or None, add_prefix_space=False)
                self._xgr = xgr
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=64 << 20)
            return self._xgr, self._compiler

    @property
    def available(self) -> bool:
        try:
            import_xgrammar()
        except GrammarError:
            return False
        return True

    def compile(self, spec: GrammarSpec) -> Any:
        xgr, comp = self._ensure()
        try:
            if spec.kind == "json_object":
                return comp.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            if spec.kind == "json_schema":
                return comp.compile_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
            if spec.kind == "structural_tag":
                return comp.compile_structural_tag(spec.value)
            if spec.kind == "regex":
                return comp.compile_regex(spec.value)
            if spec.kind == "ebnf":
                return comp.compile_grammar(spec.value)
        except Exception as e:  # noqa: BLE001 — xgrammar raises RuntimeError/ValueError subclasses
            raise GrammarError(f"{spec.param}: cannot compile the constraint: {e}", spec.param) from None
        raise GrammarError(f"unknown constraint kind {spec.kind!r}", spec.param)

    def matcher(self, compiled: Any) -> Any:
        xgr, _ = self._ensure()
        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> Any:
        xgr, _ = self._ensure()
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        xgr, _ = self._ensure()
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, vocab_size=self.vocab_size)
