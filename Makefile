# make test / make demo work on a fresh machine: they create .venv when missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.torchtp-installed

.PHONY: test test-all demo lint bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins torch==2.13.0 (CPU build) so pip never pulls CUDA wheels.
	$(PY) -m pip install -q -c constraints.txt -e ".[hf,test,dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks launch
	$(PY) -m mypy --warn-unused-ignores src/distributed

# make test skips tests marked slow (long matrices); make test-all runs them too.
test: lint
	$(PY) -m pytest tests -q -p no:cacheprovider -m "not slow"

test-all: lint
	$(PY) -m pytest tests -q -p no:cacheprovider

demo: $(STAMP)
	$(VENV)/bin/torchtp demo

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
