# Each target sets up what it needs on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: test demo bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo,onnx]'
	touch $(STAMP)

venv: $(STAMP)

# The suite mostly waits (broker group joins, worker restarts): more processes than CI's two cores.
TEST_PROCESSES ?= 4

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) tests

demo: $(STAMP)
	$(PY) -m gnnstream.fraud.demo

bench: $(STAMP)
	$(PY) -m bench.store
	$(PY) -m bench.backfill
	$(PY) -m bench.engine

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
