"""``kvflow bench workflow --engine sglang``: what each policy's SGLang server is started with,
the model folder it serves, the counters read back, the sglext per-tier hits, the CLI's
errors, and the GPU proof's model. (The servers themselves run in tests/sglang_server.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvflow_agents.bench import sglang_engine as se
from kvflow_agents.bench.workload import CallRecord, _sglext_fields
from kvflow_agents.cli.main import app


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_policies_differ_only_in_the_cache(tmp_path):
    launch = se.SGLangLaunch(model_path=str(tmp_path), python="py", device="cpu",
                             max_total_tokens=4096, host_ratio=3.0, page_size=16,
                             host_link_gbps=0.5, lookahead=1, extra=["--sleep-on-idle"])
    argv = {p: launch.argv(p) for p in se.POLICIES}
    env = {p: launch.environ(p) for p in se.POLICIES}
    common = {"--model-path": str(tmp_path), "--max-total-tokens": "4096", "--page-size": "16",
              "--attention-backend": "torch_native", "--device": "cpu"}
    for p in se.POLICIES:
        for k, v in common.items():
            assert _flag(argv[p], k) == v, (p, k)
        assert env[p]["KVFLOW_SGLANG_SHIMS"] == "cpu"
        assert env[p]["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"
    assert "--enable-hierarchical-cache" not in argv["lru"] and "KVFLOW_HOST_LINK_GBPS" not in env["lru"]
    for p in ("hicache", "kvflow"):
        assert "--enable-hierarchical-cache" in argv[p] and _flag(argv[p], "--hicache-ratio") == "3"
        assert env[p]["KVFLOW_HOST_LINK_GBPS"] == "0.5"   # the same emulated link for both
    assert _flag(argv["kvflow"], "--radix-cache-backend") == "kvflow"
    assert _flag(argv["kvflow"], "--radix-eviction-policy") == "kvflow"
    assert "--radix-cache-backend" not in argv["hicache"]
    with pytest.raises(ValueError):
        launch.argv("fifo")


def test_oracle_is_stock_sglang_with_a_pool_that_holds_everything(tmp_path):
    launch = se.SGLangLaunch(model_path=str(tmp_path), python="py", max_total_tokens=1024)
    cfg = se.SGLangServerConfig(launch=launch, oracle_tokens=65536)
    assert _flag(cfg.args("oracle"), "--max-total-tokens") == "65536"
    assert "--enable-hierarchical-cache" not in cfg.args("oracle")
    assert _flag(cfg.args("lru"), "--max-total-tokens") == "1024"
    assert cfg.model == str(tmp_path) and cfg.request_extra == {"return_cached_tokens_details": True}
    shown = " ".join(cfg.display_argv("kvflow"))
    assert "sglang.launch_server" in shown and "--radix-cache-backend kvflow" in shown


def test_tiny_model_folder_is_a_loadable_llama(tmp_path):
    import torch
    from safetensors.torch import load_file

    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    spec = se.TinyLlamaSpec(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    d = se.write_tiny_llama(tmp_path / "m", spec)
    cfg = json.loads((d / "config.json").read_text())
    tok = ChatTokenizer.from_dir(d)
    assert cfg["vocab_size"] == tok.vocab_size == 259
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"]) == (64, 2, 4, 2)
    w = load_file(str(d / "model.safetensors"))
    assert w["model.embed_tokens.weight"].shape == (259, 64)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert se.model_kv_bytes_per_token(str(d)) == 2 * 2 * 2 * 16 * 2
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert se.write_tiny_llama(d, spec) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime


def test_per_tier_hits_from_sglang_answers():
    rec = CallRecord(workflow=0, round=0, agent="a", step=0, measured=True, start=0, ttft_s=0,
                     latency_s=0)
    _sglext_fields(rec, {"sglext": {"cached_tokens_details": {"device": 700, "host": 300}}})
    assert (rec.device_hit_tokens, rec.host_hit_tokens) == (700, 300)
    _sglext_fields(rec, {"choices": []})               # a chunk without it changes nothing
    assert (rec.device_hit_tokens, rec.host_hit_tokens) == (700, 300)


def test_cli_engine_errors(tmp_path, monkeypatch):
    r = CliRunner().invoke(app, ["bench", "workflow", "--engine", "vllm", "--host-link-gbps", "1"])
    assert r.exit_code != 0 and "embedded or sglang" in r.output
    monkeypatch.setattr(se, "default_sglang_python", lambda: None)
    monkeypatch.delenv("KVFLOW_SGLANG_PYTHON", raising=False)
    r = CliRunner().invoke(app, ["bench", "workflow", "--engine", "sglang", "--agents", "2",
                                 "--fixed", "64", "--host-link-gbps", "1", "--no-progress"])
    assert r.exit_code == 2 and "--sglang-python" in r.output
    r = CliRunner().invoke(app, ["bench", "workflow", "--engine", "sglang", "--agents", "2",
                                 "--fixed", "64", "--host-link-gbps", "1", "--no-progress",
                                 "--sglang-python", "py", "--model", "smollm2-135m"])
    assert r.exit_code == 2 and "--model-path" in r.output


def test_gpu_proof_model_has_llama_31_8b_shape(tmp_path):
    from kvflow_agents.serving.sglang.gpu_check import write_model

    d = write_model(tmp_path / "m", "llama-3.1-8b")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (32, 4096, 32, 8, 14336)
    assert se.model_kv_bytes_per_token(str(d)) == 128 * 1024      # 128 KiB of KV per token
    assert not (d / "model.safetensors").exists()                 # --load-format dummy
