"""``kvflow serve --record FILE``: one JSON line per finished request, in the trace format that
``kvflow sim replay`` reads (``serving/sim/workloads.py``), so a real run can be replayed at
scale on simulated hardware. Written from the engine thread only; each line is flushed."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import IO, Any, Optional


class TraceRecorder:
    def __init__(self, path: "str | Path") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: Optional[IO[str]] = self.path.open("a", encoding="utf-8")
        self._t0 = time.monotonic()
        self.records = 0

    def record(self, req: Any, comp: Any, fixed_tokens: int) -> None:
        """``req``: the engine's Request; ``comp``: its Completion; ``fixed_tokens``: the
        server-side fixed-prefix boundary in tokens (0 when unknown)."""
        if self._fh is None:
            return
        h = req.hints
        ste = {a: (None if math.isinf(v) else int(v)) for a, v in dict(getattr(h, "ste", {}) or {}).items()}
        prefix = req.prompt_ids[:fixed_tokens]
        rec = {
            "t": round(req.arrival - self._t0, 6),
            "workflow": getattr(h, "workflow", None) or req.rid,
            "agent": getattr(h, "agent", None) or "unknown",
            "fixed_tokens": int(fixed_tokens),
            "prompt_tokens": len(req.prompt_ids),
            "output_tokens": len(comp.token_ids),
            "ste": ste,
            "step": getattr(h, "step", None),
            "app": getattr(h, "app", None),
            "fixed_hash": hashlib.sha1(json.dumps(prefix).encode()).hexdigest()[:16] if prefix else None,
            "done_t": round(req.arrival - self._t0 + comp.latency_s, 6),
            "cached_tokens": comp.cached_tokens,
            "ttft_s": round(comp.ttft_s, 6),
            "finish_reason": comp.finish_reason,
        }
        self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._fh.flush()
        self.records += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
