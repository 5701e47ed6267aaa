"""``--hints none|random|reversed|stale``: what each mode sends, over the wire, and the process-wide
hint transform the PEER bench uses (request hints and out-of-band posts)."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvflow_agents.bench.hint_modes import HINT_MODES, HintMangler, check_mode
from kvflow_agents.bench.driver import WorkflowDriver
from kvflow_agents.bench.workload import ByteLevelCounter, WorkloadSpec
from kvflow_agents.context import current_hints, hints, set_hint_transform
from kvflow_agents.protocol import Hints
from kvflow_agents.testing import RecordingOpenAIServer

STE = {"a": 0.0, "b": 1.0, "c": 2.0, "d": math.inf}


def _h(step=1, ste=STE, wf="w", event=None):
    return Hints(workflow=wf, agent="a", step=step, ste=ste, next=["b"], app="x", fixed_messages=1,
                 event=event)


def test_modes_corrupt_only_the_prediction():
    assert check_mode("stale") == "stale" and len(HINT_MODES) == 5
    with pytest.raises(ValueError, match="choose one of"):
        check_mode("wrong")
    h = _h()
    assert HintMangler("on")(h) is h and HintMangler("none")(h) is None
    rev = HintMangler("reversed")(h)
    assert rev.ste == {"a": 2.0, "b": 1.0, "c": 0.0, "d": math.inf}   # unreachable stays so
    assert rev.next == ["b"] and (rev.workflow, rev.agent, rev.step, rev.fixed_messages) == ("w", "a", 1, 1)
    r1, r2 = HintMangler("random", seed=3), HintMangler("random", seed=3)
    outs = [r1(_h(step=s)) for s in range(20)]
    assert [o.ste for o in outs] == [r2(_h(step=s)).ste for s in range(20)]   # deterministic
    assert all(set(o.ste) == set(STE) and all(0 <= v < 4 for v in o.ste.values()) for o in outs)
    assert len({tuple(sorted(o.ste.items())) for o in outs}) > 5              # and varied
    # stale: the map sent `lag` requests earlier in the same workflow (the first ones: oldest seen)
    st = HintMangler("stale", lag=2)
    maps = [{"a": float(i), "b": 1.0} for i in range(5)]
    sent = [st(_h(step=i, ste=m)).ste for i, m in enumerate(maps)]
    assert sent == [maps[0], maps[0], maps[0], maps[1], maps[2]]
    assert st(_h(ste={"z": 1.0}, wf="other")).ste == {"z": 1.0}               # per workflow
    # an end event is not a prediction: it passes unchanged (dropped only under "none")
    end = _h(event="end")
    assert HintMangler("reversed")(end) is end and HintMangler("none")(end) is None


def test_transform_applies_to_requests_and_out_of_band_posts():
    from kvflow_agents.oob import HintReporter

    with RecordingOpenAIServer() as srv:
        rep = HintReporter(base_url=srv.base_url)
        set_hint_transform(HintMangler("reversed"))
        try:
            with hints(_h()):
                assert current_hints().ste["c"] == 0.0
            assert rep.report(_h()) and rep.flush(5.0)
            set_hint_transform(HintMangler("none"))
            with hints(_h()):
                assert current_hints() is None
            assert rep.report(_h()) is False
            set_hint_transform(lambda h: 1 / 0)   # a broken transform never fails a request
            with hints(_h()):
                assert current_hints().ste == STE
        finally:
            set_hint_transform(None)
        with hints(_h()):
            assert current_hints().ste == STE
        posts = srv.hint_posts()
    assert len(posts) == 1 and posts[0].body["kvflow_ste"]["c"] == 0
    assert posts[0].body["kvflow_event"] == "transition"


@pytest.mark.parametrize("mode", ["none", "reversed", "stale"])
def test_workflow_driver_sends_the_mode(mode):
    spec = WorkloadSpec(agents=3, fixed=32, dynamic=8, output=2, rounds=2, warmup_rounds=0,
                        hints=mode, hint_lag=1)
    with RecordingOpenAIServer(reply=lambda body: "ok") as srv:
        drv = WorkflowDriver(spec, srv.base_url, "stub", counter=ByteLevelCounter(), run_id="m")
        res = asyncio.run(drv.run())
        reqs, posts = srv.llm_requests(), srv.hint_posts()
    assert len(res.calls) == 6 and all(c.ok for c in res.calls)
    if mode == "none":
        assert all(not r.hints for r in reqs) and posts == []
        return
    sent = [r.hints["kvflow_ste"] for r in reqs]
    assert [r.hints["kvflow_agent"] for r in reqs] == ["agent_0", "agent_1", "agent_2"] * 2
    if mode == "reversed":   # the running agent looks farthest away, the one after it next
        assert sent[0] == {"agent_0": 2, "agent_1": 1, "agent_2": 0}
        assert reqs[0].hints["kvflow_next"] == ["agent_1"]
    else:                    # one request late: agent_1's request carries agent_0's map
        assert sent[1] == {"agent_0": 0, "agent_1": 1, "agent_2": 2} == sent[0]
        assert sent[2] == {"agent_0": 2, "agent_1": 0, "agent_2": 1}
    assert len(posts) == 1 and posts[0].body["kvflow_event"] == "end"
    with pytest.raises(ValueError, match="hints"):
        WorkloadSpec(hints="maybe").validate()
