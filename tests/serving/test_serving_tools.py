"""Tool calls, structured output, penalties, logit bias, logprobs and n over real HTTP, with the
real ``openai`` client, against the embedded server running the tiny random model.

A random model is the strict test of grammar-constrained decoding: whatever it prefers, the
output must be a valid call / valid JSON for the schema, because the mask allows nothing else."""

from __future__ import annotations

import json

import openai
import pytest

from kvflow_agents.serving.embedded.tool_calls import ToolCallStream, parse_tool_calls

pytest.importorskip("xgrammar")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two digits",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
MSGS = [{"role": "system", "content": "You are a tool-using assistant."},
        {"role": "user", "content": "What is 3 plus 4?"}]


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args in ({"city": "Paris"}, {"city": "Rome"})
    else:
        assert call.function.name == "add" and set(args) == {"a", "b"}
        assert all(isinstance(v, int) and 0 <= v <= 9 for v in args.values())
    return args


def test_tool_choice_required_named_and_none(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="required",
                                      temperature=0, max_tokens=120, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        check_call(ch.message.tool_calls[0])
        assert not ch.message.content
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = r.choices[0].message.tool_calls
        assert [t.function.name for t in calls] == ["get_weather"] and r.choices[0].finish_reason == "tool_calls"
        check_call(calls[0])
        # parallel calls allowed (the default): every one of them is valid
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="required",
                                      temperature=0.8, seed=3, max_tokens=200)
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        for t in r.choices[0].message.tool_calls or []:
            check_call(t)
        # "none": tools stay in the prompt, no call parsed, and the call marker is banned
        bias = {str(i): 40 for i in srv.engine.tokenizer.encode("<tool_call>")}
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="none",
                                      temperature=0, max_tokens=24, logit_bias=bias)
        text = r.choices[0].message.content
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
        assert "<tool_call" not in text and "<tool_response" not in text
        from kvflow_agents.serving.embedded.grammar import spec_for_request

        backend = srv.engine.grammar
        ban = backend.compile(spec_for_request(tools=TOOLS, tool_choice="none"))
        assert backend.matcher(ban).accept_string("The answer is 7.")
        for bad in ("Sure <tool_call>", "<tool_response>7"):
            assert not backend.matcher(ban).accept_string(bad)


def test_tool_calls_stream_in_openai_delta_shape(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        whole = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=120, parallel_tool_calls=False)
        chunks = list(c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="required",
                                                temperature=0, max_tokens=120, parallel_tool_calls=False,
                                                stream=True))
        calls: dict[int, dict] = {}
        finish = None
        for ch in chunks:
            for choice in ch.choices:
                for d in choice.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = d.id or slot["id"]
                    if d.function is not None:
                        slot["name"] += d.function.name or ""
                        slot["arguments"] += d.function.arguments or ""
                assert not (choice.delta.content or "").strip()  # nothing but the call
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1
        want = whole.choices[0].message.tool_calls[0]
        assert calls[0]["name"] == want.function.name and calls[0]["arguments"] == want.function.arguments
        assert calls[0]["id"].startswith("call_")


def test_tool_history_and_tools_are_the_cached_prefix(serve):
    """Tools render into the system block: an agent's next turn (assistant call + tool result)
    reuses the whole block from the cache."""
    with serve(policy="lru", device_tokens=8192) as srv:
        c = srv.client()
        r1 = c.chat.completions.create(model="tiny-random", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=120, parallel_tool_calls=False)
        call = r1.choices[0].message.tool_calls[0]
        history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r2 = c.chat.completions.create(model="tiny-random", messages=history, tools=TOOLS, temperature=0, max_tokens=4)
        assert r2.choices[0].finish_reason in ("stop", "length")
        tools_block = len(srv.engine.tokenizer.encode_chat(MSGS[:1], add_generation_prompt=False, tools=TOOLS))
        assert tools_block > 300  # the tool listing is in it
        assert r2.usage.prompt_tokens_details.cached_tokens >= tools_block - 16


def test_response_format_json_schema_and_json_object(serve):
    schema = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["PASS", "FAIL"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["verdict", "score"], "additionalProperties": False}
    with serve(policy="lru") as srv:
        c = srv.client()
        for seed in (1, 2):
            r = c.chat.completions.create(model="tiny-random", messages=MSGS, temperature=0.7, seed=seed, max_tokens=60,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "review", "schema": schema,
                                                                           "strict": True}})
            doc = json.loads(r.choices[0].message.content)
            assert doc["verdict"] in ("PASS", "FAIL") and 0 <= doc["score"] <= 100 and set(doc) == {"verdict", "score"}
            assert r.choices[0].finish_reason == "stop"
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, temperature=0, max_tokens=200,
                                      response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=4,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": {"type": "nope"}}})
        assert ei.value.status_code == 400


