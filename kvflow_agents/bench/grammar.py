"""``kvflow bench grammar``: what the grammar mask costs per decode step, side by side.

For each batch size it times, in one process and interleaved (so a shared machine's drift hits
every variant alike):

* **decode** — one real batched decode step of the model (``decode_batch`` over the batch's
  paged KV at ``context`` tokens), the work the mask is added to;
* **sample, plain** — :class:`~kvflow_agents.serving.embedded.sampling.BatchSampler` on that
  step's logits, no request constrained;
* **sample, masked** — the same with every request under a grammar: a tool call's JSON
  arguments (xgrammar structural tag, matcher inside the ``"query"`` string: the widest mask)
  and a ``response_format`` JSON schema (matcher at the start of a value).

The mask's cost per step is ``masked - plain``; the ratio reported is
``(decode + masked) / (decode + plain)``: how much slower a decode step gets when the whole
batch is constrained. Matchers are rolled back after each timed step, so every repetition masks
the same state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the corpus",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                   "required": ["query"]}}}
REVIEW_SCHEMA = {"type": "object", "properties": {
    "verdict": {"type": "string", "enum": ["PASS", "FAIL"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100},
    "notes": {"type": "string"}}, "required": ["verdict", "score", "notes"]}

# (name, grammar spec kwargs, text already generated when the step is timed)
CASES = [
    ("tool call (in a string)", {"tools": [SEARCH_TOOL], "tool_choice": "required"},
     '<tool_call>\n{"name": "search", "arguments": {"query": "inflation in '),
    ("json_schema (value start)", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "review", "schema": REVIEW_SCHEMA}}}, '{"verdict": "PASS", "score": '),
]


@dataclass
class GrammarBenchRow:
    batch: int
    case: str
    decode_ms: float
    sample_plain_ms: float
    sample_masked_ms: float
    fill_us_per_row: float
    compile_ms: float
    samples: dict = field(default_factory=dict)

    @property
    def mask_ms(self) -> float:
        return self.sample_masked_ms - self.sample_plain_ms

    @property
    def step_ratio(self) -> float:
        return (self.decode_ms + self.sample_masked_ms) / (self.decode_ms + self.sample_plain_ms)

    def as_dict(self) -> dict:
        return {"batch": self.batch, "case": self.case, "decode_ms": round(self.decode_ms, 3),
                "sample_plain_ms": round(self.sample_plain_ms, 4),
                "sample_masked_ms": round(self.sample_masked_ms, 4), "mask_ms": round(self.mask_ms, 4),
                "fill_us_per_row": round(self.fill_us_per_row, 2), "compile_ms": round(self.compile_ms, 2),
                "step_ratio": round(self.step_ratio, 4)}


def _median_ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3


def bench_grammar(model: str = "smollm2-135m", batches: Sequence[int] = (1, 4, 8), context: int = 512,
                  reps: int = 20, progress: Optional[Callable[[str], None]] = None) -> dict:
    import torch

    from kvflow_agents.serving.embedded.grammar import GrammarBackend, spec_for_request
    from kvflow_agents.serving.embedded.kv_pool import PagedKVPool
    from kvflow_agents.serving.embedded.model import load_model
    from kvflow_agents.serving.embedded.sampling import BatchSampler
    from kvflow_agents.serving.embedded.scheduler import Request, SamplingParams

    lm, tok, cfg = load_model(model)
    backend = GrammarBackend(tok, cfg.vocab_size)
    page = 16
    pages_per_seq = -(-(context + 1) // page)
    pool = PagedKVPool(cfg, device_pages=pages_per_seq * max(batches) + 1, host_pages=0, page_size=page)
    rows: list[GrammarBenchRow] = []
    compiled = {}
    for name, kw, _prefix in CASES:
        spec = spec_for_request(**kw)
        t0 = time.perf_counter()
        grammar = backend.compile(spec)
        compiled[name] = (spec, grammar, (time.perf_counter() - t0) * 1e3)
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, cfg.vocab_size - 1, (context,), generator=gen).tolist()
        for b in batches:
            seqs = []
            for i in range(b):
                pages = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
                lm.prefill(pool.device_kv, prompt, pages, 0)
                seqs.append((prompt[-1], pages, context))
            for name, _kw, prefix in CASES:
                if progress:
                    progress(f"batch {b}: {name}")
                spec, cg, compile_ms = compiled[name]
                params = SamplingParams(max_tokens=64, temperature=0, grammar=spec)
                plain_reqs = [Request(list(prompt), SamplingParams(max_tokens=64), lambda ev: None) for _ in range(b)]
                masked_reqs = []
                for _ in range(b):
                    r = Request(list(prompt), params, lambda ev: None, grammar=cg)
                    masked_reqs.append(r)
                plain, masked = BatchSampler(backend), BatchSampler(backend)
                for r in masked_reqs:
                    st = masked._state(r)
                    for t in tok.encode(prefix):
                        assert st.matcher.accept_token(t), "bench prefix must be valid for its grammar"
                t_dec, t_plain, t_mask, t_fill = [], [], [], []
                bm = backend.allocate_bitmask(max(b, 16))
                for _ in range(reps):
                    t0 = time.perf_counter()
                    logits = lm.decode_batch(pool.device_kv, seqs)
                    t_dec.append(time.perf_counter() - t0)
                    a, m = logits.clone(), logits.clone()
                    t0 = time.perf_counter()
                    plain.sample(a, plain_reqs)
                    t_plain.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    masked.sample(m, masked_reqs)
                    t_mask.append(time.perf_counter() - t0)
                    for r in masked_reqs:  # back to the timed state
                        r.sampling.matcher.rollback(1)
                    t0 = time.perf_counter()
                    for r in masked_reqs:
                        r.sampling.matcher.fill_next_token_bitmask(bm, 0)
                    t_fill.append((time.perf_counter() - t0) / b)
                rows.append(GrammarBenchRow(b, name, _median_ms(t_dec), _median_ms(t_plain), _median_ms(t_mask),
                                            statistics.median(t_fill) * 1e6, compile_ms))
    return {"model": model, "context": context, "reps": reps, "vocab": cfg.vocab_size,
            "rows": [r.as_dict() for r in rows]}
