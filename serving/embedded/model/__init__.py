"""The embedded engine's model layer.

``load_model(name_or_path, device="cpu", dtype=None) -> (LlamaModel, ChatTokenizer, LlamaConfig)``
where ``name_or_path`` is a preset (``smollm2-135m`` default, ``tiny-random``,
``llama-3.1-8b-shape``), a local HF Llama dir (safetensors + config.json + tokenizer.json), or a
``.gguf`` file; ``load_tokenizer`` the same without the weights. See ``llama.py`` for the forward and ``tokenizer.py`` for chat templates.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import DEFAULT_MODEL, PRESETS, LlamaConfig, config_from_path, get_preset
from .generate import greedy_generate
from .llama import LlamaModel
from .tokenizer import ChatTokenizer, DetokenizeStream

__all__ = ["load_model", "load_tokenizer", "LlamaModel", "LlamaConfig", "ChatTokenizer", "DetokenizeStream",
           "PRESETS", "DEFAULT_MODEL", "get_preset", "config_from_path", "greedy_generate"]

_RANDOM = ("tiny-random", "llama-3.1-8b-shape")


def load_model(name_or_path: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | None = None,
               ) -> tuple[LlamaModel, ChatTokenizer, LlamaConfig]:
    """Build a model + tokenizer. ``dtype`` overrides the weights/KV dtype (e.g. "float32")."""
    path, cfg = _resolve(name_or_path, dtype)
    if path is None:
        if cfg.num_layers >= 16 and torch.device(device).type == "cpu":
            raise ValueError(f"{name_or_path} is a GPU-sized random model; use device='cuda'")
        return LlamaModel.random(cfg, device), ChatTokenizer.byte_level(), cfg
    return LlamaModel.from_dir(path, cfg, device), ChatTokenizer.from_dir(path), cfg


def load_tokenizer(name_or_path: str = DEFAULT_MODEL, dtype: str | None = None,
                   ) -> tuple[ChatTokenizer, LlamaConfig]:
    """The tokenizer and config of what :func:`load_model` would load, without its weights
    (the HTTP side of ``kvflow serve --engine-process``)."""
    path, cfg = _resolve(name_or_path, dtype)
    return (ChatTokenizer.byte_level() if path is None else ChatTokenizer.from_dir(path)), cfg


def _resolve(name_or_path: str, dtype: str | None) -> tuple[Path | None, LlamaConfig]:
    """(model dir, config); no dir for a random-weight preset."""
    if name_or_path in _RANDOM:
        cfg = get_preset(name_or_path)
        return None, (cfg.replace(dtype=dtype) if dtype else cfg)
    if name_or_path == "smollm2-135m":
        from .gguf_loader import ensure_converted
        path, name = ensure_converted(), "smollm2-135m"
    elif str(name_or_path).endswith(".gguf") and os.path.isfile(name_or_path):
        from .gguf_loader import ensure_converted
        path = ensure_converted(name_or_path)
        name = Path(name_or_path).stem
    elif os.path.isdir(name_or_path):
        path, name = Path(name_or_path), Path(name_or_path).name
    else:
        get_preset(name_or_path)  # raises a helpful "unknown preset" error
        raise AssertionError
    cfg = config_from_path(path).replace(name=name)
    return path, (cfg.replace(dtype=dtype) if dtype else cfg)
