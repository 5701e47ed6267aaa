"""Single-sequence greedy generation over explicit pages: for tests, smoke runs and the CLI.
(The engine's scheduler does continuous batching itself with ``prefill``/``decode_batch``.)"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .llama import LlamaModel


def greedy_generate(model: LlamaModel, kv: torch.Tensor, pages: Sequence[int],
                    prompt_ids: Sequence[int], max_new_tokens: int, *,
                    stop_ids: Iterable[int] = (), cached_len: int = 0) -> list[int]:
    """Prefill ``prompt_ids[cached_len:]`` (the first ``cached_len`` are already in ``pages``),
    then decode greedily. ``pages`` must cover ``len(prompt_ids) + max_new_tokens`` positions."""
    stop = set(stop_ids)
    logits = model.prefill(kv, list(prompt_ids[cached_len:]), pages, cached_len)
    out: list[int] = []
    pos = len(prompt_ids)
    while len(out) < max_new_tokens:
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in stop or len(out) == max_new_tokens:
            break
        logits = model.decode_batch(kv, [(tok, pages, pos)])[0]
        pos += 1
    return out
