# Two entry points for a fresh machine:
#   make demo   sets everything up and runs the prebuilt router on a sample prompt (coloured output + demo.html)
#   make test   sets everything up and runs the test suite (what .ci/run calls)
# Both create .venv with a CPU build of torch (from the local wheel where one exists).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch --index-url https://download.pytorch.org/whl/cpu

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	touch $@

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e ".[bench]"
	touch $@

.PHONY: test demo
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q tests

demo: $(VENV)/.installed-demo
	$(BIN)/python -m benchmarks.demo
