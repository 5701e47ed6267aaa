"""ChatTokenizer on the byte-level (tiny-random) tokenizer: fast, no model file needed."""

from kvflow_agents.serving.embedded.model.tokenizer import BYTE_VOCAB_SIZE, ChatTokenizer

MSGS = [{"role": "system", "content": "You are the planner."},
        {"role": "user", "content": "Plan a trip."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go on"}]


def test_byte_level_roundtrip_and_specials():
    tok = ChatTokenizer.byte_level()
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 259
    for s in ["hello", "héllo 🙂 12345", "  two  spaces\n\ttab", ""]:
        ids = tok.encode(s)
        assert len(ids) == len(s.encode())
        assert tok.decode(ids) == s
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 257 and ids[-1] == 258
    assert tok.eos_token_ids == {258, 256}
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chatml_and_fixed_prefix():
    tok = ChatTokenizer.byte_level()
    text = tok.apply_chat_template(MSGS)
    assert text.startswith("<|im_start|>system\nYou are the planner.<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nGo on<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(MSGS, add_generation_prompt=False).endswith("assistant\n")
    full = tok.encode_chat(MSGS)
    n = tok.fixed_prefix_tokens(MSGS, 1)
    sys_text = "<|im_start|>system\nYou are the planner.<|im_end|>\n"
    assert n == len(tok.encode(sys_text)) and full[:n] == tok.encode(sys_text)
    assert tok.fixed_prefix_tokens(MSGS, 1, full_ids=full) == n
    assert tok.fixed_prefix_tokens(MSGS, 0) == 0
    assert tok.fixed_prefix_tokens(MSGS, 99) <= len(full)
    parts = [{"role": "user",
              "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\nab<|im_end|>" in tok.apply_chat_template(parts)


def test_save_and_from_dir(tmp_path):
    tok = ChatTokenizer.byte_level()
    tok.save(tmp_path)
    tok2 = ChatTokenizer.from_dir(tmp_path)
    assert tok2.encode_chat(MSGS) == tok.encode_chat(MSGS)
    assert tok2.eos_token_ids == tok.eos_token_ids


def _stream_all(tok, text_ids, **kw):
    st = tok.stream(**kw)
    pieces = [st.push(i) for i in text_ids]
    pieces.append(st.finish())
    return st, pieces


def test_stream_never_splits_utf8():
    tok = ChatTokenizer.byte_level()
    ids = tok.encode("a🙂b")  # the emoji is 4 byte tokens
    st, pieces = _stream_all(tok, ids)
    assert "".join(pieces) == "a🙂b" and "\ufffd" not in "".join(pieces)
    assert pieces[:5] == ["a", "", "", "", "🙂"]
    assert not st.finished


def test_stream_stops_on_eos_and_strings():
    tok = ChatTokenizer.byte_level()
    st, pieces = _stream_all(tok, tok.encode("hello") + [258] + tok.encode("more"))
    assert "".join(pieces) == "hello" and st.finished and st.finish_reason == "stop"
    st, pieces = _stream_all(tok, tok.encode("one\nUSER: two"), stop=["\nUSER:"])
    assert "".join(pieces) == "one" and st.text == "one" and st.finished
    # a partial stop string is held back, then released when it turns out not to be one
    st = tok.stream(stop=["END"])
    out = [st.push(i) for i in tok.encode("xEN")]
    assert "".join(out) == "x"
    assert st.push(tok.encode("d")[0]) == "ENd"
    assert st.finish() == "" and not st.finished


def test_tools_render_in_the_system_block_and_history_in_hermes_layout():
    """Tools go in the (fixed, cacheable) system block; assistant calls and tool results render
    exactly as the grammar lets the model write them."""
    import json

    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.byte_level()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "tool", "tool_call_id": "c2", "content": "ok"}]
    text = tok.apply_chat_template(msgs, tools=tools)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(tools[0]) in system
    assert rest == ("<|im_start|>user\n1+2?<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                    "</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nok\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the fixed prefix (the system message) covers the tool listing
    ids = tok.encode_chat(msgs, tools=tools)
    n = tok.fixed_prefix_tokens(msgs, 1, ids, tools=tools)
    assert tok.decode(ids[:n], skip_special_tokens=False) == system + "<|im_end|>\n"
    # without tools, a plain conversation renders with the model's own template as before
    assert tok.apply_chat_template(msgs[:2]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"


def test_grammar_without_xgrammar_is_a_clear_error(monkeypatch):
    import sys

    import pytest

    from kvflow_agents.serving.embedded.grammar import GrammarError, spec_for_request

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(GrammarError, match="xgrammar"):
        spec_for_request(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
