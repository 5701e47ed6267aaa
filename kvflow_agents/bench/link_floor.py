"""What any policy must move over the host link: Belady's MIN over the workflow bench's calls.

The oracle's pool never fills, so it reads nothing over the link; a bounded pool must bring
back every page of a fixed prompt that is not on device when its call runs. For a given order
of uses, Belady's MIN (on a fetch, evict what is used again farthest ahead) fetches the fewest
pages of any policy with that pool, prefetching ones included: a prefetch moves a fetch
earlier, it never removes one (any schedule can be made lazy, fetching only at the use, with no
more fetches). So over the bench's order of calls, MIN's fetches per measured call are a floor
on what crosses the link, and times the link's seconds per page a floor on the link's busy time
per call. Beside the oracle's wall time per call it says how much of the oracle's saving is
within reach of a bounded pool behind this link at all: at a ratio near 1 a policy would have to
keep the link busy all the time and hide every load to match the oracle (RESULTS.md §6.62).
A page not fetched must be recomputed instead, engine time the oracle never spends (the bench
calibrates a load at a third of a recompute), so to come near the oracle the floor stands.

Nominal order (``workload.steps``): round by round, step by step, every workflow's call of a
step together. Served, workflows drift apart; the floor is the nominal order's. The pool MIN
gets is the device pool less the pages one call writes itself (a lower bound's capacity errs
large: concurrent calls need more), and it may keep any pages of a prompt (a radix cache can
only use a prefix's head): both only lower the floor. Pure Python over page counts: cost
O(calls x log prompts).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .workload import WorkloadSpec, steps

NEVER = math.inf


def min_fetches(uses: Sequence[object], pages: dict, capacity: int, count_from: int = 0) -> int:
    """Pages Belady's MIN fetches for ``uses`` (prompt ids, in order; each use reads all of its
    ``pages[id]``) with ``capacity`` pages, counting the uses from index ``count_from`` on (the
    earlier ones warm the pool, as the bench's warm-up rounds). A prompt larger than the pool
    keeps what fits."""
    nxt: list = [NEVER] * len(uses)
    seen: dict = {}
    for i in range(len(uses) - 1, -1, -1):
        nxt[i] = seen.get(uses[i], NEVER)
        seen[uses[i]] = i
    resident: dict = {}                  # prompt -> pages on device
    next_use: dict = {}                  # prompt -> index of its next use
    heap: list = []                      # (-next use, index, prompt): farthest first; entries
    held = fetched = 0                   # whose next use moved on are stale, skipped lazily
    for i, p in enumerate(uses):
        want = min(pages[p], capacity)
        miss = want - resident.get(p, 0)
        if i >= count_from:
            fetched += miss
        next_use[p] = nxt[i]             # its own entries go stale: never evicted for itself
        need = held + miss - capacity
        while need > 0:
            neg, _, q = heap[0]
            if q == p or next_use[q] != -neg or not resident.get(q):
                heapq.heappop(heap)
                continue
            drop = min(resident[q], need)
            resident[q] -= drop
            held -= drop
            need -= drop
            if not resident[q]:
                heapq.heappop(heap)
        resident[p] = want
        held += miss
        heapq.heappush(heap, (-nxt[i], i, p))
    return fetched


def bench_uses(spec: WorkloadSpec) -> list:
    """Every call's fixed prompt, in the bench's nominal order (warm-up rounds first)."""
    out: list = []
    for _ in range(spec.warmup_rounds + spec.rounds):
        for step in steps(spec):
            for w in range(spec.workflows):
                out.extend(a if spec.share_prompts else (w, a) for a in step)
    return out


@dataclass(frozen=True)
class LinkFloor:
    pages_per_call: float              # MIN's fetches per measured call
    prompt_pages: int                  # pages of one fixed prompt (the average prompt)
    capacity_pages: int                # what MIN was given
    secs_per_page: Optional[float]     # the emulated link's (None: real copies, no time)

    @property
    def secs_per_call(self) -> Optional[float]:
        return None if self.secs_per_page is None else self.pages_per_call * self.secs_per_page

    def as_dict(self) -> dict:
        return {"pages_per_call": self.pages_per_call, "prompt_pages": self.prompt_pages,
                "capacity_pages": self.capacity_pages, "secs_per_page": self.secs_per_page,
                "secs_per_call": self.secs_per_call}


def link_floor(meta: dict) -> Optional[LinkFloor]:
    """The floor for a ``kvflow bench workflow`` run from its JSON's ``workload``, ``server``,
    ``calibration`` and ``fixed_prompt_tokens_total``; None where it does not apply (no bounded
    embedded pool recorded, another bench)."""
    wl, srv = meta.get("workload") or {}, meta.get("server") or {}
    if meta.get("bench") != "workflow" or not srv.get("device_tokens") or not srv.get("page_size"):
        return None
    try:
        spec = WorkloadSpec(**wl)
        spec.validate()
    except (TypeError, ValueError):
        return None
    page = int(srv["page_size"])
    prompts = spec.agents * (1 if spec.share_prompts else spec.workflows)
    total = meta.get("fixed_prompt_tokens_total") or spec.fixed * prompts
    prompt_pages = int(total / prompts) // page
    own = math.ceil((spec.dynamic + spec.output + page) / page)   # the call's own pages, at least
    capacity = max(0, int(srv["device_tokens"]) // page - own)
    uses = bench_uses(spec)
    measured_from = spec.warmup_rounds * len(uses) // (spec.warmup_rounds + spec.rounds)
    fetched = min_fetches(uses, dict.fromkeys(uses, prompt_pages), capacity, measured_from)
    calls = len(uses) - measured_from
    gbps = srv.get("host_link_gbps")
    kv = (meta.get("calibration") or {}).get("kv_bytes_per_token")
    spp = page * kv / (gbps * 1e9) if gbps and kv else None
    return LinkFloor(fetched / calls, prompt_pages, capacity, spp)


def moved_pages_per_call(server: Optional[dict], calls: Optional[int]) -> Optional[float]:
    """Pages a policy's server brought over the link per measured call (demand and prefetch)."""
    if not server or not calls or server.get("prefetch_pages") is None:
        return None
    return (server.get("prefetch_pages", 0) + server.get("demand_load_pages", 0)) / calls


def floor_lines(meta: dict, results: Sequence) -> list[str]:
    """The report's lines: the floor, beside the oracle's wall time per call and what each
    bounded policy moved."""
    f = link_floor(meta)
    if f is None:
        return []
    head = (f"link floor: any policy with this pool fetches >= {f.pages_per_call:.1f} of a "
            f"prompt's {f.prompt_pages} pages a call over the host link (Belady's MIN, the "
            f"bench's call order)")
    oracle = next((r for r in results if r.policy == "oracle"), None)
    wall = None
    if oracle is not None and oracle.workload.get("calls"):
        wall = oracle.workload.get("measured_s", 0) / oracle.workload["calls"]
    if f.secs_per_call is not None:
        head += f" = {f.secs_per_call * 1e3:.0f} ms of link a call"
        if wall:
            head += (f", {f.secs_per_call / wall:.2f} of the oracle's wall time a call "
                     f"({wall * 1e3:.0f} ms): to match the oracle the link must be busy that "
                     f"share of the time, every load hidden")
    out = [head]
    moved = []
    for r in results:
        m = moved_pages_per_call(r.server, r.workload.get("calls"))
        if m is None or r.policy == "oracle":
            continue
        t = f", {m * f.secs_per_page * 1e3:.0f} ms" if f.secs_per_page else ""
        moved.append(f"{r.policy} {m:.1f}{t}")
    if moved:
        out.append("  moved a call (pages): " + "; ".join(moved))
    return out
