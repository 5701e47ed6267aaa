"""Workflow-ordered admission on SGLang's real scheduler (``hooks.after_calc_priority``).

One request runs at a time (``--max-running-requests 1``). While workflow w1's first call
decodes, w2's and w3's first calls arrive, then w1's second call. With the plugin's default
(``--kvflow-admission workflow``) the older workflow's call goes first, so w1 finishes before
the newer workflows start (``serving/policy/admission.py``: workflows run back to back instead
of in lockstep); the same server with ``fcfs`` serves them in arrival order, as SGLang's FCFS.
"""

from __future__ import annotations

import threading
import time

from sglang_harness import hints, random_ids

APP = "e2e"



def finish_order(client) -> list[str]:
    client.generate(random_ids(1, 16), max_new_tokens=4)  # warm: the first forward pass is slow
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, seed: int, tokens: int) -> None:
        wf, agent = name.split("-")
        client.generate(random_ids(seed, 32), max_new_tokens=tokens, ignore_eos=True,
                        custom_params=hints(wf, agent, {agent: 0}, step=0 if agent == "a" else 1,
                                            app=APP, fixed_messages=None))
        with lock:
            finished.append(name)

    first = threading.Thread(target=run, args=("w1-a", 10, 400))
    first.start()
    time.sleep(0.5)  # w1-a is running
    threads = []
    for i, name in enumerate(["w2-a", "w3-a", "w1-b"]):
        t = threading.Thread(target=run, args=(name, 20 + i, 24))
        t.start()
        threads.append(t)
        time.sleep(0.1)
    for t in [first, *threads]:
        t.join(timeout=300)
    assert finished[0] == "w1-a", finished  # the three others queued behind it
    return finished


def test_the_oldest_workflows_call_is_admitted_first(serial_pair):
    assert finish_order(serial_pair["serial"]) == ["w1-a", "w1-b", "w2-a", "w3-a"]
    assert finish_order(serial_pair["serial-fcfs"]) == ["w1-a", "w2-a", "w3-a", "w1-b"]
