"""The paper's synthetic multi-agent workflow: its spec, prompts, one HTTP call and the records.
The async client that drives it is ``bench/driver.py``.

A workflow has ``agents`` agents. Each agent has a **fixed prompt** of ``fixed`` tokens (its
system message, the same on every call: the cacheable prefix) and each call adds a **dynamic**
user message of ``dynamic`` tokens (different on every call) and asks for ``output`` tokens
(``max_tokens`` + ``ignore_eos``, so every call decodes exactly that many).

Variants (:func:`build_graph`, :func:`steps`):

- ``cycle``: agent_0 → agent_1 → … → agent_{N-1} → agent_0 (KVFlow's Fig. 1 workflow). One
  round = N sequential calls.
- ``fanout``: a head agent fans out to N-2 parallel workers, an AND barrier joins them into a
  tail agent, the tail goes back to the head. One round = head, all workers concurrently, tail.

``workflows`` instances run concurrently (each its own workflow id and, unless
``share_prompts``, its own fixed prompts), each for ``warmup_rounds + rounds`` rounds. The
client follows the workflow with a :class:`~kvflow_agents.graph.WorkflowTracker` and sends
hints v1 (``kvflow.hints`` + ``kvflow.async_http_client()``) with every request, and an
out-of-band ``end`` when the workflow is over.

Token lengths are exact for byte-level tokenizers (``tiny-random``: one ASCII character is one
token) and for models whose tokenizer can be loaded locally (``smollm2-135m``); otherwise they
are approximate (about one token per word) and the measured ``usage.prompt_tokens`` says what
was sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

VARIANTS = ("cycle", "fanout")

# A fixed vocabulary of common lowercase English words: with GPT-2-style byte-level BPE each
# " word" is a single token, so word count ~ token count even without the tokenizer.
_WORDS = (
    "the of and to in is for on that with as by at from this are be or an was it not have "
    "which one all can will more has their been its also but were they time new other when "
    "some these who into two may there only over first any most such year many after would "
    "so work than what use part data should about state each both through between where high "
    "well under long most while must well number small large used three same place system "
    "order report market value price rate trade risk plan step agent task review answer note "
    "table model cache memory queue graph node edge group level point case form power light"
).split()


# ------------------------------------------------------------------------------------ tokens
class TokenCounter:
    """Counts tokens and makes deterministic text of an exact token length."""

    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())

    def make_text(self, n: int, rng: random.Random, lead: str = "") -> str:
        words = [lead] if lead else []
        while len(words) < n:
            words.append(rng.choice(_WORDS))
        return " ".join(words[:max(n, 1)]) if n > 0 else ""


class ByteLevelCounter(TokenCounter):
    """``tiny-random``: one byte is one token (ASCII text only here)."""

    name = "byte-level"

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def make_text(self, n: int, rng: random.Random, lead: str = "") -> str:
        if n <= 0:
            return ""
        parts, size = [], 0
        if lead:
            parts.append(lead)
            size = len(lead)
        while size < n:
            w = rng.choice(_WORDS)
            parts.append(w)
            size += len(w) + 1
        return " ".join(parts)[:n]


class HFTokenizerCounter(TokenCounter):
    """A ``tokenizers``-backed tokenizer (e.g. the embedded engine's ``ChatTokenizer``)."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 name: str = "tokenizer") -> None:
        self._encode, self._decode, self.name = encode, decode, name

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def make_text(self, n: int, rng: random.Random, lead: str = "") -> str:
        if n <= 0:
            return ""
        base = TokenCounter().make_text(n + 8, rng, lead)
        ids = self._encode(base)
        while len(ids) < n:  # very unlikely: words merged
            base += " " + rng.choice(_WORDS)
            ids = self._encode(base)
        text = self._decode(ids[:n])
        for _ in range(8):  # a decode/encode round trip can merge or split a token at the end
            k = len(self._encode(text))
            if k == n:
                break
            if k < n:
                text += " " + rng.choice(_WORDS)
            else:
                text = self._decode(self._encode(text)[:n - (k - n)])
        return text


def token_counter(model: str) -> TokenCounter:
    """The best local token counter for a ``kvflow serve --model`` preset (no downloads)."""
    if model.startswith("tiny-random"):
        return ByteLevelCounter()
    try:
        if model == "smollm2-135m":
            from kvflow_agents.serving.embedded.model.gguf_loader import ensure_converted
            from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

            tok = ChatTokenizer.from_dir(ensure_converted())
            return HFTokenizerCounter(tok.encode, lambda ids: tok.decode(ids), name=model)
    except Exception:  # noqa: BLE001 — fall back to words (approximate)
        pass
    return TokenCounter()


# ------------------------------------------------------------------------------------ spec
@dataclass
class WorkloadSpec:
    agents: int = 10
    variant: str = "cycle"
    fixed: int = 1024
    dynamic: int = 32
    output: int = 16
    rounds: int = 3
    warmup_rounds: int = 1
    workflows: int = 1
    seed: int = 0
    share_prompts: bool = False   # all workflows use the same fixed prompts (one app)
    app: str = "kvflow-bench"
    hints: str = "on"             # on | none | random | reversed | stale (see hint_modes)
    hint_lag: int = 2             # --hints stale: STE map from this many requests earlier

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: choose one of {', '.join(VARIANTS)}, not {self.variant!r}")
        if self.agents < (3 if self.variant == "fanout" else 1):
            raise ValueError(f"agents: the {self.variant} variant needs at least "
                             f"{3 if self.variant == 'fanout' else 1} agents")
        for k in ("fixed", "dynamic", "output", "rounds", "workflows"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}: must be >= 1")
        if self.warmup_rounds < 0:
            raise ValueError("warmup_rounds: must be >= 0")
        from .hint_modes import check_mode
        check_mode(self.hints)
        if self.hint_lag < 1:
            raise ValueError("hint_lag: must be >= 1")

    def agent_names(self) -> list[str]:
        if self.variant == "cycle":
            return [f"agent_{i}" for i in range(self.agents)]
        return ["head"] + [f"worker_{i}" for i in range(1, self.agents - 1)] + ["tail"]

    @property
    def calls_per_round(self) -> int:
        return self.agents

    def as_dict(self) -> dict:
        return asdict(self)


def build_graph(spec: WorkloadSpec):
    """The workflow's :class:`~kvflow_agents.graph.AgentStepGraph`."""
    from kvflow_agents.graph import START, AgentStepGraph
    from kvflow_agents.graph.examples import cycle_graph

    names = spec.agent_names()
    if spec.variant == "cycle":
        return cycle_graph(len(names), names)
    head, workers, tail = names[0], names[1:-1], names[-1]
    g = AgentStepGraph(f"fanout{len(names)}")
    g.add_edge(START, head)
    for w in workers:
        g.add_edge(head, w)
    g.add_join(workers, tail)
    g.add_edge(tail, head)
    return g


def steps(spec: WorkloadSpec) -> list[list[str]]:
    """One round as a list of steps; the agents of a step run concurrently."""
    names = spec.agent_names()
    if spec.variant == "cycle":
        return [[a] for a in names]
    return [[names[0]], names[1:-1], [names[-1]]]


def _seed(*parts: Any) -> int:
    """A stable seed (``hash()`` of str is salted per process)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "big")


class Prompts:
    """Deterministic fixed and dynamic texts of the requested token lengths."""

    def __init__(self, spec: WorkloadSpec, counter: TokenCounter, trial: int = 0) -> None:
        self.spec, self.counter, self.trial = spec, counter, trial
        self._fixed: dict[tuple[int, str], str] = {}

    def fixed(self, workflow: int, agent: str) -> str:
        w = 0 if self.spec.share_prompts else workflow
        key = (w, agent)
        if key not in self._fixed:
            rng = random.Random(_seed("fixed", self.spec.seed, w, agent))
            lead = f"[{agent} w{w} s{self.spec.seed}] You are {agent}."
            self._fixed[key] = self.counter.make_text(self.spec.fixed, rng, lead)
        return self._fixed[key]

    def dynamic(self, workflow: int, rnd: int, agent: str) -> str:
        # Unique per call, also across trials (a repeated trial must not hit last trial's calls).
        rng = random.Random(_seed("dyn", self.spec.seed, self.trial, workflow, rnd, agent))
        return self.counter.make_text(self.spec.dynamic, rng, f"t{self.trial}r{rnd}w{workflow}")

    def messages(self, workflow: int, rnd: int, agent: str) -> list[dict]:
        return [{"role": "system", "content": self.fixed(workflow, agent)},
                {"role": "user", "content": self.dynamic(workflow, rnd, agent)}]


# ------------------------------------------------------------------------------------ client
@dataclass
class CallRecord:
    workflow: int
    round: int
    agent: str
    step: int
    measured: bool
    start: float                      # client clock (perf_counter)
    ttft_s: float                     # first streamed content (or the end, if none); the
                                      # server-reported TTFT when not streaming
    latency_s: float
    ok: bool = True
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    device_hit_tokens: Optional[int] = None
    host_hit_tokens: Optional[int] = None
    computed_tokens: Optional[int] = None
    load_wait_s: Optional[float] = None
    server_ttft_s: Optional[float] = None
    queue_s: Optional[float] = None   # server: arrival -> prefill start (the rest of TTFT: prefill)
    hints: Optional[str] = None       # the server's x-kvflow-hints answer
    instance: Optional[str] = None    # x-kvflow-instance: which worker answered (behind a gateway)
    trial: int = 0                    # which trial of the run made it (``--raw`` records)


@dataclass
class RoundRecord:
    workflow: int
    round: int
    measured: bool
    start: float
    latency_s: float
    trial: int = 0                    # the unit policies are paired on (a trial; a PEER question)


@dataclass
class WorkloadResult:
    calls: list[CallRecord] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    measured_s: float = 0.0           # wall time of the measured phase (all workflows)


def _sglext_fields(rec: CallRecord, doc: dict) -> None:
    """SGLang's ``sglext.cached_tokens_details`` (asked for with
    ``return_cached_tokens_details``): prompt tokens served from device and loaded from host."""
    det = (doc.get("sglext") or {}).get("cached_tokens_details") if isinstance(doc, dict) else None
    if isinstance(det, dict):
        rec.device_hit_tokens = int(det.get("device") or 0)
        rec.host_hit_tokens = int(det.get("host") or 0)


def _usage_fields(rec: CallRecord, usage: Optional[dict]) -> None:
    if not isinstance(usage, dict):
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    det = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = int((det.get("cached_tokens") if isinstance(det, dict) else 0) or 0)
    kv = usage.get("kvflow")
    if isinstance(kv, dict):
        rec.device_hit_tokens = kv.get("device_hit_tokens")
        rec.host_hit_tokens = kv.get("host_hit_tokens")
        rec.computed_tokens = kv.get("computed_tokens")
        rec.load_wait_s = kv.get("load_wait_s")
        rec.server_ttft_s = kv.get("ttft_s")
        rec.queue_s = kv.get("queue_s")


async def chat_call(client: Any, base_url: str, model: str, messages: list[dict], *,
                    max_tokens: int, stream: bool = True, extra: Optional[dict] = None,
                    rec: CallRecord) -> CallRecord:
    """One chat completion (streamed: TTFT = first non-empty content chunk). Fills ``rec``."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **(extra or {})}
    url = base_url.rstrip("/") + "/chat/completions"
    t0 = time.perf_counter()
    first: Optional[float] = None
    usage = None
    try:
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            async with client.stream("POST", url, json=body) as r:
                rec.hints = r.headers.get("x-kvflow-hints")
                rec.instance = r.headers.get("x-kvflow-instance")
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    doc = json.loads(data)
                    if "error" in doc:
                        raise RuntimeError(str(doc["error"])[:300])
                    for ch in doc.get("choices") or []:
                        if first is None and (ch.get("delta") or {}).get("content"):
                            first = time.perf_counter()
                    if doc.get("usage"):
                        usage = doc["usage"]
                    _sglext_fields(rec, doc)
        else:
            r = await client.post(url, json=body)
            rec.hints = r.headers.get("x-kvflow-hints")
            rec.instance = r.headers.get("x-kvflow-instance")
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            doc = r.json()
            usage = doc.get("usage")
            _sglext_fields(rec, doc)
    except Exception as e:  # noqa: BLE001 — recorded, the benchmark goes on
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    rec.start = t0
    rec.latency_s = end - t0
    rec.ttft_s = (first if first is not None else end) - t0
    _usage_fields(rec, usage)
    if not stream and rec.server_ttft_s is not None:  # no stream: the server's TTFT
        rec.ttft_s = float(rec.server_ttft_s)
    return rec


