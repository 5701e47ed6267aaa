"""Tokenizing long texts in a helper process (see ``ChatTokenizer.offload_long_texts``).

Kept apart from ``model/`` so the spawned process imports ``tokenizers`` only, not torch.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import multiprocessing
import threading
from typing import Optional

from tokenizers import Tokenizer


class OffloadEncoder:
    """One spawned process with a copy of the tokenizer, started at the first long text;
    ``encode`` blocks the calling thread (not the GIL) until the ids come back."""

    def __init__(self, tokenizer: Tokenizer, min_chars: int) -> None:
        self.tokenizer = tokenizer
        self.min_chars = min_chars
        self.pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            if self.pool is None:
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init, initargs=(self.tokenizer.to_str(),))
        try:
            return self.pool.submit(_encode, text).result()
        except concurrent.futures.process.BrokenProcessPool:  # the helper died: start another
            with self._lock:
                self.pool = None
            raise

    def close(self) -> None:
        with self._lock:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.pool = None


_TOKENIZER: Optional[Tokenizer] = None


def _init(tokenizer_json: str) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(text: str) -> list[int]:
    return _TOKENIZER.encode(text, add_special_tokens=False).ids  # type: ignore[union-attr]
