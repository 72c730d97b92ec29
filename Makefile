# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv, installs torch first (CPU build from the local wheel when
# TORCH=torch==2.13.0, the default) and then the project with its extras.
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m opencann.cli demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) bench/models.py

clean:
	rm -rf $(VENV) build *.egg-info
