"""The host link's floor (kvflow_agents/bench/link_floor.py): Belady's MIN over page counts
against a brute-force optimum, its closed form on the bench's cycle, and the report's line."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from typer.testing import CliRunner

from kvflow_agents.bench.link_floor import bench_uses, link_floor, min_fetches
from kvflow_agents.bench.workload import WorkloadSpec
from kvflow_agents.cli.main import app

RESULTS = Path(__file__).resolve().parents[2] / "kvflow_agents" / "bench" / "results"


def brute_force_fetches(uses, pages, capacity, count_from=0):
    """The fewest pages any eviction choices fetch (every split of the pages to drop among the
    other prompts, at every use): the optimum MIN must equal."""
    ids = sorted(set(uses), key=str)

    @functools.lru_cache(maxsize=None)
    def best(i, state):
        if i == len(uses):
            return 0
        res = dict(zip(ids, state))
        p = uses[i]
        want = min(pages[p], capacity)
        miss = want - res[p]
        res[p] = want
        over = sum(res.values()) - capacity
        cost = miss if i >= count_from else 0
        others = [q for q in ids if q != p]
        outs = []

        def drops(k, left, cur):
            if k == len(others):
                if left == 0:
                    outs.append(dict(cur))
                return
            q = others[k]
            for d in range(0, min(res[q], left) + 1):
                cur[q] = d
                drops(k + 1, left - d, cur)
            cur.pop(q, None)

        drops(0, max(0, over), {})
        return cost + min(best(i + 1, tuple(res[q] - o.get(q, 0) for q in ids)) for o in outs)

    return best(0, tuple(0 for _ in ids))


def test_min_fetches_no_more_than_any_eviction_choice():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 4)
        pages = {i: rng.randint(1, 3) for i in range(n)}
        uses = [rng.randrange(n) for _ in range(rng.randint(3, 9))]
        cap = rng.randint(1, sum(pages.values()))
        skip = rng.randint(0, 2)
        assert min_fetches(uses, pages, cap, skip) == brute_force_fetches(uses, pages, cap, skip), \
            (uses, pages, cap, skip)


def test_on_the_cycle_every_page_but_the_pools_crosses_once_a_round():
    """Eight 10-agent cycles with a pool of 40 % of their prompts: MIN keeps the pool's worth
    of pages for good and fetches every other page once a round, (prompts x pages - pool) /
    prompts a call; with the pool holding everything it fetches nothing after the warm-up."""
    meta = {"bench": "workflow",
            "workload": WorkloadSpec(agents=10, workflows=8, rounds=2, warmup_rounds=1).as_dict(),
            "server": {"device_tokens": 32768, "page_size": 16, "host_link_gbps": 0.032},
            "calibration": {"kv_bytes_per_token": 23040}, "fixed_prompt_tokens_total": 81920}
    f = link_floor(meta)
    assert f.prompt_pages == 64 and f.capacity_pages == 2048 - 4
    assert f.pages_per_call == (80 * 64 - f.capacity_pages) / 80
    assert abs(f.secs_per_call - f.pages_per_call * 16 * 23040 / 0.032e9) < 1e-9
    meta["server"]["device_tokens"] = 81920 + 1024
    assert link_floor(meta).pages_per_call == 0
    assert link_floor({**meta, "bench": "peer"}) is None


def test_the_uses_follow_the_bench_round_by_round_and_step_by_step():
    spec = WorkloadSpec(agents=3, variant="fanout", workflows=2, rounds=1, warmup_rounds=1)
    uses = bench_uses(spec)
    assert uses[:5] == [(0, "head"), (1, "head"), (0, "worker_1"), (1, "worker_1"), (0, "tail")]
    assert len(uses) == 2 * 2 * 3
    shared = bench_uses(WorkloadSpec(agents=3, workflows=2, rounds=1, warmup_rounds=0, share_prompts=True))
    assert shared == ["agent_0", "agent_0", "agent_1", "agent_1", "agent_2", "agent_2"]


def test_a_stored_run_reports_its_floor_and_what_each_policy_moved(tmp_path):
    src = RESULTS / "wf_8_smollm2_s45_3t.json"
    out = tmp_path / "again.json"
    r = CliRunner().invoke(app, ["bench", "show", str(src), "--json", str(out)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    f = doc["link_floor"]
    assert f["capacity_pages"] == 2044 and f["pages_per_call"] == (5120 - 2044) / 80
    text = " ".join(r.output.split())
    assert "link floor: any policy with this pool fetches >= 38.5 of a prompt's 64 pages" in text
    kv = doc["policies"]["kvflow"]
    moved = (kv["server"]["prefetch_pages"] + kv["server"]["demand_load_pages"]) / kv["workload"]["calls"]
    assert f"kvflow {moved:.1f}" in text and "oracle 0.0" not in text