async def post_end(client: Any, base_url: str, hints: Any, model: Optional[str] = None) -> bool:
    """Out-of-band ``end`` for a workflow (best effort: ``False`` if the server has no endpoint).
    Behind a gateway (404 on the hint endpoint) it goes as a hint-only completion, routed by
    the workflow's routing key to the instance that holds it."""
    from kvflow_agents.oob import CARRIER_PATH, HINTS_PATH, server_root
    from kvflow_agents.protocol import HEADER_ROUTING_KEY, hint_only_completion

    doc = hints.to_custom_params()
    doc["kvflow_event"] = "end"
    headers = {HEADER_ROUTING_KEY: hints.headers()[HEADER_ROUTING_KEY]}
    try:
        r = await client.post(server_root(base_url) + HINTS_PATH, json=doc, headers=headers)
        if r.status_code in (404, 405):
            r = await client.post(server_root(base_url) + CARRIER_PATH, headers=headers,
                                  json=hint_only_completion(hints, "end", model or "default"))
        return r.status_code < 400
    except Exception:  # noqa: BLE001
        return False


def fixed_prompt_tokens(spec: WorkloadSpec, counter: TokenCounter) -> int:
    """Tokens of all distinct fixed prompts (the working set the device fraction refers to)."""
    p = Prompts(spec, counter)
    n_wf = 1 if spec.share_prompts else spec.workflows
    return sum(counter.count(p.fixed(w, a)) for w in range(n_wf) for a in spec.agent_names())


