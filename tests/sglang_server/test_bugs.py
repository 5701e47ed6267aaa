"""Plugin bugs shown on the real server (the others: ``tests/sglang/test_gpu_path_bugs.py``).

2. Stale hints on re-queue. The hint intake hook runs after every
   ``Scheduler._add_request_to_queue``, which SGLang also calls when it retracts a running
   request under memory pressure (and on preemption, grammar-ready re-queues): the request's
   old hints are applied again, after newer ones, moving the workflow's step backwards and
   its STEs with it, exactly when memory is short.
"""

from __future__ import annotations

import threading

from sglang_harness import agent_rows, dump, hints, random_ids

APP = "e2e"



def test_retracted_request_does_not_replay_old_hints(retract):
    """Four fan-out agents of step 1 decode; SGLang retracts them and queues them again
    (``SGLANG_TEST_RETRACT``: what running out of KV memory does, on a schedule). Meanwhile
    the workflow moved on (an out-of-band transition to step 2). The retracted requests must
    not drag it back."""
    from kvflow_agents.testing import wait_until

    wf, workers = "retract-wf", [f"w{i}" for i in range(4)]
    step1 = {w: 0 for w in workers} | {"merge": 1}
    results: dict[str, dict] = {}

    def run(i: int, w: str) -> None:
        results[w] = retract.generate(random_ids(50 + i, 64), max_new_tokens=40, ignore_eos=True,
                                      custom_params=hints(wf, w, step1, step=1, app=APP,
                                                          fixed_messages=None))

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()

    def step_is(n):
        return retract.snapshot()["workflows"].get(f"{APP}/{wf}", {}).get("step") == n

    wait_until(lambda: step_is(1), timeout=120, what="the step-1 hints")
    # the workflow moves on while they decode: step 2, the merge agent runs next
    r = retract.post_hints(hints(wf, "router", {"merge": 0} | {w: None for w in workers},
                                 step=2, app=APP, fixed_messages=None, event="transition"))
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(600)
    assert len(results) == len(workers), "a request failed"
    retractions = sum(res["meta_info"].get("num_retractions", 0) for res in results.values())
    assert retractions > 0, {w: r["meta_info"] for w, r in results.items()}
    snap = retract.snapshot()
    wfs = snap["workflows"][f"{APP}/{wf}"]
    assert wfs["step"] == 2, dump(wfs)
    rows = agent_rows(snap, f"{APP}/{wf}")
    assert all(rows[w]["ste"] is None for w in workers if w in rows), dump(rows)
