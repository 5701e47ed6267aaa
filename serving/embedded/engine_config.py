"""``EngineConfig`` (every knob of the embedded engine), input errors, and token sampling."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from kvflow_agents.serving.policy.admission import check_admission, check_skip_scope
from kvflow_agents.serving.policy.policies import KVFlowPolicy

from .scheduler import SamplingParams


class EngineInputError(ValueError):
    """A request the engine cannot serve as given (HTTP 400). ``param`` names the field."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    model_path: Optional[str] = None      # local HF dir or .gguf; overrides ``model``
    device: str = "cpu"
    dtype: Optional[str] = None           # override weights/KV dtype ("float32", ...)
    policy: str = "kvflow"                # lru | hicache | kvflow | oracle
    device_tokens: int = 8192             # "device" KV pool budget (tokens)
    host_tokens: int = 65536              # host KV pool (hicache/kvflow)
    page_size: int = 16
    host_link_gbps: Optional[float] = None  # emulated host link (GB/s); None = real copy speed
    lookahead: int = 1                    # prefetch agents with STE <= lookahead
    # ... and those beyond this STE only while the link would otherwise be idle (None: no
    # such band; serving/policy/prefetch.py)
    busy_lookahead: Optional[int] = None
    # ... while the link carried loads less than this share of the last 20 s (None: no cap)
    fill_link_cap: Optional[float] = 0.75
    max_batch: int = 16
    # torch intra-op threads (process-wide; None: torch's default, one per core). On a CPU the
    # engine shares the cores with its HTTP front end and, in a benchmark, with the client:
    # an op split over every core stalls whenever one of them is busy elsewhere.
    torch_threads: Optional[int] = None
    # Evict whole radix nodes (False, as SGLang does), or only the tail pages an allocation
    # needs from the last victim (splitting its node; the head stays cached). Measured side by
    # side on this engine (bench/RESULTS.md 6.10-6.11): partial eviction keeps a little more
    # cached in a tight pool (PEER on LangGraph at 80 %: 0.88 of the oracle's cache-cost saving
    # vs 0.79), but the tails it reloads into free holes scatter prefixes (8 concurrent
    # workflows: 19 page runs per sequence instead of 3.6), and this engine's attention
    # gathers every sequence's pages per decode step (`kvflow bench layout`: 19 runs +9-11 %).
    # End to end whole nodes were faster with 8 workflows (1.31x hicache vs 1.17x) and level
    # elsewhere (32 workflows at 10 %, PEER), so they are the default here. (The policy core's
    # own default stays partial: the simulator's GPU cost model pays nothing per page run.)
    partial_eviction: bool = False
    # an agent whose prompts extend its last turn keeps that turn tagged at its own STE
    # (serving/policy/toolgap.py, turn gaps); False: only tool hints (kvflow_tool_s) do that
    turn_gaps: bool = True
    # CPU: KV copies (backups, loads) inline on the engine thread, between forwards (False),
    # or on a background copy thread (True), which overlaps them with the forwards but runs
    # them through the same caches: measured slower with 8 workflows (bench/RESULTS.md 6.33).
    copy_thread: bool = False
    # Fix glibc's malloc mmap/trim thresholds in this process (serving/embedded/malloc_tuning.py):
    # a forward's temporaries then stay on the heap between steps instead of being faulted in
    # afresh as often as glibc's adaptive thresholds happen to allow in this process (model on
    # the main thread: 0-2,000 pages per decode step from one start to the next; a served
    # engine's thread faults mostly while warming up, and end to end the pin measured level;
    # RESULTS.md 6.53).
    pin_malloc: bool = True
    # Allocate a request's decode pages as it writes them (True, as SGLang and vLLM do) or all
    # of prompt + max_tokens at admission. Admission reserves them either way (a running
    # request never runs out); lazily, the pages it has not written yet hold cache meanwhile,
    # e.g. the next agent's prefetch while a request with max_tokens 240 writes 60 tokens
    # (bench/RESULTS.md 6.14).
    lazy_decode_pages: bool = True
    # With lazy pages: the fraction of the decode pages max_tokens allows that admission
    # reserves (SGLang's new_token_ratio). Replies mostly stop well short of max_tokens (PEER's
    # executors write ~130 of 240), and a full reserve made the third of three parallel
    # executors wait 3-16 s at the bench's default pool for room the first two never used.
    # Growth past the reserve that finds no room retracts the newest running request (vLLM's
    # preemption by recompute: its KV stays cached, it is re-prefilled from the cache and
    # decodes on). 1.0: never retract. Deterministic mode caches only the prompt of a
    # retracted request and replays its outputs through (batch-invariant) decode steps, since
    # a re-prefill is not bit-identical to decode-written KV.
    decode_reserve: float = 0.25
    max_inflight_loads: int = 4
    lease_s: float = 60.0
    max_prefill_tokens: int = 1024        # prompt tokens prefilled per scheduler step (chunked)
    default_max_tokens: int = 256
    recompute_aware: bool = True          # decline a host load that would take longer than
                                          # recomputing, counted for every running request it
                                          # stalls (measured prefill speed; loads.recompute_cost_s)
    # A request whose prefix is still loading (a demand load, a prefetch not landed yet) may be
    # admitted at once, its prefill waiting for each layer of the prefix as it lands, so the
    # load overlaps the request's own compute (SGLang's HiCache loads layer by layer so). The
    # status-aware skip still holds it back unless its own prefill hides the load
    # (engine_loop._may_load_inline). False: admit only once the whole prefix landed.
    layerwise_load: bool = True
    max_skip_s: float = 5.0               # a request skipped this long blocks younger ones
    status_aware: Optional[bool] = None   # None = the policy's default (kvflow: on)
    skip_scope: Optional[str] = None      # all | workflow: who may run ahead of a loading request
    admission: Optional[str] = None       # fcfs | workflow; None = the policy's (kvflow: workflow)
    backup: Optional[str] = None          # kvflow: all | tagged victims written through to host
    served_model_name: Optional[str] = None
    record_path: Optional[str] = None     # JSONL trace of finished requests (kvflow sim replay)
    max_prompt_tokens: Optional[int] = None  # None: what the device pool / model can hold
    # Fairness between clients (tenants): "fair" = device pool / active tenants (no cap with
    # one), "off", an int = tokens, a float in (0, 1] = share of the device pool.
    client_cap: Union[str, int, float, None] = "fair"
    # Hint registry bounds (serving/policy/hints.py): expired workflows are forgotten
    # ``forget_after_s`` after their lease ends (None: one more lease).
    max_workflows: int = 10_000
    max_agents_per_workflow: int = 1024
    max_hint_agents: int = 262_144
    forget_after_s: Optional[float] = None
    # Batch-invariant mode: greedy output does not depend on batching (see engine docstring).
    deterministic: bool = False
    deterministic_chunk: int = 256        # prefill chunk / prefix-reuse alignment (tokens)

    def validate(self) -> None:
        if self.page_size < 1 or self.device_tokens < self.page_size:
            raise ValueError("device_tokens must be >= page_size >= 1")
        if self.host_tokens < 0:
            raise ValueError("host_tokens must be >= 0")
        if self.host_link_gbps is not None and not self.host_link_gbps > 0:
            raise ValueError("host_link_gbps must be > 0")
        r = self.decode_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"decode_reserve must be in (0, 1], got {r!r}")
        if self.max_batch < 1 or self.max_inflight_loads < 1:
            raise ValueError("max_batch and max_inflight_loads must be >= 1")
        b = self.busy_lookahead
        if b is not None and not 0 <= b < self.lookahead:
            raise ValueError(f"busy_lookahead must be >= 0 and below lookahead ({self.lookahead}), "
                             f"got {b!r}")
        c = self.fill_link_cap
        if c is not None and not 0 < c <= 1:
            raise ValueError(f"fill_link_cap must be in (0, 1] (or None: no cap), got {c!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1 (or None: torch's default)")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if min(self.max_workflows, self.max_agents_per_workflow, self.max_hint_agents) < 1:
            raise ValueError("max_workflows, max_agents_per_workflow, max_hint_agents must be >= 1")
        c = self.deterministic_chunk
        if c < self.page_size or c % self.page_size or c > 512:
            raise ValueError("deterministic_chunk must be a multiple of page_size, at most 512")
        if self.admission is not None:
            check_admission(self.admission)
        if self.skip_scope is not None:
            check_skip_scope(self.skip_scope)
        if self.backup is not None:
            if self.backup not in KVFlowPolicy.BACKUP_MODES:
                raise ValueError(f"backup must be one of {', '.join(KVFlowPolicy.BACKUP_MODES)}, "
                                 f"got {self.backup!r}")
            if self.policy != "kvflow":
                raise ValueError("backup applies to the kvflow policy (lru keeps no host copies; "
                                 "hicache writes every victim through; the oracle never evicts)")
        client_cap_pages(self, 1)  # raises on a bad value


