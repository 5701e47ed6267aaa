"""Cost model of one serving engine, from a hardware x model profile (``profiles.json``).

- KV bytes per token = 2 * layers * kv_heads * head_dim * dtype_bytes.
- Prefill of ``n`` new tokens after ``ctx`` cached ones: ``a + b*n + c*n*(ctx + n/2)`` (the
  ``n/2``: on average a new token attends to half the new run as well); a batch pays ``a`` once.
- Decode step: ``base + per_seq*batch + per_ctx*sum(context lengths)``.
- Host->device load of ``bytes``: ``alpha + bytes / link`` (alpha-beta model), FIFO on one link.
- Client side (per call, after the engine finished it): ``request_overhead_s +
  stream_per_token_s * output tokens`` (HTTP round trip, request handling outside the
  scheduler, SSE parsing); the workflow's next call is issued that much later. 0 for the GPU
  profiles (the paper's latencies are engine-side), fitted for ``embedded-cpu``.
- ``calib_recompute_ratio``: ``kvflow bench``'s link calibration runs an in-process engine
  before the servers start; its recompute time / the served engine's (1.0 = the same).
  ``calibrate_link`` applies it so the simulated link is the one the bench would choose.

Each profile constant carries a ``*_src`` note in the JSON. ``load_profile(name, **overrides)``
accepts a profile name, a path to a JSON file holding one profile, or a dict (user-defined).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

GB = 1e9


@dataclass
class Profile:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    prefill_a: float
    prefill_b: float
    prefill_c: float
    decode_base: float
    decode_per_seq: float
    decode_per_ctx: float
    link_gbps: float | None = None
    link_alpha_s: float = 0.0
    request_overhead_s: float = 0.0
    stream_per_token_s: float = 0.0
    calib_recompute_ratio: float = 1.0
    device_kv_gb: float | None = None
    host_kv_gb: float | None = None
    model: str = ""
    hardware: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def device_tokens(self) -> int | None:
        if self.device_kv_gb is None:
            return None
        return int(self.device_kv_gb * GB // self.kv_bytes_per_token)

    def host_tokens(self) -> int | None:
        if self.host_kv_gb is None:
            return None
        return int(self.host_kv_gb * GB // self.kv_bytes_per_token)

    # ------------------------------------------------------------------ time
    def prefill_s(self, parts: list[tuple[int, int]]) -> float:
        """One prefill batch: ``parts`` = [(new tokens, cached ctx)] per request."""
        if not parts:
            return 0.0
        t = self.prefill_a
        for n, ctx in parts:
            t += self.prefill_b * n + self.prefill_c * n * (ctx + n / 2)
        return t

    def recompute_s(self, n: int) -> float:
        """Prefill of ``n`` tokens from scratch (one request alone)."""
        return self.prefill_s([(n, 0)])

    def decode_s(self, batch: int, ctx_total: int) -> float:
        return self.decode_base + self.decode_per_seq * batch + self.decode_per_ctx * ctx_total

    def load_s(self, tokens: int) -> float:
        if not self.link_gbps:
            return 0.0
        return self.link_alpha_s + tokens * self.kv_bytes_per_token / (self.link_gbps * GB)

    def calibrate_link(self, fixed_tokens: int, load_fraction: float) -> float:
        """The link (GB/s) at which loading ``fixed_tokens`` costs ``load_fraction`` x recomputing
        them (what ``kvflow bench workflow`` does on the embedded engine; its calibration measures
        recompute on an in-process engine: ``calib_recompute_ratio`` x the served one's)."""
        rec = (self.recompute_s(fixed_tokens) - self.prefill_a) * self.calib_recompute_ratio
        return fixed_tokens * self.kv_bytes_per_token / (rec * load_fraction) / GB

    def describe(self) -> str:
        dt = self.device_tokens()
        return (f"{self.name}: {self.model} on {self.hardware}; KV {self.kv_bytes_per_token} B/token; "
                f"device pool {dt if dt is not None else 'per run'} tokens; link "
                f"{self.link_gbps if self.link_gbps else 'per run'} GB/s")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv_bytes_per_token"] = self.kv_bytes_per_token
        return d


def _profiles_doc() -> dict:
    text = resources.files(__package__).joinpath("profiles.json").read_text()
    return json.loads(text)


def profile_names() -> list[str]:
    return [k for k in _profiles_doc() if not k.startswith("_")]


def profile_sources(name: str) -> dict[str, str]:
    """``{constant: source note}`` for a built-in profile."""
    raw = _profiles_doc()[name]
    return {k[:-4]: v for k, v in raw.items() if k.endswith("_src")}


def load_profile(spec: "str | dict | Profile", **overrides) -> Profile:
    if isinstance(spec, Profile):
        raw = asdict(spec)
    elif isinstance(spec, dict):
        raw = dict(spec)
    else:
        doc = _profiles_doc()
        if spec in doc and not spec.startswith("_"):
            raw = dict(doc[spec], name=spec)
        elif Path(spec).is_file():
            raw = json.loads(Path(spec).read_text())
            raw.setdefault("name", Path(spec).stem)
        else:
            raise ValueError(f"unknown profile {spec!r}; built-in: {', '.join(profile_names())} "
                             "(or a path to a JSON file with the same keys)")
    names = {f.name for f in fields(Profile)}
    raw.update({k: v for k, v in overrides.items() if v is not None})
    kw = {k: v for k, v in raw.items() if k in names}
    kw.setdefault("name", "custom")
    try:
        prof = Profile(**kw)
    except TypeError as e:
        raise ValueError(f"profile {kw.get('name')!r}: {e}") from None
    for k in ("prefill_b", "decode_base", "calib_recompute_ratio"):
        v = getattr(prof, k)
        if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise ValueError(f"profile {prof.name!r}: {k} must be > 0")
    for k in ("request_overhead_s", "stream_per_token_s", "link_alpha_s"):
        v = getattr(prof, k)
        if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"profile {prof.name!r}: {k} must be >= 0")
    return prof
