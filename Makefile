# Two commands on a fresh machine:  `make bench` (the main job) and `make test`.
# Both create the virtualenv on first use. Versions match the H200 image's Triton (3.6.0);
# its CPU interpreter needs numpy < 2.3. `pip install torch==2.13.0` takes the CPU build
# where one lies on disk.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: bench test install clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" "triton==3.6.0" "numpy<2.3"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

bench: $(VENV)/.installed
	$(PY) -m mok.bench

test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV)
