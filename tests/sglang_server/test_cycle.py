"""The 4-agent cycle through SGLang's OpenAI API: stock SGLang + HiCache vs SGLang + plugin.

Same tiny model, same ``--max-total-tokens`` (room for about 2.5 of the 4 agents' fixed
prompts), same host pool and emulated link. Each call is ``[system: the agent's fixed prompt,
user: a per-call message]`` with hints v1 from the graph's own ``WorkflowTracker``
(``kvflow_fixed_messages=1``: the chat-template path turns it into tokens), greedy,
``return_cached_tokens_details`` so each response says how many prompt tokens came from the
device pool and how many were loaded from host.

What it shows: identical greedy outputs; the prefix cache hits on every call after the first
round on both; the plugin serves every later call from device (the next agent was kept or
prefetched) where LRU throws out exactly the agent that runs next and loads it back on
demand; ``/kvflow/v1/cache`` residency follows STE; a request whose prefix is still in flight
is held back (``blocked_polls``) and then served from the prefetched KV, and the host-only rest
of its match (its last turn) is loaded behind that prefix while it is held (``rest_queued``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
from sglang_harness import FIXED, agent_rows, dump, hints

from kvflow_agents.graph.examples import cycle_graph
from kvflow_agents.testing import wait_until

AGENTS = ("planner", "coder", "tester", "reviewer")
ROUNDS = 3
APP = "e2e"
WORDS = ("market value price rate trade risk plan step agent task review answer note table "
         "model cache memory queue graph node edge group level point case form power light").split()


def fixed_prompt(agent: str, tokenizer, n: int = FIXED, salt: str = "") -> str:
    """A deterministic system prompt of exactly ``n`` tokens (SmolLM2's tokenizer)."""
    rng = random.Random(f"{agent}{salt}")
    words = [f"You are the {agent}{salt}. Follow these rules."]
    while len(tokenizer.encode(" ".join(words))) < n:
        words.append(rng.choice(WORDS))
    ids = tokenizer.encode(" ".join(words))[:n]
    return tokenizer.decode(ids)


@dataclass
class Call:
    round: int
    agent: str
    text: str
    prompt_tokens: int
    cached: int
    device: Optional[int]
    host: Optional[int]
    before: Optional[dict] = None        # /kvflow/v1/cache right before the call (kvflow)
    ste: dict = field(default_factory=dict)


def cycle_messages(tokenizer, agent: str, rnd: int, salt: str = "") -> list[dict]:
    return [{"role": "system", "content": fixed_prompt(agent, tokenizer, salt=salt)},
            {"role": "user", "content": f"Round {rnd}: continue the work of the previous agent."}]


def run_cycle(client, tokenizer, workflow: str, *, rounds: int = ROUNDS, snapshots: bool = False,
              salt: str = "") -> list[Call]:
    tracker = cycle_graph(len(AGENTS), list(AGENTS)).tracker(workflow)
    calls = []
    for rnd in range(rounds):
        for agent in AGENTS:
            tracker.start(agent)
            ste = tracker.ste()
            h = hints(workflow, agent, ste, step=tracker.step, app=APP,
                      next=tracker.next_agents())
            before = client.snapshot() if snapshots else None
            resp = client.openai.chat.completions.create(
                model=client.model, messages=cycle_messages(tokenizer, agent, rnd, salt),
                max_tokens=8, temperature=0,
                extra_body={"custom_params": h, "return_cached_tokens_details": True})
            tracker.finish(agent)
            det = ((resp.model_extra or {}).get("sglext") or {}).get("cached_tokens_details") or {}
            calls.append(Call(rnd, agent, resp.choices[0].message.content,
                              resp.usage.prompt_tokens,
                              resp.usage.prompt_tokens_details.cached_tokens,
                              det.get("device"), det.get("host"), before,
                              {k: v for k, v in ste.items()}))
    return calls


@pytest.fixture(scope="module")
def cycles(main_servers, model_dir, tokenizer):
    """The same 3 rounds on both servers (fresh workflow ids), recorded once for this module."""
    from sglang_harness import Client

    out = {}
    for name in ("stock", "kvflow"):
        c = Client(main_servers.get(name), model_dir)
        try:
            out[name] = run_cycle(c, tokenizer, f"cycle-{name}", snapshots=name == "kvflow")
            out[name + ":final"] = c.snapshot() if name == "kvflow" else None
        finally:
            c.close()
    yield out
    for name in ("stock", "kvflow"):   # the app is done: what kvflow.instrument sends at the end
        c = Client(main_servers.get(name), model_dir)
        try:
            end_workflow(c, f"cycle-{name}")
        finally:
            c.close()


def end_workflow(client, workflow: str) -> None:
    """What ``kvflow.instrument`` sends when a workflow is over: its tags stop protecting."""
    r = client.post_hints(hints(workflow, AGENTS[-1], {}, step=10**6, app=APP,
                                fixed_messages=None, event="end"))
    assert r.status_code in (200, 404), r.text   # stock SGLang + HiCache: the plugin's route


def fixed_tokens(tokenizer, agent: str) -> int:
    msgs = cycle_messages(tokenizer, agent, 0)
    return tokenizer.fixed_prefix_tokens(msgs, 1)


def test_greedy_outputs_identical_stock_vs_plugin(cycles):
    stock, kv = cycles["stock"], cycles["kvflow"]
    assert [c.text for c in stock] == [c.text for c in kv], dump(
        [(c.agent, c.round, s.text, c.text) for s, c in zip(stock, kv)])
    assert all(c.text for c in kv)


def test_prefix_cache_hits_every_later_call_on_both(cycles, tokenizer):
    for name in ("stock", "kvflow"):
        for c in cycles[name]:
            if c.round == 0:
                continue
            need = fixed_tokens(tokenizer, c.agent)
            assert c.cached >= need, (name, c)
            assert c.device is not None and c.host is not None, c
            assert c.device + c.host == c.cached, c


def test_plugin_serves_the_next_agent_from_device_where_lru_loads_it_back(cycles):
    stock = [c for c in cycles["stock"] if c.round > 0]
    kv = [c for c in cycles["kvflow"] if c.round > 0]
    # LRU evicts the least recently used agent, which in a cycle is the next one to run:
    assert sum(c.host for c in stock) > 0, dump(stock)
    assert sum(1 for c in stock if c.host) >= len(stock) // 2, dump(stock)
    # KVFlow keeps it (or has it back before the call is admitted): no host load on the call
    assert all(c.host == 0 for c in kv), dump(kv)


def test_cache_residency_follows_ste(cycles, tokenizer):
    """Before every call: the agent about to run is on device (or loading); and whatever went
    to host since the previous call had the largest STE of the hints then in force (an
    eviction by STE), never a smaller one than an agent that stayed on device."""
    wf = f"{APP}/cycle-kvflow"
    snaps = [c.before for c in cycles["kvflow"] if c.before is not None]
    snaps.append(cycles["kvflow:final"])
    evictions = 0
    for c, prev, cur in zip(cycles["kvflow"], snaps, snaps[1:]):
        rows, before = agent_rows(cur, wf), agent_rows(prev, wf)
        if c.round > 0:
            assert set(rows) == set(AGENTS), dump(cur)
        # the chat template's fixed prefix, in SGLang's tokens, is what got tagged
        for a, row in rows.items():
            assert row["tokens"] == fixed_tokens(tokenizer, a), row
        on_host = {a for a, r in rows.items() if r["residency"] == "host"}
        on_device = {a for a, r in rows.items() if r["residency"] in ("device", "loading")}
        went = on_host - {a for a, r in before.items() if r["residency"] == "host"}
        evictions += len(went)
        for h in went:
            for d in on_device:
                assert rows[h]["ste"] >= rows[d]["ste"], (c.agent, c.round, dump(rows))
    for c in cycles["kvflow"]:
        if c.before is not None and c.round > 0:
            rows = agent_rows(c.before, wf)
            # the agent about to run (STE 1 in the previous call's hints) is on device or on its way
            assert rows[c.agent]["residency"] in ("device", "loading"), (c.agent, dump(rows))
    assert evictions > 0, "the device pool never overflowed: the test's sizes are wrong"
    final = cycles["kvflow:final"]
    stats, metrics = final["stats"], final["metrics"]
    assert metrics["prefetch_issued"] > 0 and stats["tags"] >= len(AGENTS), final
    assert metrics["prefetch_used"] > 0, metrics        # a later request read a prefetch
    assert stats["hint_errors"] == 0, stats


def sent_while_its_prefix_loads(kvflow, tokenizer, rnd: int, *, others_ste=None):
    """An out-of-band transition makes an agent whose prefix sits on host next (STE 1; the
    others at ``others_ste`` if given), and once its prefetch has started that agent's round
    ``rnd`` prompt is sent. Returns ``(target, ids, result, counters before, after)``."""
    wf = "cycle-kvflow"
    snap = kvflow.snapshot()
    rows = agent_rows(snap, f"{APP}/{wf}")
    on_host = [a for a, r in rows.items() if r["residency"] == "host"]
    assert on_host, dump(rows)
    target = on_host[0]
    step = snap["workflows"][f"{APP}/{wf}"]["step"] + 1
    ids = tokenizer.encode_chat(cycle_messages(tokenizer, target, rnd))
    h = hints(wf, target, {target: 0}, step=step + 1, app=APP, fixed_messages=None)
    h["kvflow_fixed_prefix_tokens"] = fixed_tokens(tokenizer, target)
    before = {**snap["stats"], **snap["metrics"]}
    ste = {target: 1} if others_ste is None else {a: 1 if a == target else others_ste for a in AGENTS}
    r = kvflow.post_hints(hints(wf, "router", ste, step=step, app=APP, fixed_messages=None,
                                event="transition"))
    assert r.status_code == 200, r.text

    def issued() -> int:
        snap = kvflow.snapshot()
        return {**snap["stats"], **snap["metrics"]}["prefetch_issued"]

    # The hint and a request sent right after it share the tokenizer -> scheduler socket: on a
    # busy box both can arrive in one batch, and then the request, queued before the next
    # prefetch pass, holds its agent and decides itself (a demand load): correct, but not
    # these tests' case. So the request goes once the load has started (it takes ~1 s).
    wait_until(lambda: issued() > before["prefetch_issued"], timeout=30,
               what="the transition's prefetch to start")
    res = kvflow.generate(ids, max_new_tokens=8, custom_params=h)
    snap2 = kvflow.snapshot()
    return target, ids, res, before, {**snap2["stats"], **snap2["metrics"]}


def test_request_held_back_while_its_prefix_loads_then_served_from_prefetch(
        cycles, kvflow, stock, tokenizer):
    """Out-of-band transition: an agent whose prefix sits on host becomes next (STE 1), so the
    server starts loading it (a fixed prompt takes ~1 s on the emulated link); its request
    comes right behind, while the load is in flight. SGLang matches the request on device (its
    tree counts a node as on device once its load starts); the plugin keeps it out of the
    prefill batch until the bytes landed, then it is served from the prefetched KV. (Native
    ``/generate`` with the chat template's tokens: it reaches the scheduler in milliseconds,
    where a chat request's HTTP + template + tokenizer path on this busy box can take longer
    than the load.)"""
    target, ids, res, before, after = sent_while_its_prefix_loads(kvflow, tokenizer, 99)
    assert after["prefetch_issued"] > before["prefetch_issued"], (before, after)
    assert after["blocked_polls"] > before["blocked_polls"], (before, after)
    assert after["prefetch_used"] > before["prefetch_used"], (before, after)
    assert after["load_exposed_s"] > before["load_exposed_s"], (before, after)
    det = res["meta_info"].get("cached_tokens_details") or {}
    assert not det.get("host") and res["meta_info"]["cached_tokens"] >= fixed_tokens(tokenizer, target), res["meta_info"]
    ref = stock.generate(ids, max_new_tokens=8)
    assert res["output_ids"] == ref["output_ids"]


def test_a_host_rest_below_the_loading_prefix_is_loaded_behind_it(cycles, kvflow, stock, tokenizer):
    """The same, with the agent's whole last prompt: its fixed prefix is prefetched (the tag)
    and the rest of the match, the last call's own turn below the tag, sits on host. While the
    request is held for the prefetch, the plugin loads that rest behind it on the link
    (``rest_queued``), so at admission the whole prompt is on device: no demand load, no
    recompute of the turn (bench/RESULTS.md §6.57-6.58). The router sends its whole STE map
    (the test before left its agent at STE 0): the others are further off, so the prefetch may
    evict them to make room."""
    target, ids, res, before, after = sent_while_its_prefix_loads(
        kvflow, tokenizer, ROUNDS - 1, others_ste=3)  # its last prompt
    meta = res["meta_info"]
    det = meta.get("cached_tokens_details") or {}
    # the whole prompt was on device at admission: the turn was loaded while it was held
    assert not det.get("host") and meta["cached_tokens"] > fixed_tokens(tokenizer, target), meta
    assert after["blocked_polls"] > before["blocked_polls"], (before, after)
    assert after["rest_queued"] == before["rest_queued"] + 1, (before, after)
    assert after["loads_declined"] == before["loads_declined"], (before, after)
    ref = stock.generate(ids, max_new_tokens=8)
    assert res["output_ids"] == ref["output_ids"]
