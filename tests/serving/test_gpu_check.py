"""The prepared GPU check runs end to end as a CPU dry run (tiny-random), so the script that is
sent to a GPU machine is known to work up to the device."""

import json

from kvflow_agents.serving.embedded import gpu_check


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gc.json"
    rc = gpu_check.main(["--model", "tiny-random", "--device", "cpu", "--fixed", "128", "--agents", "3",
                         "--rounds", "1", "--warmup", "1", "--output", "4", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {r["policy"] for r in doc["results"]} == {"lru", "hicache", "kvflow", "oracle"}
    assert all(len(r["calls"]) == 3 for r in doc["results"])
    assert set(doc["ratios"]["128"]) == {"kvflow_vs_lru", "kvflow_vs_hicache", "kvflow_over_oracle"}
    oracle = next(r for r in doc["results"] if r["policy"] == "oracle")
    lru = next(r for r in doc["results"] if r["policy"] == "lru")
    assert oracle["device_hit_frac"] > lru["device_hit_frac"]  # the oracle never evicts