def client_cap_pages(cfg: EngineConfig, device_pages: int) -> Union[str, int, None]:
    """``EngineConfig.client_cap`` as the manager's ``client_cap_pages``: "fair", None or pages."""
    v = cfg.client_cap
    if v is None or v == "off":
        return None
    if v == "fair":
        return "fair"
    if isinstance(v, str):
        try:
            v = float(v) if "." in v else int(v)
        except ValueError:
            raise ValueError(f"client_cap: 'fair', 'off', tokens or a fraction, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"client_cap: must be positive, got {v!r}")
    if isinstance(v, float):
        if v > 1:
            raise ValueError(f"client_cap: a fraction must be in (0, 1], got {v!r}")
        return max(1, int(device_pages * v))
    return max(1, v // cfg.page_size)


def sample_tokens(logits, params, generators) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]``: the engine's one sampling call per step.
    Greedy rows (``temperature == 0``) share a single ``argmax``; the others go through
    :func:`sample_token` with their own generator."""
    import torch

    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    out: list[int] = [0] * len(params)
    if len(greedy) == len(params):
        return torch.argmax(logits, -1).tolist()
    if greedy:
        idx = torch.as_tensor(greedy, dtype=torch.long, device=logits.device)
        for i, tok in zip(greedy, torch.argmax(logits.index_select(0, idx), -1).tolist()):
            out[i] = tok
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = sample_token(logits[i], p, generators[i])
    return out


def sample_token(logits, params: SamplingParams, generator) -> int:
    """Greedy when ``temperature == 0``; else temperature + nucleus (top-p) sampling."""
    import torch

    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / params.temperature, -1)  # CPU generator
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, -1) - sp < params.top_p
        sp = sp * keep
        return int(si[torch.multinomial(sp / sp.sum(), 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}


def params_from_kwargs(sampling: dict) -> SamplingParams:
    """``SamplingParams`` from keyword arguments (``stop`` may be a string)."""
    bad = set(sampling) - _SAMPLING_KEYS
    if bad:
        raise TypeError(f"unknown sampling parameters: {sorted(bad)}")
    if "stop" in sampling:
        s = sampling["stop"]
        sampling = {**sampling, "stop": (s,) if isinstance(s, str) else tuple(s or ())}
    return SamplingParams(**sampling)
