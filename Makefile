# The two commands of the README: `make demo` (install + serve the default model on CPU and
# send it a real request) and `make test` (install + every test CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-gpu lint demo generate clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# the CPU wheel first, so the project's torch range is already met (no CUDA download)
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.4,<2.15"
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check splitflash tests bench
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

# On a CUDA machine: the bf16 kernel tests and CUDA-graph tests, compiled for the real GPU
# (make test runs the kernels in the interpreter, where these skip). Uses the current python.
test-gpu:
	$(PY) -m pytest -q -m gpu tests/unit

lint: $(STAMP)
	$(BIN)/ruff check splitflash tests bench
	$(BIN)/ruff format --check splitflash tests bench

generate: $(STAMP)
	$(BIN)/splitflash models pull smollm2-135m
	$(BIN)/splitflash generate "Write three short sentences about the sea. Repeat them twice."

demo: $(STAMP)
	$(BIN)/splitflash models pull smollm2-135m
	$(BIN)/splitflash up --device cpu --demo

clean:
	rm -rf $(VENV) .pytest_cache
