import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow_agents.protocol import (MAX_ID_LEN, MAX_STE, SCHEMA_PATH, HintError, Hints,
                                    json_schema)


def sample():
    return Hints(workflow="thread-7", app="peer", agent="planner", step=3,
                 ste={"planner": 0, "executor": 1, "reviewer": math.inf},
                 next=["executor"], fixed_messages=1)


def test_custom_params_are_flat_and_sglang_safe():
    cp = sample().to_custom_params()
    assert cp == {"kvflow_v": 1, "kvflow_workflow": "thread-7", "kvflow_app": "peer",
                  "kvflow_agent": "planner", "kvflow_step": 3,
                  "kvflow_ste": {"planner": 0, "executor": 1, "reviewer": None},
                  "kvflow_next": ["executor"], "kvflow_fixed_messages": 1}
    scalar = (str, int, float, bool, type(None))
    for v in cp.values():  # SGLang custom_params: scalars, lists of scalars, flat dicts
        if isinstance(v, dict):
            assert all(isinstance(x, scalar) for x in v.values())
        elif isinstance(v, list):
            assert all(isinstance(x, scalar) for x in v)
        else:
            assert isinstance(v, scalar)
    assert Hints.from_custom_params(json.loads(json.dumps(cp))) == sample()


def test_headers_mirror_ids():
    assert sample().headers() == {"X-KVFlow-Workflow": "thread-7", "X-KVFlow-Agent": "planner",
                                  "x-smg-routing-key": "thread-7"}


def test_no_kvflow_keys_means_no_hints():
    assert Hints.from_custom_params(None) is None
    assert Hints.from_custom_params({"temperature_boost": 1}) is None


@pytest.mark.parametrize("patch,key", [
    ({"kvflow_v": 2}, "kvflow_v"),
    ({"kvflow_v": None}, "kvflow_v"),
    ({"kvflow_workflow": ""}, "kvflow_workflow"),
    ({"kvflow_workflow": "w" * (MAX_ID_LEN + 1)}, "kvflow_workflow"),
    ({"kvflow_agent": 5}, "kvflow_agent"),
    ({"kvflow_step": -1}, "kvflow_step"),
    ({"kvflow_step": "3"}, "kvflow_step"),
    ({"kvflow_ste": [1, 2]}, "kvflow_ste"),
    ({"kvflow_ste": {"a": -1}}, "kvflow_ste"),
    ({"kvflow_ste": {"a": "x"}}, "kvflow_ste"),
    ({"kvflow_ste": {"a": True}}, "kvflow_ste"),
    ({"kvflow_ste": {f"a{i}": 1 for i in range(2000)}}, "kvflow_ste"),
    ({"kvflow_next": "planner"}, "kvflow_next"),
    ({"kvflow_fixed_messages": -2}, "kvflow_fixed_messages"),
    ({"kvflow_event": "explode"}, "kvflow_event"),
])
def test_malformed_hints_name_the_bad_key(patch, key):
    cp = sample().to_custom_params()
    cp.update(patch)
    with pytest.raises(HintError) as e:
        Hints.from_custom_params(cp)
    assert e.value.key == key and key in str(e.value)


def test_values_are_clipped_not_trusted():
    cp = sample().to_custom_params()
    cp["kvflow_ste"] = {"a": 10**12, "b": float("inf"), "c": 2.0}
    cp["kvflow_step"] = 10**15
    h = Hints.from_custom_params(cp)
    assert h.ste == {"a": MAX_STE, "b": math.inf, "c": 2}
    assert h.step == 2**31 - 1
    cp["kvflow_future_field"] = {"x": 1}  # unknown v1 keys are ignored
    assert Hints.from_custom_params(cp) is not None


def test_schema_file_is_current():
    assert json.loads(SCHEMA_PATH.read_text()) == json_schema()


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
    max_size=8))
def test_fuzzed_custom_params_either_parse_or_raise_hint_error(params):
    params = dict(params)
    if params:
        params.setdefault("kvflow_v", 1)
    try:
        Hints.from_custom_params(params)
    except HintError:
        pass


# ---------------------------------------------------------------- the gateway-proof channel
def test_metadata_channel_round_trips_and_the_routing_key_fills_the_workflow():
    from kvflow_agents.protocol import METADATA_KEY

    body = {"metadata": {METADATA_KEY: sample().to_metadata_value(), "mine": "x"}}
    assert Hints.from_request(body) == sample()
    flat = {k: v for k, v in sample().to_custom_params().items() if k != "kvflow_workflow"}
    body = {"metadata": {METADATA_KEY: json.dumps(flat)}}
    assert Hints.from_request(body, {"x-smg-routing-key": "thread-7"}) == sample()
    with pytest.raises(HintError) as e:
        Hints.from_request(body)  # no workflow anywhere
    assert e.value.key == "kvflow_workflow"
    # custom_params wins over metadata; headers alone give workflow + agent
    other = sample().model_copy(update={"agent": "executor"})
    assert Hints.from_request({"custom_params": other.to_custom_params(),
                               "metadata": {METADATA_KEY: sample().to_metadata_value()}}) == other
    assert Hints.from_request({}, {"x-kvflow-workflow": "w", "x-kvflow-agent": "a"}) == Hints(workflow="w", agent="a")
    assert Hints.from_request({"metadata": {"other": "x"}}) is None


@pytest.mark.parametrize("value,reason", [
    (5, "JSON string"), ("{nope", "not valid JSON"), ("[1]", "JSON object"),
    ("x" * 9000, "longer than"),
])
def test_malformed_metadata_names_the_key(value, reason):
    with pytest.raises(HintError) as e:
        Hints.from_request({"metadata": {"kvflow": value}})
    assert e.value.key == "metadata.kvflow" and reason in e.value.reason


def test_a_large_ste_map_is_cut_to_the_nearest_agents_to_fit():
    from kvflow_agents.protocol import MAX_METADATA_CHARS

    big = Hints(workflow="w", agent="a0", ste={f"agent_with_a_long_name_{i:04d}": i for i in range(1000)})
    value = big.to_metadata_value()
    assert len(value) <= MAX_METADATA_CHARS
    got = Hints.from_request({"metadata": {"kvflow": value}})
    kept = sorted(got.ste.values())
    assert kept == list(range(len(kept))) and 100 < len(kept) < 1000  # the closest ones


def test_hint_only_completion_carries_the_event_in_both_channels():
    from kvflow_agents.protocol import hint_only_completion

    body = hint_only_completion(sample(), "end", "m")
    assert body["model"] == "m" and body["prompt"] == "" and body["max_tokens"] == 1
    assert Hints.from_custom_params(body["custom_params"]).event == "end"
    assert Hints.from_metadata(body["metadata"]).event == "end"
    with pytest.raises(ValueError):
        hint_only_completion(sample(), "explode")
