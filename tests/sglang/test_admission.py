"""Workflow-ordered admission in the SGLang plugin: SGLang's own ``SchedulePolicy.calc_priority``
(wrapped by the plugin's hook) orders the real scheduler's waiting queue of real ``Req`` objects
queued through the hint-intake hook, as ``serving/policy/admission.py`` orders the embedded
engine's: the oldest workflow's calls first, SGLang's order otherwise.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("sglang.srt")

import sglang.test.kits.unified_radix_cache.fixtures as fx  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sgl_helpers import hints  # noqa: E402

from kvflow_agents.serving.policy import KVFlowPolicy  # noqa: E402
from kvflow_agents.serving.policy.admission import AdmissionOrder  # noqa: E402
from kvflow_agents.serving.sglang import hooks  # noqa: E402
from kvflow_agents.serving.sglang.cache import KVFlowRadixCache  # noqa: E402
from kvflow_agents.serving.sglang.strategy import KVFlowStrategy  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugin_hooks():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # registers the plugin (entry point) and wraps calc_priority
    assert hasattr(SchedulePolicy.calc_priority, "__wrapped__")


@pytest.fixture
def cache():
    with mock.patch.object(fx, "UnifiedRadixCache", KVFlowRadixCache):
        c, _alloc, _r2t = fx.build_fixture(CacheConfig(page_size=4, eviction_policy="kvflow"))
    return c


class Queue:
    """The scheduler side: requests queued through the intake hook, in arrival order."""

    def __init__(self, cache) -> None:
        self.sched = SimpleNamespace(tree_cache=cache, waiting_queue=[])
        self.n = 0

    def add(self, workflow=None, agent=None, *, step=0, priority=None) -> Req:
        self.n += 1
        sp = SamplingParams(temperature=0, max_new_tokens=4)
        if workflow is not None:
            sp.custom_params = hints(workflow, agent, {agent: 0}, step=step)
        req = Req(rid=f"r{self.n}-{workflow}-{agent}", origin_input_text="",
                  origin_input_ids=array("q", range(100 * self.n, 100 * self.n + 8)),
                  sampling_params=sp, priority=priority)
        self.sched.waiting_queue.append(req)
        hooks.after_add_request_to_queue(None, self.sched, req)
        return req

    def names(self) -> list[str]:
        return [r.rid.split("-", 1)[1] for r in self.sched.waiting_queue]


def fcfs(cache, **kw) -> SchedulePolicy:
    return SchedulePolicy("fcfs", cache, enable_hierarchical_cache=False,
                          enable_priority_scheduling=kw.get("priority", False),
                          schedule_low_priority_values_first=False)


def test_oldest_workflow_first_unhinted_by_arrival(cache):
    q = Queue(cache)
    for wf, agent in [("w1", "plan"), ("w2", "plan"), ("w3", "plan"), ("w1", "exec"),
                      (None, None), ("w2", "exec")]:
        q.add(wf, agent)
    assert cache.kv_admission.by_workflow  # the plugin's default
    fcfs(cache).calc_priority(q.sched.waiting_queue)
    # w1's second call moves up to w1; a request without hints is a one-call workflow
    assert q.names() == ["w1-plan", "w1-exec", "w2-plan", "w2-exec", "w3-plan", "None-None"]
    assert cache.kv_stats["queue_sorts"] == 1


def test_a_request_queued_without_the_intake_hook_is_keyed_when_first_sorted(cache):
    q = Queue(cache)
    q.add("w1", "plan")
    stray = Req(rid="stray-None-None", origin_input_text="", origin_input_ids=array("q", range(8)),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=4))
    q.sched.waiting_queue.insert(0, stray)  # e.g. a path that bypassed _add_request_to_queue
    fcfs(cache).calc_priority(q.sched.waiting_queue)
    assert q.names() == ["w1-plan", "None-None"] and stray.kvflow_admission_key is not None
    q.add("w2", "plan")                     # a newer workflow does not jump ahead of it
    fcfs(cache).calc_priority(q.sched.waiting_queue)
    assert q.names() == ["w1-plan", "None-None", "w2-plan"]


def test_a_requeued_request_keeps_its_place(cache):
    q = Queue(cache)
    a = q.add("w1", "plan")
    q.add("w2", "plan")
    key = a.kvflow_admission_key
    q.sched.waiting_queue.remove(a)  # SGLang retracts it and queues it again, at the end
    q.sched.waiting_queue.append(a)
    hooks.after_add_request_to_queue(None, q.sched, a, is_retracted=True)
    assert a.kvflow_admission_key == key
    fcfs(cache).calc_priority(q.sched.waiting_queue)
    assert q.names() == ["w1-plan", "w2-plan"]


def test_fcfs_admission_and_unhinted_queues_keep_sglangs_order(cache):
    q = Queue(cache)
    for wf in ("w1", "w2", "w1"):
        q.add(wf, "a")
    cache.kv_admission = AdmissionOrder("fcfs")           # --kvflow-admission fcfs
    fcfs(cache).calc_priority(q.sched.waiting_queue)
    assert q.names() == ["w1-a", "w2-a", "w1-a"]
    cache.kv_admission = AdmissionOrder("workflow")
    plain = Queue(cache)
    for _ in range(3):
        plain.add()
    order = list(plain.sched.waiting_queue)
    plain.sched.waiting_queue.reverse()                    # whatever SGLang's own sort left
    fcfs(cache).calc_priority(plain.sched.waiting_queue)
    assert plain.sched.waiting_queue == order[::-1]        # no hints: untouched
    assert cache.kv_stats["queue_sorts"] == 0


def test_priority_scheduling_still_comes_first(cache):
    q = Queue(cache)
    q.add("w1", "a", priority=1)
    q.add("w2", "a", priority=5)
    q.add("w1", "b", priority=5)
    fcfs(cache, priority=True).calc_priority(q.sched.waiting_queue)  # higher values first
    assert q.names() == ["w1-b", "w2-a", "w1-a"]


def test_admission_is_configurable_and_checked():
    from kvflow_agents.serving.sglang.launch import build_args
    from kvflow_agents.serving.sglang.plugin import cache_options

    assert build_args(["--model-path", "m", "--kvflow-admission", "fcfs"])[1]["KVFLOW_ADMISSION"] == "fcfs"
    with pytest.raises(SystemExit, match="unknown admission order 'lifo'"):
        build_args(["--model-path", "m", "--kvflow-admission=lifo"])
    with mock.patch.dict("os.environ", {"KVFLOW_ADMISSION": "fcfs"}):
        assert cache_options()["admission"] == "fcfs"
    with mock.patch.dict("os.environ", {"KVFLOW_ADMISSION": "nope"}):
        assert cache_options()["admission"] == "workflow"  # a bad value is logged and ignored
    assert KVFlowStrategy(admission="fcfs").options["admission"] == "fcfs"
    with pytest.raises(ValueError, match="unknown admission order"):
        KVFlowStrategy(admission="lifo")
    # the skip scope, the same three ways in
    assert build_args(["--model-path", "m", "--kvflow-skip-scope", "workflow"])[1]["KVFLOW_SKIP_SCOPE"] == "workflow"
    with pytest.raises(SystemExit, match="unknown skip scope 'nobody'"):
        build_args(["--model-path", "m", "--kvflow-skip-scope=nobody"])
    for env, want in (("workflow", "workflow"), ("all", "all"), ("nope", KVFlowPolicy.skip_scope)):
        with mock.patch.dict("os.environ", {"KVFLOW_SKIP_SCOPE": env}):
            assert cache_options()["skip_scope"] == want
    assert KVFlowStrategy(skip_scope="workflow").options["skip_scope"] == "workflow"
    with pytest.raises(ValueError, match="unknown skip scope"):
        KVFlowStrategy(skip_scope="nobody")
