# Two commands on a fresh machine: `make bench` (the main job) and `make test`.
# Both create the virtualenv on first use: PyTorch (TORCH_SPEC; `pip install torch==2.13.0` takes
# the CPU build where one lies on disk) and the newest Triton we test (TRITON_SPEC), as a new
# user gets them. `make test` also compiles the Hopper kernels for sm_90a under the oldest Triton
# we support (3.6, in .venv-triton36; its CPU interpreter needs numpy < 2.3).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
OLDEST_VENV ?= .venv-triton36
OLDEST_PY := $(OLDEST_VENV)/bin/python

.PHONY: bench test test-suite test-oldest-triton install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(OLDEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q "$(TORCH_SPEC)" "triton==3.6.0" "numpy<2.3" pytest pytest-timeout rich matplotlib
	$(OLDEST_PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

bench: $(VENV)/.installed
	$(PY) -m mok.bench

test: test-suite test-oldest-triton

test-suite: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# The sm_90a compile checks (register and spill counts, the Gluon probe) under Triton 3.6.
test-oldest-triton: $(OLDEST_VENV)/.installed
	TRITON_INTERPRET=1 $(OLDEST_PY) -m pytest -q tests/kernels/test_warp_specialized.py tests/kernels/test_gluon_api.py \
		tests/kernels/test_grouped_gemm.py \
		-k "compile or probe"

clean:
	rm -rf $(VENV) $(OLDEST_VENV)
