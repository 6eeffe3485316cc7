# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv on first use. On a machine without a GPU the CPU build of torch is installed
# first, so that resolving the other dependencies never pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test clean

# One stamp per set of extras: `make demo` needs the core only, `make test` also verl (parity tests) and
# lm-eval (the bridge runs for real in a test).
$(VENV)/.stamp-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "torch>=2.4"; \
	 else $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e ".[$*]"
	@touch $@

demo: $(VENV)/.stamp-dev
	OMP_NUM_THREADS=1 $(BIN)/stare demo

test: $(VENV)/.stamp-dev,verl,lm-eval
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .stare-cache
