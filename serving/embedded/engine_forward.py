"""``ForwardSteps``: the model side of the engine thread's step, mixed into
:class:`~.engine_loop.EngineLoop` (and so into :class:`~.engine.Engine`): chunked prefill,
the batched decode, decode-page growth and retraction.

Invariant: as in ``engine_loop.py``, every method runs on the engine thread; it reads the state
``Engine.__init__`` builds (annotated below) and owns none of its own.

- Prefill is chunked: at most ``max_prefill_tokens`` prompt tokens per step, oldest admitted
  first, each request reusing its cached device prefix. A request admitted while its prefix
  still loads (layer-wise, ``EngineLoop._may_load_inline``) waits before each layer for that
  layer to land, and the wait is credited as overlapped to its session.
- Decode is one batched forward over every running request whose prefill is done. With lazy
  decode pages each request's next page is allocated as it is written; growth past the
  optimistic reserve that finds no room retracts the newest running request (vLLM's
  preemption by recompute: its KV stays cached and it is re-prefilled from the cache).
- A batched decode or sampling call that raises is retried one sequence at a time, so only
  the sequence that fails is failed (``EngineLoop._guard``).

Deterministic mode (``EngineConfig.deterministic``): batch-invariant decode kernels
(``LlamaModel.decode_batch(invariant_rows=max_batch)``), prefill chunks that end at multiples of
``deterministic_chunk`` (absolute positions, whatever shares the step's budget), prefix reuse
aligned to those chunks (the manager's ``reuse_align``), and only prompt KV cached
(decode-written KV is not bit-identical to a prefill's). Greedy output then depends on the
request alone, not on batching or cache state.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from .scheduler import Request, RequestState, Scheduler

if TYPE_CHECKING:  # pragma: no cover
    from kvflow_agents.serving.policy import KVCacheManager

    from .engine_config import EngineConfig
    from .kv_pool import PagedKVPool
    from .sampling import BatchSampler

log = logging.getLogger("kvflow.engine")


class ForwardSteps:
    """Prefill, decode, decode-page growth and retraction (module doc)."""

    # built by Engine.__init__
    config: "EngineConfig"
    manager: "KVCacheManager"
    pool: "PagedKVPool"
    scheduler: Scheduler
    sampler: "BatchSampler"
    model: Any
    counters: dict
    _cuda: bool
    _sleep: Callable[[float], None]
    # provided by EngineLoop
    _guard: Callable[..., Any]
    _emit: Callable[..., None]

    def _prefill(self) -> bool:
        """Chunked prefill: at most ``max_prefill_tokens`` prompt tokens per step, oldest
        admitted first, so a long prompt does not stall the running decodes for seconds."""
        budget, did = self.config.max_prefill_tokens, False
        det = self.config.deterministic_chunk if self.config.deterministic else None
        for req in list(self.scheduler.running):
            n = len(req.session.tokens)  # the prompt (after a retraction: + outputs so far)
            if req.prefilled >= n:
                continue
            if budget <= 0:
                break
            if det:
                # Deterministic: chunks end at multiples of ``det`` in absolute positions, so a
                # request's prefill never depends on what else shares the step's budget; a chunk
                # that does not fit waits for the next step (the first always runs).
                k = min(n - req.prefilled, det - req.prefilled % det)
                if k > budget and did:
                    break
            else:
                k = min(n - req.prefilled, budget)
            budget -= k
            did = True
            self._guard(req, "prefill", self._prefill_chunk, req, k)
        return did

    def _prefill_chunk(self, req: Request, k: int) -> None:
        tokens, s = req.session.tokens, req.session
        self.pool.wait_copies(req.pages)  # loads into its prefix landed, backups out of reused pages read
        # admitted with its load in flight: each layer waits for that layer to land (None:
        # it landed before this prefill began; overlapped() still credits what was hidden)
        inline = bool(s.inline_loads)
        ready_at = s.layer_ready_times(self.model.config.num_layers) if inline else None
        waits: list = []
        before_layer = None if ready_at is None else self._layer_waiter(ready_at, waits)
        t0 = time.perf_counter()
        logits = self.model.prefill(self.pool.device_kv, tokens[req.prefilled:req.prefilled + k],
                                    req.pages, req.prefilled, before_layer=before_layer)
        dt = time.perf_counter() - t0
        if inline:
            waited = sum(b - a for a, b in waits)
            dt -= waited  # the forward's own time (prefill speed, recompute estimate)
            self.counters["layerwise_loads"] += 1
            self.counters["layerwise_wait_s"] += waited
            s.overlapped(waits)
        self.counters["prefill_forward_s"] += dt
        if self.config.recompute_aware:  # the recompute estimate of load-vs-recompute
            self.manager.observe_prefill(k, dt)
        req.prefilled += k
        req.kv_len = req.prefilled  # session.tokens is a prefix of prompt + outputs
        if req.prefilled == len(tokens):
            req.session.commit()  # the prompt joins the tree; the fixed prefix is tagged
            if not req.output_ids:  # (a retracted request's next input is its last output)
                self._emit(req, *self.sampler.sample(logits, [req])[0])

    def _layer_waiter(self, ready_at: list, waits: list) -> Callable[[int], None]:
        """``before_layer`` for a prefill whose prefix loads layer by layer: sleep until layer
        ``i`` has landed (``ready_at[i]``, the pool's clock), recording each wait in ``waits``."""
        now, sleep = self.pool.now, self._sleep

        def before_layer(i: int) -> None:
            t = now()
            if ready_at[i] > t:
                sleep(ready_at[i] - t)
                waits.append((t, now()))
        return before_layer

    def _ensure_device_capacity(self) -> None:
        """The oracle's page allocator grows; grow the device tensor to match."""
        import torch

        need, have = self.manager.device.capacity, self.pool.num_device_pages
        if need <= have:
            return
        self.pool.synchronize()  # a load in flight writes into the tensor being replaced
        kv = self.pool.device_kv
        extra = max(need, 2 * have) - have
        shape = kv.shape[:2] + (extra,) + kv.shape[3:]
        self.pool.device_kv = torch.cat([kv, torch.zeros(shape, dtype=kv.dtype, device=kv.device)], 2)

    def _decode(self) -> bool:
        """One batched decode step; False if none could run (their next pages wait for a load)."""
        running = [r for r in self.scheduler.running if r.decoding]
        if self.manager.lazy_decode:  # each writes one KV slot: its page must be there
            running = self._grow(running)
            self._ensure_device_capacity()
            if not running:
                return False
        # each writes the KV of its token at kv_len: its last output (and samples the next), or
        # (replaying after a retraction to its prompt) an earlier output, its logits unused
        n0 = [r.kv_len for r in running]
        seqs = [(r.output_ids[pos - len(r.prompt_ids)], r.pages, pos)
                for r, pos in zip(running, n0)]
        sampled = [i for i, r in enumerate(running) if r.kv_len == r.seq_len]
        # CUDA: the stream waits for every load (free); CPU: only for pages this step writes
        # (each sequence's next slot, maybe a page just evicted whose backup is still queued;
        # what it reads was waited for at its prefill)
        if self.pool.copying:
            self.pool.wait_copies(None if self._cuda else [r.pages[p // self.pool.page_size]
                                                          for r, p in zip(running, n0)])
        self.counters["decode_steps"] += 1
        picks: dict = {}
        try:
            t0 = time.perf_counter()
            logits = self._decode_logits(seqs)
            self.counters["decode_forward_s"] += time.perf_counter() - t0
            if len(sampled) < len(running):
                logits = logits[sampled]
            picks = dict(zip(sampled, self.sampler.sample(logits, [running[i] for i in sampled])))
        except Exception:  # noqa: BLE001 - find the sequence that fails; the others go on
            log.exception("batched decode failed; retrying its %d sequences one by one", len(seqs))
            for i, (r, sq) in enumerate(zip(running, seqs)):
                if i in sampled:
                    picks[i] = self._guard(r, "decode", self._decode_one, r, sq)
                else:
                    self._guard(r, "decode", self._decode_logits, [sq])
        for i, r in enumerate(running):
            if r.state is not RequestState.RUNNING:
                continue  # failed in the retry
            r.kv_len += 1
            if picks.get(i) is not None:
                self._guard(r, "sampling", self._emit, r, *picks[i])
        return True

    def _grow(self, running: list) -> list:
        """Lazy decode: the page of each request's next KV slot. Where growth past an optimistic
        reserve finds no room, retract running requests, the newest admitted first (vLLM's
        preemption order), until the others can grow. Returns those that can decode now."""
        ok = {id(r) for r in running
              if self._guard(r, "decode page allocation", r.session.grow, r.kv_len + 1)}
        short = [r for r in running if id(r) not in ok and r.state is RequestState.RUNNING
                 and r.session.needs_room]
        while short:
            victim = next((r for r in reversed(self.scheduler.running)
                           if r.decoding and not r.session.full_reserve), None)
            if victim is None:
                break
            self._guard(victim, "retraction", self._retract, victim)
            ok.discard(id(victim))
            still = []
            for r in short:
                if r is victim or r.state is not RequestState.RUNNING:
                    continue
                if self._guard(r, "decode page allocation", r.session.grow, r.kv_len + 1):
                    ok.add(id(r))
                elif r.state is RequestState.RUNNING and r.session.needs_room:
                    still.append(r)
            short = still
        return [r for r in running if id(r) in ok and r.state is RequestState.RUNNING]

    def _retract(self, req: Request) -> None:
        """Back to waiting with what it wrote cached (session.retract); re-admitted, it is
        prefilled from the cache and decodes on from its last output token. Deterministic mode
        caches only its prompt (decode-written KV is not what a prefill would write) and, once
        re-admitted, replays its outputs through decode steps (batch-invariant: the same KV
        bits), so its reply is the one it would have written without the retraction."""
        written = len(req.prompt_ids) if self.config.deterministic else req.kv_len
        req.session.retract(req.prompt_ids + req.output_ids, written)
        self.scheduler.retracted(req)
        req.prefilled = req.kv_len = 0
        log.debug("retracted %s after %d tokens (no room past its reserve)",
                  req.rid, len(req.output_ids))

    def _decode_logits(self, seqs: list):
        """One decode step for ``seqs`` (each writes only its own KV slot, so re-running a
        subset after a failure is safe). Deterministic mode: batch-invariant kernels."""
        rows = self.config.max_batch if self.config.deterministic else None
        return self.model.decode_batch(self.pool.device_kv, seqs, invariant_rows=rows)

    def _decode_one(self, req: Request, seq) -> tuple:
        return self.sampler.sample(self._decode_logits([seq]), [req])[0]