def request_tokens(spec: WorkloadSpec, template_overhead: int = 32) -> int:
    """Device tokens one request needs (prompt + output + chat-template slack)."""
    return spec.fixed + spec.dynamic + spec.output + template_overhead


def summarize_calls(calls: Sequence[CallRecord]) -> dict:
    """Aggregate per-request numbers of the measured calls (used by the runner and PEER)."""
    from statistics import mean, median

    ok = [c for c in calls if c.ok]

    def pct(xs, q):
        xs = sorted(xs)
        if not xs:
            return None
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
    ttft = [c.ttft_s for c in ok]
    prompt = sum(c.prompt_tokens for c in ok)
    have_tiers = bool(ok) and all(c.device_hit_tokens is not None for c in ok)
    dev = sum(c.device_hit_tokens or 0 for c in ok) if have_tiers else None
    host = sum(c.host_hit_tokens or 0 for c in ok) if have_tiers else None
    cached = sum(c.cached_tokens for c in ok)
    return {
        "calls": len(calls), "errors": len(calls) - len(ok),
        "ttft_mean_s": mean(ttft) if ttft else None, "ttft_p50_s": median(ttft) if ttft else None,
        "ttft_p90_s": pct(ttft, 0.9),
        "server_ttft_mean_s": (mean([c.server_ttft_s for c in ok]) if ok and all(
            c.server_ttft_s is not None for c in ok) else None),
        "queue_mean_s": (mean([c.queue_s for c in ok]) if ok and all(
            c.queue_s is not None for c in ok) else None),
        "call_latency_mean_s": mean([c.latency_s for c in ok]) if ok else None,
        # time a call spends after its first token (decode, streaming, client): what no cache saves
        "after_first_token_mean_s": mean([c.latency_s - c.ttft_s for c in ok]) if ok else None,
        "prompt_tokens": prompt, "completion_tokens": sum(c.completion_tokens for c in ok),
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "device_hit_rate": dev / prompt if prompt and dev is not None else None,
        "host_hit_rate": host / prompt if prompt and host is not None else None,
        "miss_rate": (prompt - cached) / prompt if prompt else None,
        "load_wait_s": (sum(c.load_wait_s or 0.0 for c in ok) if ok and any(
            c.load_wait_s is not None for c in ok) else None),
        "first_error": next((c.error for c in calls if not c.ok), None),
    }
