# Every target sets itself up: a fresh clone needs only python3 (>= 3.10) and pip.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
EXTRAS ?= dev,triton,megatron,ray

.PHONY: setup test test-fast lint demo demo-ops demo-1m bench clean

$(STAMP): pyproject.toml requirements-cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The constraints file pins the CPU build of torch; pyproject leaves it open for GPU users.
	$(PY) -m pip install -q -c requirements-cpu.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" --timeout=900

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" --timeout=900 tests/test_ops.py

lint: $(STAMP)
	$(PY) -m ruff check .

demo: demo-ops

demo-ops: $(STAMP)
	$(PY) benchmarks/ops_demo.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
