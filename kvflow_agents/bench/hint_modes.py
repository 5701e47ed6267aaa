"""Wrong, stale or missing hints, on purpose: ``kvflow bench … --hints MODE``.

Hints are advisory; a server must never cache worse with a bad hint than with none. To measure
that, the benches can send the hints an app would send (``on``) or a corrupted version of them:

- ``none``: no hints at all (an uninstrumented app; also what a client like AIPerf sends);
- ``random``: every agent's steps-to-execution (STE) is drawn at random (0 .. agents-1) on
  every request, so the hints carry no information;
- ``reversed``: the order is turned around (``max - ste`` over the finite values): the agent
  that runs next looks farthest away and the farthest looks next;
- ``stale``: the STE map an app computed ``lag`` requests earlier in the same workflow (a
  client whose graph or tracker lags behind the run).

Only the STE map and ``next`` are corrupted; the ids (workflow, agent, step, app) and the fixed-
prompt boundary stay true, as they would from a real client with a wrong graph. An ``end`` event
passes unchanged (except under ``none``). :class:`HintMangler` is the function
:func:`kvflow_agents.context.set_hint_transform` takes; it is deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from collections import deque
from typing import Optional

from kvflow_agents.graph import next_agents
from kvflow_agents.protocol import Hints

HINT_MODES = ("on", "none", "random", "reversed", "stale")


def check_mode(mode: str) -> str:
    if mode not in HINT_MODES:
        raise ValueError(f"hints: choose one of {', '.join(HINT_MODES)}, not {mode!r}")
    return mode


class HintMangler:
    """``mangler(hints) -> hints | None`` for one benchmark run (thread-safe; ``stale`` keeps a
    short history per workflow)."""

    def __init__(self, mode: str, *, seed: int = 0, lag: int = 2) -> None:
        self.mode = check_mode(mode)
        if lag < 1:
            raise ValueError("lag: must be >= 1")
        self.seed, self.lag = seed, lag
        self._history: dict[str, deque] = {}
        self._lock = threading.Lock()

    def __call__(self, h: Hints) -> Optional[Hints]:
        if self.mode == "none":
            return None
        if self.mode == "on" or h.event == "end" or not h.ste:
            return h
        ste = dict(h.ste)
        if self.mode == "random":
            key = f"{self.seed}|{h.workflow}|{h.step}|{h.agent}".encode()
            rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
            new = {a: float(rng.randrange(len(ste))) for a in sorted(ste)}
        elif self.mode == "reversed":
            finite = [v for v in ste.values() if v < math.inf]
            top = max(finite) if finite else 0.0
            new = {a: (top - v if v < math.inf else v) for a, v in ste.items()}
        else:  # stale
            with self._lock:
                hist = self._history.setdefault(h.workflow, deque(maxlen=self.lag + 1))
                hist.append(ste)
                new = dict(hist[0])
        return h.model_copy(update={"ste": new, "next": sorted(next_agents(new))})

    def describe(self) -> str:
        return {"on": "correct hints", "none": "no hints", "random": "random STE on every request",
                "reversed": "STE order reversed",
                "stale": f"STE map from {self.lag} requests earlier"}[self.mode]
