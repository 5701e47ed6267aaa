"""Greedy outputs do not depend on where the prefix KV came from, and hints ride both request
paths (native ``/generate`` with ``input_ids``; OpenAI chat with the chat template).

On the plugin's server the emulated link poisons rows in flight (NaN until the bytes land), so
a request that read a prefix before its load finished would not decode the same tokens.
"""

from __future__ import annotations


from sglang_harness import DEVICE_TOKENS, agent_rows, dump, hints, random_ids



def _tier(res: dict) -> tuple[int, int]:
    """(device, host) prompt tokens served from cache. SGLang reports the split only when a
    request hit the host tier; otherwise every cached token came from device."""
    meta = res["meta_info"]
    det = meta.get("cached_tokens_details")
    if not det:
        return meta["cached_tokens"], 0
    return det.get("device", 0), det.get("host", 0)


def _push_out_of_device(client, seed: int) -> None:
    """Fill the device pool with unrelated prompts (LRU and KVFlow both evict the old prefix
    to host: it has no hint, so it is +inf to KVFlow)."""
    for k in range(4):
        client.generate(random_ids(seed * 100 + k, DEVICE_TOKENS // 3), max_new_tokens=1)


def test_device_hit_host_load_and_recompute_give_the_same_tokens(stock, kvflow):
    prompt = random_ids(7, 900)
    for name, client in (("stock", stock), ("kvflow", kvflow)):
        cold = client.generate(prompt, max_new_tokens=12)           # computed
        hot = client.generate(prompt, max_new_tokens=12)            # device hit
        _push_out_of_device(client, 1)
        declined = client.snapshot()["metrics"]["loads_declined"] if name == "kvflow" else 0
        loaded = client.generate(prompt, max_new_tokens=12)         # host load
        assert cold["meta_info"]["cached_tokens"] == 0, (name, cold["meta_info"])
        dev, host = _tier(hot)
        assert dev >= len(prompt) - 1 and host == 0, (name, hot["meta_info"])
        dev, host = _tier(loaded)
        if name == "kvflow" and host == 0:
            # The plugin recomputed instead: allowed only as its load-vs-recompute decision
            # (its measured link, 1 s per 1000 tokens here, slower than its measured prefill).
            assert client.snapshot()["metrics"]["loads_declined"] > declined, loaded["meta_info"]
        else:
            assert host > 0, (name, loaded["meta_info"])
        assert cold["output_ids"] == hot["output_ids"] == loaded["output_ids"]
    # and the two servers agree
    assert stock.generate(prompt, max_new_tokens=12)["output_ids"] == \
        kvflow.generate(prompt, max_new_tokens=12)["output_ids"]


def test_input_ids_path_tags_the_declared_fixed_prefix(kvflow):
    """``/generate`` with ``input_ids``: hints in ``sampling_params.custom_params``, the fixed
    prefix declared in tokens."""
    fixed = random_ids(11, 400)
    h = hints("ids-wf", "solo", {"solo": 0}, step=1, app="ids", fixed_messages=None)
    h["kvflow_fixed_prefix_tokens"] = len(fixed)
    for k in range(2):
        res = kvflow.generate(fixed + random_ids(100 + k, 30), max_new_tokens=4, custom_params=h)
        assert res["output_ids"], res
    rows = agent_rows(kvflow.snapshot(), "ids/ids-wf")
    assert rows["solo"]["tokens"] == len(fixed), dump(rows)
    assert rows["solo"]["residency"] == "device" and rows["solo"]["ste"] == 0


def test_malformed_hints_never_fail_a_request(kvflow, stock):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}]
    bad = {"kvflow_v": 1, "kvflow_workflow": "w", "kvflow_agent": "a", "kvflow_ste": {"x": -3}}
    before = kvflow.snapshot()["stats"]["hint_errors"]
    got = kvflow.chat(msgs, hints=bad, max_tokens=4)
    ref = stock.chat(msgs, max_tokens=4)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert kvflow.snapshot()["stats"]["hint_errors"] == before + 1
    r = kvflow.post_hints(bad)
    assert r.status_code == 400 and r.json()["key"] == "kvflow_ste"


def test_tool_hint_tags_the_agents_last_turn_on_the_real_server(kvflow):
    """A tool step's out-of-band hint (``kvflow_tool_s``) gives the waiting agent's whole last
    turn (prompt + what it generated, SGLang's record of the finished request) a resume tag
    on the real server: held at STE 2 while the tool runs; the agent's next request closes it.
    That request extended the last turn, so the server learned the agent: its new turn is kept
    at the agent's own STE (a turn gap) once it finishes."""
    from kvflow_agents.serving.policy.toolgap import RESUME

    fixed, dyn = random_ids(21, 200), random_ids(22, 40)
    h = hints("tool-wf", "agent", {"agent": 0, "tool": 1}, step=1, app="tools", fixed_messages=None)
    h["kvflow_fixed_prefix_tokens"] = len(fixed)
    res = kvflow.generate(fixed + dyn, max_new_tokens=8, ignore_eos=True, custom_params=h)
    assert len(res["output_ids"]) == 8, res
    r = kvflow.post_hints({"kvflow_v": 1, "kvflow_workflow": "tool-wf", "kvflow_app": "tools",
                           "kvflow_agent": "tool", "kvflow_step": 2,
                           "kvflow_ste": {"tool": 0, "agent": 1}, "kvflow_event": "transition",
                           "kvflow_tool_s": {"agent": 30.0}})
    assert r.status_code in (200, 202), r.text
    rows = agent_rows(kvflow.snapshot(), "tools/tool-wf")
    resume = rows.get("agent" + RESUME)
    assert resume is not None, dump(rows)
    # the turn SGLang cached: prompt + generated tokens (the last one's KV is not written yet)
    assert len(fixed) + len(dyn) < resume["tokens"] <= len(fixed) + len(dyn) + 8, dump(rows)
    assert resume["ste"] == 2 and resume["residency"] == "device", dump(rows)
    h2 = dict(h, kvflow_step=3)
    resumed = fixed + dyn + res["output_ids"] + random_ids(23, 20)
    kvflow.generate(resumed, max_new_tokens=2, custom_params=h2)
    snap = kvflow.snapshot()
    rows, gaps = agent_rows(snap, "tools/tool-wf"), snap["gaps"]
    assert gaps["closed_by_request"] == 1 and gaps["tool_opened"] == 1, gaps
    assert gaps["open_turn"] == 1 and gaps["agents_learned"] >= 1, gaps
    turn = rows["agent" + RESUME]
    assert turn["ste"] == 0 and len(resumed) < turn["tokens"] <= len(resumed) + 2, dump(rows)
