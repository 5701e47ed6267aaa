"""From a batch's logits to its next tokens: penalties, logit bias, grammar mask, sampling, logprobs.

:class:`BatchSampler` is the one call the engine makes per prefill/decode step
(``sampler.sample(logits, requests)``); per request it keeps a :class:`RequestSampling` (the
grammar matcher and the output-token counts) on ``Request.sampling``.

Order, as vLLM and SGLang apply them:

1. ``logprobs`` / ``top_logprobs`` are taken from the model's raw distribution (before any
   penalty, bias, mask or temperature; vLLM's default "raw logprobs");
2. ``repetition_penalty`` (prompt + output tokens; divides positive logits, multiplies negative
   ones), ``frequency_penalty`` (x count in the output) and ``presence_penalty`` (once per
   token present in the output), then ``logit_bias``;
3. the grammar mask: one bitmask row per constrained request, filled by its xgrammar matcher and
   applied to the whole batch in place (rows without a grammar are left alone);
4. greedy / temperature + top-p sampling (:func:`~.engine_config.sample_tokens`: greedy rows
   share one argmax), then the token
   is accepted by the matcher.

Cost: requests that use none of these pay one attribute check each; a constrained row pays a
mask fill (µs when cached, more inside a JSON string) plus one masked write over the vocabulary
(``kvflow bench grammar`` measures it per decode step, side by side with unconstrained decoding).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional, Sequence

log = logging.getLogger("kvflow.engine")

MAX_TOP_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """One sampled token's log-probability and the ``top`` alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestSampling:
    """Per-request sampling state (engine thread only)."""

    __slots__ = ("matcher", "grammar_failed")

    def __init__(self, matcher: Any = None) -> None:
        self.matcher = matcher
        self.grammar_failed = False


def _needs_penalty(p: Any) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 or p.logit_bias)


class BatchSampler:
    """See the module docstring. ``grammar``: a :class:`~.grammar.GrammarBackend` (or ``None``
    when no request may carry a grammar)."""

    def __init__(self, grammar: Any = None) -> None:
        self.grammar = grammar
        self._bitmask = None

    def _state(self, req: Any) -> RequestSampling:
        st = getattr(req, "sampling", None)
        if st is None:
            matcher = None
            if getattr(req, "grammar", None) is not None and self.grammar is not None:
                matcher = self.grammar.matcher(req.grammar)
            st = req.sampling = RequestSampling(matcher)
        return st

    def sample(self, logits: Any, reqs: Sequence[Any]) -> list[tuple[int, Optional[TokenLogprob]]]:
        """``logits``: ``[B, V]`` (or ``[V]`` for one request), fp32; changed in place."""
        import torch

        from .engine_config import sample_tokens

        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        states = [self._state(r) for r in reqs]
        raw: dict[int, Any] = {}
        for i, r in enumerate(reqs):
            if r.params.logprobs:
                raw[i] = torch.log_softmax(logits[i].float(), -1)
            if _needs_penalty(r.params):
                self._penalize(logits[i], r)
        rows = [i for i, st in enumerate(states) if st.matcher is not None and not st.grammar_failed]
        if rows:
            self._mask(logits, [states[i].matcher for i in rows], rows)
        # one sampling call for the batch: greedy rows share a single argmax
        toks = sample_tokens(logits, [r.params for r in reqs], [r.generator for r in reqs])
        out: list[tuple[int, Optional[TokenLogprob]]] = []
        for i, r in enumerate(reqs):
            tok = toks[i]
            st = states[i]
            if st.matcher is not None and not st.grammar_failed and not st.matcher.is_terminated():
                if not st.matcher.accept_token(tok):  # cannot happen for a token its mask allowed
                    st.grammar_failed = True
                    log.warning("grammar rejected token %d of %s; decoding on unconstrained", tok, r.rid)
            lp = None
            if i in raw:
                lp = _logprob(raw[i], tok, r.params.top_logprobs)
            out.append((tok, lp))
        return out

    def _mask(self, logits: Any, matchers: list, rows: list[int]) -> None:
        n = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = self.grammar.allocate_bitmask(max(n, 16))
        bm = self._bitmask
        for m, row in zip(matchers, rows):
            m.fill_next_token_bitmask(bm, row)
        self.grammar.apply_bitmask(logits, bm, rows)

    @staticmethod
    def _penalize(row: Any, req: Any) -> None:
        import torch

        p = req.params
        out = req.output_ids
        if p.repetition_penalty != 1.0:
            seen = torch.as_tensor(sorted(set(req.prompt_ids) | set(out)), dtype=torch.long)
            seen = seen[seen < row.shape[0]]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out and (p.frequency_penalty or p.presence_penalty):
            ids, counts = torch.as_tensor(out, dtype=torch.long).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if p.logit_bias:
            ids = torch.as_tensor([int(k) for k in p.logit_bias], dtype=torch.long)
            row[ids] += torch.as_tensor([float(v) for v in p.logit_bias.values()], dtype=row.dtype)


def _logprob(lp: Any, tok: int, k: int) -> TokenLogprob:
    import torch

    top: tuple[tuple[int, float], ...] = ()
    if k:
        v, ix = torch.topk(lp, min(k, lp.shape[0]))
        top = tuple((int(a), float(b)) for a, b in zip(ix.tolist(), v.tolist()))
    return TokenLogprob(int(tok), float(lp[tok]), top)
