#!/usr/bin/env bash
# Install sglang==0.5.23 (no CUDA) plus this project into a separate venv, for the SGLang
# plugin's CPU tests:   bash serving/sglang/install-cpu.sh [.venv-sglang]
# then:                 .venv-sglang/bin/pytest tests/sglang
#
# Idempotent: re-running it on a finished venv only re-checks (a stamp file skips the pip work
# unless this script or the constraints changed).
#
# Why not `pip install sglang==0.5.23`: its metadata pins torch==2.14.1 (CUDA), flashinfer,
# sglang-kernel (373 MB of CUDA .so), cutlass, deep-ep ... none usable without a GPU. We install
# the wheel with --no-deps and add only what `import sglang.srt.*` needs on CPU (the scheduler,
# the HTTP server, the unified radix cache, HiCache controller, SGLang's own test kit), with
# torch pinned to the CPU build by constraints-cpu.txt.
#
# torchvision is NOT installed: the PyPI torchvision wheels are CUDA builds that fail with CPU
# torch (`operator torchvision::nms does not exist`) and would drag a CUDA torch in. The few
# sglang modules that import it at module level only need the name; tv_shim.py (in this folder)
# provides an import-only stand-in, installed into the venv as a .pth hook (see below).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$HERE/constraints-cpu.txt"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"   # e.g. --index-url https://download.pytorch.org/whl/cpu

# The minimum sglang 0.5.23 needs to import its srt modules on CPU (found by importing
# scheduler / http_server / launch_server / unified_radix_cache / the test kit one by one).
SGLANG_CPU_DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm
  IPython aiohttp transformers dill apache-tvm-ffi triton sentencepiece compressed-tensors gguf
  openai partial_json_parser setproctitle einops uvicorn fastapi uvloop jsonschema xgrammar
  soundfile python-multipart prometheus-client scipy
  datasets  # only for sglang.test.test_utils (SGLang's radix cache test kit imports it)
)
# kvflow-agents' own core dependencies (pyproject [project].dependencies) + the test runner.
CORE_DEPS=("networkx>=3.2,<3.7" "httpx>=0.27" "pydantic>=2.6" "typer>=0.12" "rich>=13"
           "pytest>=8" "pytest-timeout>=2.3")

STAMP="$VENV/.kvflow-sglang-installed"
want="$(cat "$HERE/install-cpu.sh" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "import sglang, kvflow_agents" 2>/dev/null; then
  echo "install-cpu.sh: $VENV is up to date"
  exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -c "$CONSTRAINTS" "torch==2.13.0" $TORCH_PIP_ARGS
"${PIP[@]}" install -q -c "$CONSTRAINTS" --no-deps "sglang==0.5.23"
"${PIP[@]}" install -q -c "$CONSTRAINTS" "${SGLANG_CPU_DEPS[@]}" "${CORE_DEPS[@]}"
# (flock: the main venv's editable install, possibly running beside this one, writes the same
# egg-info into the checkout)
flock "$ROOT/.editable-install.lock" "${PIP[@]}" install -q --no-deps -e "$ROOT"

# The torchvision import shim, active in every interpreter of this venv (also SGLang's spawned
# scheduler processes): a .pth line runs at site initialisation.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$HERE/tv_shim.py" "$SITE/_kvflow_tv_shim.py"
echo "import _kvflow_tv_shim; _kvflow_tv_shim.install()" > "$SITE/_kvflow_tv_shim.pth"

# Fail here (not in the tests) if torch got replaced by a CUDA build.
"$VENV/bin/python" - <<'PY'
import torch, sglang
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"CUDA torch crept in: {torch.version.cuda}"
print("install-cpu.sh: torch", torch.__version__, "sglang", sglang.__version__)
PY
echo "$want" > "$STAMP"
