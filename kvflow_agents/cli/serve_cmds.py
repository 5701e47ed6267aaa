"""``kvflow serve``: the bundled OpenAI-compatible server with the KVFlow cache (embedded engine)."""

from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def serve(
        ctx: typer.Context,
        model: str = typer.Option("smollm2-135m", help="Model preset: smollm2-135m (default), tiny-random."),
        model_path: Optional[str] = typer.Option(None, help="Local HF Llama dir or .gguf file (overrides --model)."),
        engine: str = typer.Option("embedded", help="Serving engine: embedded (this package's CPU/GPU engine) "
                                   "or sglang (stock SGLang 0.5.23 + the kvflow plugin, GPU; other "
                                   "SGLang flags are passed through)."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        host: str = typer.Option("127.0.0.1", help="Bind address."),
        port: int = typer.Option(30000, help="Port."),
        policy: str = typer.Option("kvflow", help="Cache policy: lru | hicache | kvflow | oracle | "
                                   "oracle-pool (the oracle with this pool for running requests)."),
        device_tokens: int = typer.Option(8192, min=16, help="Device KV pool budget, in tokens."),
        host_tokens: int = typer.Option(65536, min=0, help="Host KV pool, in tokens (hicache/kvflow)."),
        page_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
        host_link_gbps: Optional[float] = typer.Option(
            None, help="EMULATION KNOB for machines without a GPU: pretend host->device KV loads run "
                       "over a link of X GB/s (pages become usable at start + bytes/X; no CPU is "
                       "spent). Use it to demonstrate prefetch/overlap on CPU. Default: real copy speed."),
        lookahead: int = typer.Option(1, min=0, help="Prefetch agents whose steps-to-execution <= this."),
        busy_lookahead: Optional[int] = typer.Option(
            None, min=0, help="With --lookahead above it: prefetch agents further ahead than this "
                              "only while the host link would otherwise be idle (one load at a "
                              "time), so they never queue in front of nearer agents' loads."),
        fill_link_cap: float = typer.Option(
            0.75, min=0.01, max=1.0,
            help="With --busy-lookahead: start those idle-link loads only while the link "
                 "carried loads less than this share of the last 20 s (each evicts an agent "
                 "due later, which costs link volume; 1: no cap)."),
        max_batch: int = typer.Option(16, min=1, help="Max concurrently running requests."),
        torch_threads: Optional[int] = typer.Option(
            None, min=1, help="torch intra-op threads (default: torch's, one per core). On a CPU "
                              "shared with clients, leave them a core: an op split over every "
                              "core stalls whenever one of them is busy elsewhere."),
        partial_eviction: bool = typer.Option(
            False, "--partial-eviction/--whole-node-eviction",
            help="Evict only the tail pages an allocation needs from the last victim (its head "
                 "stays cached; a little more cached in a tight pool), or whole radix nodes as "
                 "SGLang does (the default: keeps each prefix in fewer page runs, which this "
                 "engine's attention reads faster; `kvflow bench layout`)."),
        turn_gaps: bool = typer.Option(
            True, "--turn-gaps/--no-turn-gaps",
            help="Learn which agents' prompts extend their last turn (a group chat's reviewer, "
                 "called again after the expresser) and keep that turn cached at the agent's "
                 "own steps-to-execution until its next request; --no-turn-gaps: only a tool "
                 "hint (kvflow_tool_s) does that."),
        layerwise_load: bool = typer.Option(
            True, "--layerwise-load/--whole-load",
            help="Admit a request whose prefix is still loading from host and let its prefill "
                 "read each layer as it lands, so the load overlaps the request's own compute "
                 "(the default, as SGLang's HiCache loads), or admit it only once the whole "
                 "prefix has landed. The status-aware skip (kvflow) still holds a loading "
                 "request back unless its own prefill hides the load."),
        recompute_aware: bool = typer.Option(
            True, "--recompute-aware/--always-load",
            help="Decline a demand load or prefetch from host that would take longer than "
                 "recomputing the tokens (the link's queue and speed against the measured "
                 "prefill speed; the default), or always load a host hit, as SGLang's HiCache "
                 "does."),
        copy_thread: bool = typer.Option(
            False, "--copy-thread/--inline-copies",
            help="CPU only: KV copies (host backups, loads) on a background thread, or inline "
                 "on the engine thread between forwards (the default: a copy beside a forward "
                 "shares its caches, and inline measured faster; bench/RESULTS.md 6.33)."),
        pin_malloc: bool = typer.Option(
            True, "--pin-malloc/--adaptive-malloc",
            help="Fix glibc malloc's mmap and trim thresholds in the engine's process (the "
                 "default), so a forward's temporaries stay on the heap between steps, or leave "
                 "glibc's adaptive thresholds, under which one process of the same code pages "
                 "them in afresh every step and another does not (on the main thread; served, "
                 "the two measured level end to end: bench/RESULTS.md 6.53)."),
        lazy_decode_pages: bool = typer.Option(
            True, "--lazy-decode-pages/--upfront-decode-pages",
            help="Allocate a request's decode pages as it writes them (the default, as SGLang "
                 "and vLLM; admission reserves them, see --decode-reserve, and the pages not "
                 "written yet hold cache meanwhile) or all of them at admission."),
        decode_reserve: float = typer.Option(
            0.25, min=0.01, max=1.0,
            help="With lazy decode pages: the fraction of max_tokens' decode pages admission "
                 "reserves (SGLang's new_token_ratio). Below 1, a request that writes past its "
                 "reserve into a full pool retracts the newest running request (its KV stays "
                 "cached; it is re-prefilled and decodes on). 1: reserve all, never retract. "
                 "With --deterministic a retracted request replays its outputs (same reply)."),
        admission: Optional[str] = typer.Option(
            None, help="Order waiting requests are admitted in: fcfs (their arrival) or workflow "
                       "(the oldest workflow's call first). Default: the policy's (kvflow: "
                       "workflow; lru, hicache, oracle: fcfs)."),
        status_aware: Optional[bool] = typer.Option(
            None, "--status-aware/--no-status-aware",
            help="Skip a waiting request whose prefix is still loading so the ones behind it "
                 "run meanwhile (KVFlow's status-aware scheduling), or let it hold the queue "
                 "until its load lands. Default: the policy's (kvflow: skip; the others: hold)."),
        skip_scope: Optional[str] = typer.Option(
            None, help="With --status-aware: which requests may run ahead of one whose prefix is "
                       "loading: all, or workflow (its own workflow's and requests without "
                       "hints; another workflow's wait behind it). Default: the policy's "
                       "(kvflow: workflow)."),
        backup: Optional[str] = typer.Option(
            None, help="kvflow: which device victims are written through to the host pool: all "
                       "(default, as HiCache) or tagged (only nodes on some agent's fixed prefix; a "
                       "dynamic suffix is dropped, not copied)."),
        max_prefill_tokens: int = typer.Option(1024, min=1, help="Prompt tokens prefilled per scheduler step (chunked prefill)."),
        max_tokens_default: int = typer.Option(256, "--default-max-tokens", min=1,
                                               help="max_tokens when a request gives none."),
        api_key: Optional[List[str]] = typer.Option(
            None, envvar="KVFLOW_API_KEY",
            help="Require this key (Authorization: Bearer) on every endpoint. Repeat for several "
                 "keys: each key is a tenant (its workflows are its own; fair cache share)."),
        api_keys_file: Optional[str] = typer.Option(
            None, help="Tenants and their keys: a JSON object {\"name\": \"key\"} or 'name key' lines."),
        tenant_header: Optional[str] = typer.Option(
            None, help="When apps share a key: this request header's value names the tenant "
                       "(e.g. x-kvflow-tenant). Trust it only as far as the key's holders."),
        client_cap: str = typer.Option(
            "fair", help="Device cache one tenant's hints may protect: 'fair' (pool / active "
                         "tenants; no cap with one tenant), 'off', a token count, or a fraction "
                         "of the device pool (0.5)."),
        served_model_name: Optional[List[str]] = typer.Option(
            None, help="Model name(s) clients must send (repeatable; default: the model's name). "
                       "Other names get 404, as from OpenAI."),
        max_body_bytes: int = typer.Option(8 * 1024 * 1024, min=1024, help="Largest request body (413 above)."),
        max_prompt_tokens: Optional[int] = typer.Option(
            None, min=1, help="Longest prompt in tokens (default: what the device pool holds). "
                              "Longer text is refused before it is fully tokenized."),
        max_json_depth: int = typer.Option(64, min=4, help="Deepest JSON nesting accepted (400 above)."),
        timeout_headers: float = typer.Option(10.0, help="Seconds a connection may take to send a "
                                              "request's headers (slow clients are closed)."),
        timeout_read: float = typer.Option(30.0, help="Seconds a request body may take to arrive (408)."),
        max_workflows: int = typer.Option(10_000, min=1, help="Hint registry bound: workflows "
                                          "(beyond it the oldest quiet ones are forgotten)."),
        max_agents_per_workflow: int = typer.Option(1024, min=1, help="Hint registry bound: agents per workflow."),
        max_hint_agents: int = typer.Option(262_144, min=1, help="Hint registry bound: agents in all."),
        deterministic: bool = typer.Option(
            False, "--deterministic", help="Batch-invariant decoding: greedy output does not depend on "
            "what else is batched (costs throughput; see README 'Reliability')."),
        lease_s: float = typer.Option(60.0, help="Seconds a quiet workflow's hints stay in force."),
        log_level: str = typer.Option("info", help="debug | info | warning | error."),
        loop: str = typer.Option(
            "auto", help="The HTTP side's event loop, as uvicorn's --loop: auto (uvloop when "
                         "installed), asyncio or uvloop. uvloop lowers the event loop's CPU; "
                         "its effect on the wall time did not repeat from run to run "
                         "(bench/RESULTS.md 6.36, 6.38)."),
        http: str = typer.Option(
            "auto", help="The HTTP/1.1 implementation, as uvicorn's --http: auto (httptools when "
                         "installed, as it is with the serve extra), httptools or h11 (pure "
                         "Python: the engine thread waits for its CPU, bench/RESULTS.md 6.38)."),
        engine_process: bool = typer.Option(
            True, "--engine-process/--engine-thread",
            help="The engine (model, scheduler, KV cache, detokenization) in a process of its own "
                 "and the HTTP side (parsing, tokenization, SSE) in this one, so they do not share "
                 "a GIL (vLLM v1's EngineCore split; 8 workflows: ~0.84x the latency, README), or "
                 "the engine on a thread of this process (--engine-thread)."),
        record: Optional[str] = typer.Option(None, help="Append one JSON line per finished request "
                                             "to this file (the trace format `kvflow sim replay` reads)."),
    ) -> None:
        """Serve an OpenAI-compatible API with workflow-aware KV caching (KVFlow).

        Apps send hints v1 in custom_params; see /kvflow/v1/cache for what is cached where.
        --host-link-gbps is only an emulation knob, for demonstrating prefetch on machines
        without a GPU (on CPU a real host->device copy is too fast to show it).
        """
        if engine == "sglang":
            from kvflow_agents.serving.sglang.launch import serve_sglang

            if not model_path:
                raise typer.BadParameter("the sglang engine needs --model-path (a HF model dir or id)",
                                         param_hint="--model-path")
            argv = ["--model-path", model_path, "--host", host, "--port", str(port),
                    "--page-size", str(page_size), "--log-level", log_level]
            if len(api_key or ()) > 1 or (api_key and api_keys_file):
                raise typer.BadParameter("the sglang engine takes one --api-key (SGLang's own), or "
                                         "--api-keys-file for several tenants", param_hint="--api-key")
            if api_keys_file:  # tenants: the plugin's endpoints check the keys (serving/tenancy.py)
                argv += ["--kvflow-api-keys-file", api_keys_file]
            elif api_key:
                argv += ["--api-key", api_key[0]]
            if tenant_header:
                argv += ["--kvflow-tenant-header", tenant_header]
            raise typer.Exit(serve_sglang(argv + list(ctx.args)))
        if engine != "embedded":
            raise typer.BadParameter(f"unknown engine {engine!r}; choose embedded or sglang", param_hint="--engine")
        if ctx.args:
            raise typer.BadParameter(f"unknown option(s) for the embedded engine: {' '.join(ctx.args)}")
        from kvflow_agents.serving.policy.policies import POLICIES
        if policy not in POLICIES:
            raise typer.BadParameter(f"choose one of {', '.join(POLICIES)}", param_hint="--policy")
        from kvflow_agents.serving.policy.admission import ADMISSION_ORDERS
        if admission is not None and admission not in ADMISSION_ORDERS:
            raise typer.BadParameter(f"choose {' or '.join(ADMISSION_ORDERS)}", param_hint="--admission")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise typer.BadParameter("cpu or cuda", param_hint="--device")
        if host_link_gbps is not None and host_link_gbps <= 0:
            raise typer.BadParameter("must be > 0", param_hint="--host-link-gbps")
        if timeout_headers <= 0 or timeout_read <= 0:
            raise typer.BadParameter("timeouts must be > 0", param_hint="--timeout-headers/--timeout-read")
        keys: dict = {}
        if api_keys_file:
            from kvflow_agents.serving.tenancy import load_keys_file
            try:
                keys = load_keys_file(api_keys_file)
            except (OSError, ValueError) as e:
                raise typer.BadParameter(str(e), param_hint="--api-keys-file") from None
        from kvflow_agents.serving.tenancy import Tenancy, key_tenant_name
        keys.update({key_tenant_name(k): k for k in api_key or () if k})
        try:
            tenancy = Tenancy(keys, tenant_header)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--api-key/--api-keys-file") from None

        import logging
        import time

        import uvicorn

        from kvflow_agents.serving.embedded.engine import Engine, EngineConfig
        from kvflow_agents.serving.embedded.limits import ServerLimits, guarded_protocol, resolve_http
        from kvflow_agents.serving.embedded.server import create_app

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = EngineConfig(model=model, model_path=model_path, device=device, policy=policy,
                           device_tokens=device_tokens, host_tokens=host_tokens, page_size=page_size,
                           host_link_gbps=host_link_gbps, lookahead=lookahead, max_batch=max_batch,
                           busy_lookahead=busy_lookahead,
                           fill_link_cap=None if fill_link_cap >= 1 else fill_link_cap,
                           torch_threads=torch_threads, partial_eviction=partial_eviction,
                           turn_gaps=turn_gaps, layerwise_load=layerwise_load,
                           recompute_aware=recompute_aware, copy_thread=copy_thread,
                           pin_malloc=pin_malloc,
                           lazy_decode_pages=lazy_decode_pages, decode_reserve=decode_reserve,
                           admission=admission, status_aware=status_aware,
                           skip_scope=skip_scope, lease_s=lease_s, backup=backup,
                           default_max_tokens=max_tokens_default,
                           max_prefill_tokens=max_prefill_tokens, record_path=record,
                           max_prompt_tokens=max_prompt_tokens, client_cap=client_cap,
                           max_workflows=max_workflows, max_agents_per_workflow=max_agents_per_workflow,
                           max_hint_agents=max_hint_agents, deterministic=deterministic,
                           served_model_name=served_model_name[0] if served_model_name else None)
        limits = ServerLimits(max_body_bytes=max_body_bytes, max_json_depth=max_json_depth,
                              timeout_headers_s=timeout_headers, timeout_read_s=timeout_read)
        try:
            cfg.validate()
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        loop = _event_loop(loop)
        try:
            http = resolve_http(http)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--http") from None
        t0 = time.perf_counter()
        if engine_process:
            from kvflow_agents.serving.embedded.engine_core import EngineCoreClient
            try:
                eng = EngineCoreClient(cfg, log_level=log_level)
            except RuntimeError as e:
                raise SystemExit(f"kvflow serve: {e}") from None
        else:
            eng = Engine(cfg)
        d = eng.describe()
        url = f"http://{host}:{port}/v1"
        link = (f"{host_link_gbps} GB/s (EMULATED host link)" if host_link_gbps else "real copy speed")
        typer.echo(f"kvflow serve: model={eng.model_name} engine=embedded device={device} "
                   f"policy={policy} loaded in {time.perf_counter() - t0:.1f}s"
                   + (" (engine process)" if engine_process else ""))
        typer.echo(f"  KV pools: device {device_tokens} tokens, host "
                   f"{host_tokens if d['host_tier'] else 0} tokens, page {page_size}; "
                   f"host link: {link}; KV copies {d['copy_mode']}; lookahead {lookahead}; "
                   f"max batch {max_batch}; event loop {loop}, HTTP {http}; "
                   f"admission {d['admission']}"
                   + (f" (status-aware, skip scope {d['skip_scope']})" if d["status_aware"] else "")
                   + "; eviction "
                   f"{'partial nodes' if partial_eviction else 'whole nodes'}"
                   + (f", backup {d['backup']}" if d["backup"] else "")
                   + "; decode pages "
                   f"{'lazy' if lazy_decode_pages else 'upfront'}"
                   + (f" (reserve {d['decode_reserve']:g} of max_tokens)" if lazy_decode_pages else "")
                   + f"; malloc thresholds {'pinned' if d.get('malloc_pinned') else 'adaptive'}")
        typer.echo(f"  OpenAI base URL: {url}   (KVFlow: {url[:-3]}/kvflow/v1/cache, /metrics)"
                   + (f"   [API key required; {len(keys)} tenant(s)]" if keys else "")
                   + ("   [deterministic]" if deterministic else ""))
        try:
            app = create_app(eng, tenancy, limits=limits, model_aliases=served_model_name or ())
            uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=5,
                        http=guarded_protocol(limits, http), loop=loop)
        finally:
            eng.shutdown()


def _event_loop(loop: str) -> str:
    """``--loop`` resolved as uvicorn's ``auto`` would (uvloop when installed); uvloop asked
    for where it is not installed is a bad flag, not a traceback at startup."""
    import importlib.util

    if loop not in ("auto", "asyncio", "uvloop"):
        raise typer.BadParameter(f"{loop!r}: use auto, asyncio or uvloop", param_hint="--loop")
    installed = importlib.util.find_spec("uvloop") is not None
    if loop == "uvloop" and not installed:
        raise typer.BadParameter("uvloop is not installed (pip install uvloop, or --loop asyncio)",
                                 param_hint="--loop")
    return "uvloop" if loop == "uvloop" or (loop == "auto" and installed) else "asyncio"
