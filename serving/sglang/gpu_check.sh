#!/usr/bin/env bash
# Prepare the SGLang GPU proof (serving/sglang/gpu_check.py): run HERE, on a machine with
# network, from the repository root. The GPU machine has CUDA PyTorch, transformers, triton,
# numpy, httpx, networkx, matplotlib, rich, typer ... but no network and not sglang or its
# pure-Python serving stack: this puts in .whl/ (git-ignored) the sglang 0.5.23 cp312 wheel
# (~39 MB, installed --no-deps: no sgl_kernel, no flashinfer, no CUDA torch pin), the packages
# SGLang imports that the GPU image lacks (cp312 manylinux wheels), and this project's wheel.
# Everything that travels with a device command must stay under 64 MiB: checked below.
#
#   bash serving/sglang/gpu_check.sh            # builds .whl/, prints its size
# then, through the device tool (`run`, carry [".whl"], timeout 560):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site KVFLOW_SGLANG_SHIMS_DIR=$PWD/tests/sglang/support PYTHONUNBUFFERED=1 \
#     && timeout 540 python3 -m kvflow_agents.serving.sglang.gpu_check --out $OUT 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE="$(git rev-parse --git-path info/exclude)"   # also right in a git worktree
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx "/.whl/" "$EXCLUDE" 2>/dev/null || echo "/.whl/" >> "$EXCLUDE"
rm -rf .whl && mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
PLAT=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
CONSTRAINTS=serving/sglang/constraints-cpu.txt
pin() { grep -i "^$1==" "$CONSTRAINTS" | head -1 || true; }
# What `import sglang.srt.*` + `sglang.launch_server` need (the CPU venv's list, see
# install-cpu.sh) minus what the GPU image already has; versions pinned as in the CPU venv.
CARRY=(orjson pybase64 msgspec pyzmq setproctitle partial-json-parser python-multipart
       fastapi starlette annotated-doc uvicorn pydantic pydantic_core annotated-types typing-inspection
       openai jiter distro dill multiprocess gguf compressed-tensors apache-tvm-ffi xgrammar
       jsonschema jsonschema-specifications referencing rpds-py soundfile loguru
       ipython ipython_pygments_lexers traitlets jedi parso prompt_toolkit pexpect ptyprocess
       decorator matplotlib-inline stack-data asttokens executing pure_eval wcwidth)
SPECS=("sglang==0.5.23")
for p in "${CARRY[@]}"; do
  s=$(pin "$p"); SPECS+=("${s:-$p}")
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl "${SPECS[@]}"
$PY -m pip wheel -q --no-deps --no-build-isolation -w .whl .
ls -la .whl | awk '{s+=$5} END {printf "total %.1f MiB\n", s/1048576}'
total=$(du -sb .whl | cut -f1)
if (( total > 60 * 1024 * 1024 )); then
  echo "gpu_check.sh: .whl is $((total / 1048576)) MiB; a device command carries at most 64 MiB" >&2
  exit 1
fi
