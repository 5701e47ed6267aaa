"""The prepared GPU proof for the SGLang plugin: stock SGLang vs SGLang + plugin on CUDA.

NOT YET RUN ON A GPU (the task that wrote it had no GPU machine); a CPU dry run with tiny
shapes exercises everything but the CUDA-specific parts (see below and the README).

    # on a machine lent with one GPU, from the repository root (see gpu_check.sh):
    python3 -m kvflow_agents.serving.sglang.gpu_check --out $OUT
    # the dry run here (tiny shapes, CPU, minutes):
    python -m kvflow_agents.serving.sglang.gpu_check --device cpu --shape tiny --agents 4 \\
        --fixed 256 --rounds 1 --sglang-python .venv-sglang/bin/python --out /tmp/gpu-dry

What runs: stock ``sglang==0.5.23``'s real server, once per policy, one after the other (GPU
memory for one 8B model at a time): ``lru`` (radix cache), ``hicache`` (+ host tier, demand
load-back), ``kvflow`` (+ the plugin), each on the same model and pool sizes; the paper's
10-agent cycle (fixed prompts of ``--fixed`` tokens, 40% of them fit in the device KV pool)
through SGLang's OpenAI API with hints v1 (``kvflow_agents.bench`` runner: warm-up round,
then measured rounds). After each policy the table so far is written as JSON and PNG, so a
time-out still leaves results.

On CUDA, with ``sgl_kernel`` absent (the wheel is 373 MB of CUDA code; the machine has no
network), through SGLang's own torch paths: ``--attention-backend torch_native``, fused ops on
``forward_native`` (``SGLANG_FORCE_FUSED_OP_BACKEND=torch``), ``--sampling-backend pytorch``,
HiCache's ``direct`` io backend with a torch ``transfer_kv_direct`` (real pinned-host -> GPU
copies over PCIe on SGLang's copy stream), CUDA graphs off, the overlap scheduler on (SGLang's
default). All of that is set up by ``tests/sglang/support/sglang_shims.py``
(``KVFLOW_SGLANG_SHIMS=cuda``). The model is a random-weight decoder of Llama-3.1-8B's shape
(32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336: 128 KiB of KV per token) with the
byte-level tokenizer of the embedded engine's tiny-random preset (its 259-id vocabulary is the
model's, so 1 ASCII character = 1 token and the workload's lengths are exact);
``--load-format dummy`` makes SGLang initialise the weights on the GPU (no 16 GB file).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

POLICIES = ("lru", "hicache", "kvflow")

SHAPES = {
    # Llama-3.1-8B's decoder; vocabulary = the byte-level tokenizer's
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                         rope_theta=500000.0),
    # the dry run's
    "tiny": dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, rope_theta=10000.0),
}


def write_model(out_dir: Path, shape: str) -> Path:
    """``config.json`` + tokenizer files (weights: SGLang's ``--load-format dummy``)."""
    from kvflow_agents.serving.embedded.model.config import LlamaConfig, config_to_hf
    from kvflow_agents.serving.embedded.model.tokenizer import ChatTokenizer

    s = SHAPES[shape]
    tok = ChatTokenizer.byte_level()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(out_dir)
    tcfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    tcfg.update({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                 "model_max_length": 131072, "pad_token": tcfg.get("eos_token")})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    cfg = LlamaConfig(name=f"{shape}-shape", num_layers=s["layers"], hidden=s["hidden"],
                      num_heads=s["heads"], num_kv_heads=s["kv_heads"],
                      head_dim=s["hidden"] // s["heads"], intermediate=s["intermediate"],
                      vocab_size=tok.vocab_size, rope_theta=s["rope_theta"], max_position=32768,
                      tie_embeddings=False)
    hf = config_to_hf(cfg)
    eos = sorted(tok.eos_token_ids)
    hf["eos_token_id"] = eos
    (out_dir / "config.json").write_text(json.dumps(hf, indent=1))
    return out_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvflow_agents.serving.sglang.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json / .png / server logs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=tuple(SHAPES), default=None,
                   help="model shape (default: llama-3.1-8b on cuda, tiny on cpu)")
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--fixed", type=int, nargs="+", default=[4096],
                   help="fixed prompt tokens per agent; several values = several runs")
    p.add_argument("--dynamic", type=int, default=32)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device-fraction", type=float, default=0.4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sglang-python", default=None,
                   help="the python that has sglang (default: this one)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from kvflow_agents.bench import report, stats
    from kvflow_agents.bench.report_plot import plot
    from kvflow_agents.bench.runner import run_workflow_bench
    from kvflow_agents.bench.sglang_engine import (SGLangLaunch, SGLangServerConfig,
                                                   model_kv_bytes_per_token)
    from kvflow_agents.bench.workload import (ByteLevelCounter, WorkloadSpec,
                                              fixed_prompt_tokens, request_tokens)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("llama-3.1-8b" if args.device == "cuda" else "tiny")
    model_dir = write_model(Path(tempfile.gettempdir()) / f"kvflow-gpu-check-{shape}", shape)
    policies = [p for p in args.policies.split(",") if p]
    counter = ByteLevelCounter()
    doc: dict = {"check": "sglang gpu_check", "device": args.device, "shape": shape,
                 "model_dir": str(model_dir), "kv_bytes_per_token": model_kv_bytes_per_token(str(model_dir)),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": []}
    if args.device == "cuda":
        try:
            import torch

            doc["gpu"] = torch.cuda.get_device_name(0)
            doc["torch"] = torch.__version__
        except Exception as e:  # noqa: BLE001
            doc["gpu"] = f"unavailable: {e}"

    def flush() -> None:
        (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))

    for fixed in args.fixed:
        spec = WorkloadSpec(agents=args.agents, fixed=fixed, dynamic=args.dynamic, output=args.output,
                            rounds=args.rounds, warmup_rounds=args.warmup, workflows=1)
        total = fixed_prompt_tokens(spec, counter)
        ps = args.page_size
        need = -(-request_tokens(spec) // ps) * ps + ps
        dev = max(-(-int(args.device_fraction * total) // ps) * ps, need)
        launch = SGLangLaunch(model_path=str(model_dir), python=args.sglang_python or sys.executable,
                              device=args.device, max_total_tokens=dev,
                              host_ratio=max(1.0, 2.0 * total / dev), page_size=ps, lookahead=1,
                              extra=["--load-format", "dummy", "--sleep-on-idle"],
                              startup_timeout_s=args.startup_timeout)
        config = SGLangServerConfig(launch=launch, oracle_tokens=4 * total)
        run = {"fixed": fixed, "agents": args.agents, "device_tokens": dev,
               "fixed_prompt_tokens_total": total, "policies": {}, "errors": {}}
        doc["runs"].append(run)
        results = []
        for pol in policies:
            t0 = time.perf_counter()
            print(f"[{fixed} tokens] {pol}: starting", flush=True)
            try:
                res = run_workflow_bench(spec, [pol], config, counter=counter, trials=1,
                                         log=lambda s: print(s, flush=True))
            except Exception as e:  # noqa: BLE001 - keep what the other policies measured
                run["errors"][pol] = f"{type(e).__name__}: {e}"[-4000:]
                print(f"[{fixed} tokens] {pol}: FAILED {run['errors'][pol][:400]}", flush=True)
                flush()
                continue
            results.extend(res)
            run["policies"][pol] = res[0].as_dict()
            run["ratios"] = stats.ratios(results)
            run["wall_s"] = run.get("wall_s", 0.0) + time.perf_counter() - t0
            flush()
            plot(results, str(out / f"gpu_check_{fixed}.png"),
                 title=f"SGLang 0.5.23 on {doc.get('gpu', args.device)}: {args.agents}-agent "
                       f"cycle, {fixed}-token prompts, {shape} shape")
            print(report.plain_table(results), flush=True)
    flush()
    return 0 if all(not r["errors"] for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
