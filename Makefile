# Two entry points for a fresh machine:
#   make demo   sets everything up and runs the prebuilt router on a sample prompt (coloured output + demo.html)
#   make test   sets everything up and runs the whole test suite, one worker per core, and prints how long it took
#               (.ci/run runs exactly this from its clean clone)
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

.PHONY: test test-families demo
# One pytest worker per core (pytest-xdist), as CI runs the suite: on 2 cores about half the serial time. Ray's node
# start gives up after a fixed 30 s, too few beside other tests on 2 cores, so the Ray test runs alone afterwards.
# The family matrix's wide part (-m families_full: every family, variant and mixed pair) is `make test-families`.
# Each run lists its slowest tests (--durations): CI must stay under 20 minutes, and this shows where the time goes.
test: $(VENV)/.installed-test
	@echo "make test: the whole suite, one worker per core (pytest -n auto), then the Ray test alone"
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -n auto --durations=15 -m "not ray and not families_full" tests && $(BIN)/python -m pytest -q -m ray tests; \
	rc=$$?; took=$$(( $$(date +%s) - start )); \
	echo "make test: $$((took / 60)) min $$((took % 60)) s, $$([ $$rc = 0 ] && echo passed || echo FAILED)"; exit $$rc

# The family matrix in full: the pairs make test leaves to the marker (about 13 minutes of CPU).
test-families: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n auto --durations=10 -m families_full tests/test_model_families.py

demo: $(VENV)/.installed-demo
	$(BIN)/python -m benchmarks.demo