def test_logit_bias_over_http_and_penalty_arithmetic(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        for ch in "AB":
            r = c.completions.create(model="tiny-random", prompt="x", max_tokens=4, temperature=0,
                                     logit_bias={str(ord(ch)): 100}, extra_body={"ignore_eos": True})
            assert r.choices[0].text == ch * 4
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=4, temperature=0, presence_penalty=1.5,
                                      frequency_penalty=-0.5, extra_body={"repetition_penalty": 1.2})
        assert r.choices[0].finish_reason in ("stop", "length")


def test_penalties_follow_openai_and_vllm_formulas():
    """The sampler's logits processing on a hand-made row: frequency x count and presence once
    per output token; repetition over prompt + output (divide positives, multiply negatives);
    then the bias."""
    import torch

    from kvflow_agents.serving.embedded.sampling import BatchSampler
    from kvflow_agents.serving.embedded.scheduler import Request, SamplingParams

    logits = torch.tensor([[2.0, 2.0, -2.0, 1.0, 0.5]])
    req = Request([4], SamplingParams(max_tokens=8, frequency_penalty=0.5, presence_penalty=0.25,
                                      repetition_penalty=2.0, logit_bias={3: 10.0}), lambda ev: None)
    req.output_ids = [0, 0, 2]
    BatchSampler()._penalize(logits[0], req)
    want = [2.0 / 2 - (0.5 * 2 + 0.25), 2.0, -2.0 * 2 - (0.5 + 0.25), 1.0 + 10, 0.5 / 2]
    assert logits[0].tolist() == pytest.approx(want)
    gen = torch.Generator().manual_seed(0)
    req.generator = gen
    tok, lp = BatchSampler().sample(torch.tensor([0.0, 1.0, 3.0, -1.0, 0.0]),
                                    [Request([4], SamplingParams(max_tokens=2, logprobs=True, top_logprobs=2),
                                             lambda ev: None, generator=gen)])[0]
    assert tok == 2 and lp.token_id == 2 and [t for t, _ in lp.top] == [2, 1]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([0.0, 1.0, 3.0, -1.0, 0.0]), -1)[2]))


def test_logprobs_chat_and_completions(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, temperature=0, max_tokens=5, logprobs=True,
                                      top_logprobs=3, extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 5
        for e in content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 3
            assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the top one
            assert e.bytes == list(e.token.encode("utf-8"))
        r = c.completions.create(model="tiny-random", prompt="hello", temperature=0, max_tokens=4, logprobs=2,
                                 extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset)
        chunks = list(c.chat.completions.create(model="tiny-random", messages=MSGS, temperature=0, max_tokens=4,
                                                logprobs=True, stream=True, extra_body={"ignore_eos": True}))
        streamed = [e for ch in chunks for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
        assert len(streamed) == 4


def test_n_choices_share_the_prompt(serve):
    with serve(policy="lru") as srv:
        c = srv.client()
        r = c.chat.completions.create(model="tiny-random", messages=MSGS, n=3, temperature=1.0, seed=7, max_tokens=6,
                                      extra_body={"ignore_eos": True})
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert len({ch.message.content for ch in r.choices}) > 1
        one = c.chat.completions.create(model="tiny-random", messages=MSGS, max_tokens=6, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 18
        assert r.choices[0].message.content == one.choices[0].message.content  # choice i uses seed + i
        chunks = list(c.chat.completions.create(model="tiny-random", messages=MSGS, n=2, temperature=1.0, max_tokens=3,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
        assert finished == {0, 1} and chunks[-1].usage.completion_tokens == 6


# ------------------------------------------------------------------ the parsers, directly
def test_parse_tool_calls_text_and_blocks():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ["add", "get_weather"])
    assert content == "Let me check." and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    # an unknown function or broken JSON stays text; an unterminated block is text
    for bad in ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', '<tool_call>{oops</tool_call>',
                '<tool_call>\n{"name": "add", "arguments": {"a": 1'):
        assert parse_tool_calls(bad, ["add"]) == (bad, [])


def test_tool_call_stream_splits_anywhere():
    text = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> bye <tool'
    for step in (1, 3, 7, len(text)):
        s = ToolCallStream(["add"])
        out = []
        for i in range(0, len(text), step):
            out += s.push(text[i:i + step])
        out += s.finish()
        content = "".join(d.get("content", "") for d in out)
        calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
        assert content == "Hi  bye <tool" and len(calls) == 1, (step, out)
        assert calls[0]["index"] == 0 and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
