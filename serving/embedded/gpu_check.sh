#!/usr/bin/env bash
# Prepare and describe the GPU check (issue 8): run HERE, on the dev machine, from the repo root.
# The GPU machine has CUDA PyTorch, networkx, numpy, jinja2, tokenizers, safetensors, but no
# network and no pydantic: this carries pydantic and our own wheel in .whl/ (git-ignored).
#
#   bash serving/embedded/gpu_check.sh          # builds .whl/
# then, through the device tool (`run`, carry [".whl"], timeout 540):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 -m kvflow_agents.serving.embedded.gpu_check \
#        --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
PLAT=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d .whl "pydantic==$($PY -c "import pydantic; print(pydantic.VERSION)")"
rm -f .whl/typing_extensions-*.whl   # the GPU machine has its own; do not shadow it
$PY -m pip wheel -q --no-deps --no-build-isolation -w .whl .
ls -la .whl
