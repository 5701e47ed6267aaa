"""Building an engine :class:`~.scheduler.Request` from an API call: tokenize, validate, size.

:class:`RequestBuilder` runs on any thread (the server calls it off its event loop), so a request
the engine would fail on is refused before it can share a step with others: sampling values, the
seed's range, token ids, sizes (a prompt over ``max_prompt_tokens`` is refused from its length or
a bounded probe before it is fully tokenized), the chat template, the grammar. It reads only what
the engine fixed at start (tokenizer, model config, engine config, grammar backend) and the
device capacity, so it never touches the engine thread's state. Raises
:class:`~.engine_config.EngineInputError`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

from .engine_config import EngineInputError
from .scheduler import Request, SamplingParams, StreamEvent


class RequestBuilder:
    """Tokenize and validate requests for one engine (module doc)."""

    PROBE_CHARS_PER_TOKEN = 4  # typical text; only decides how much to tokenize for the probe

    def __init__(self, *, tokenizer: Any, model_config: Any, config: Any, grammar: Any,
                 capacity_tokens: Callable[[], Optional[int]]) -> None:
        self.tokenizer, self.model_config, self.config = tokenizer, model_config, config
        self.grammar = grammar
        self._capacity = capacity_tokens  # device tokens one request may use (None: unbounded)

    def build(self, *, messages: Optional[Sequence[dict]] = None, prompt: Optional[str] = None,
              prompt_ids: Optional[Sequence[int]] = None, params: Optional[SamplingParams] = None,
              max_tokens: Optional[int] = None, hints: Any = None,
              sink: Optional[Callable[[StreamEvent], None]] = None,
              tools: Optional[Sequence[dict]] = None, tenant: Optional[str] = None) -> Request:
        """See :meth:`~.engine.Engine.make_request`."""
        params = params or SamplingParams()
        if isinstance(hints, dict):  # the wire form (custom_params) is accepted too
            from kvflow_agents.protocol import Hints
            hints = Hints.from_custom_params(hints)
        try:  # first, so a bad value costs no tokenizing
            mt0 = params.max_tokens if params.max_tokens is not None else 1
            dataclasses.replace(params, max_tokens=mt0).validate()
        except ValueError as e:
            raise EngineInputError(str(e), str(e).split(":")[0]) from None
        limit = self.max_prompt_tokens
        self._check_prompt_chars(messages, prompt, limit)
        fixed_len = None
        if messages is not None:
            try:
                ids = self.tokenizer.encode_chat(list(messages), tools=tools)
            except Exception as e:  # a template that rejects the conversation
                raise EngineInputError(f"messages: cannot apply the chat template: {e}", "messages") from None
            if hints is not None and getattr(hints, "fixed_messages", None) is not None:
                fixed_len = self.tokenizer.fixed_prefix_tokens(list(messages), hints.fixed_messages, ids,
                                                               tools=tools)
        elif prompt is not None:
            ids = self.tokenizer.encode(prompt)
        elif prompt_ids is not None:
            ids = [int(t) for t in prompt_ids]
            if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise EngineInputError("prompt: token id out of range", "prompt")
        else:
            raise EngineInputError("no prompt given", "prompt")
        if not ids:
            raise EngineInputError("prompt: empty after tokenization", "prompt")
        n = len(ids)
        cap = self._capacity()
        if n > limit:
            raise EngineInputError(f"prompt is {n} tokens; this server holds at most {int(limit)} "
                                   f"prompt tokens (device pool {cap} tokens, --device-tokens; "
                                   f"--max-prompt-tokens)", "messages", "context_length_exceeded")
        limit = min(cap if cap is not None else math.inf, self.model_config.max_position)
        mt = max_tokens if max_tokens is not None else params.max_tokens
        if mt is None:
            mt = int(min(self.config.default_max_tokens, limit - n))
        params = dataclasses.replace(params, max_tokens=mt)
        try:
            params.validate()
        except ValueError as e:
            raise EngineInputError(str(e), str(e).split(":")[0]) from None
        if n + mt > limit:
            raise EngineInputError(f"prompt ({n} tokens) + max_tokens ({mt}) exceeds the capacity of "
                                   f"{int(limit)} tokens; lower max_tokens or raise --device-tokens",
                                   "max_tokens", "context_length_exceeded")
        grammar = self._compile_grammar(params)
        return Request(ids, params, sink or (lambda ev: None), hints=hints, fixed_len=fixed_len,
                       grammar=grammar, tenant=tenant)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: one token short of the device pool / model context
        (generation needs room), or ``EngineConfig.max_prompt_tokens`` if smaller."""
        cap = self._capacity()
        limit = min(cap if cap is not None else math.inf, self.model_config.max_position) - 1
        if self.config.max_prompt_tokens is not None:
            limit = min(limit, self.config.max_prompt_tokens)
        return int(limit)

    @property
    def max_prompt_chars(self) -> int:
        """Prompt text longer than this is over ``max_prompt_tokens`` whatever it says: no token
        covers more than ``tokenizer.max_token_bytes`` bytes and a character is >= 1 byte."""
        return self.max_prompt_tokens * self.tokenizer.max_token_bytes

    def _check_prompt_chars(self, messages, prompt, limit: int) -> None:
        """Refuse an oversized prompt before tokenizing all of it: by its length alone when no
        tokenization could fit it, else when a probe of its first ``4 * limit`` characters
        already holds more than ``limit`` tokens (tokenizing is the costly part, O(text))."""
        if messages is not None:
            texts = []
            for m in messages:
                c = m.get("content") if isinstance(m, dict) else None
                if isinstance(c, str):
                    texts.append(c)
                elif isinstance(c, list):
                    texts += [p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)]
        elif isinstance(prompt, str):
            texts = [prompt]
        else:
            return
        chars = sum(map(len, texts))

        def too_long(what: str) -> EngineInputError:
            return EngineInputError(f"prompt is {what}; this server holds at most {limit} prompt "
                                    "tokens (--max-prompt-tokens, --device-tokens)", "messages",
                                    "context_length_exceeded")
        if chars > self.max_prompt_chars:
            raise too_long(f"{chars} characters")
        window = self.PROBE_CHARS_PER_TOKEN * limit + 16
        if chars <= window:
            return
        tokens = 0
        for t in texts:
            piece = t[:window]
            # a cut can merge differently at the end: count one token less per piece
            tokens += max(0, len(self.tokenizer.encode(piece)) - 1)
            if tokens > limit:
                raise too_long(f"over {limit} tokens long (counted in its first {window} characters)")
            window -= len(piece)
            if window <= 0:
                return

    def _compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled constraint of ``params.grammar`` (cached by xgrammar), or None."""
        from .grammar import GrammarError

        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise EngineInputError(f"logit_bias: token ids must be < {self.model_config.vocab_size}", "logit_bias")
        if params.grammar is None:
            return None
        try:
            return self.grammar.compile(params.grammar)
        except GrammarError as e:
            raise EngineInputError(str(e), e.param) from None
