# One-command set-up: `make demo` and `make test` each create the virtualenv on a fresh clone.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench lint clean interop

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(VENV)/.base: $(PY) pyproject.toml requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -r requirements-dev.txt -e '.[test]'
	touch $@

# Optional interop tools: MosaicML Streaming in the venv, MLDataForge in its own Python 3.12 venv
# (.venv-mldf). Failure to install either is not fatal: its interop tests then skip with the reason.
# The test extras and Streaming install in one pip pass while MLDataForge's venv builds beside it (another
# venv: it only links .venv's CUDA libraries, there since .base); one after the other, the three passes took
# 62 s, 69 s and 52 s of a clean clone's install on 2 cores.
STREAMING := 'mosaicml-streaming==0.13.0' 'huggingface-hub<1.0'
$(VENV)/.interop: $(VENV)/.base
	timeout 600 bash tests/interop/setup_mldataforge.sh >$(VENV)/mldf-setup.log 2>&1 & mldf=$$!; \
	$(PIP) install -q -r requirements-dev.txt -e '.[test]' $(STREAMING) \
		|| { echo "mosaicml-streaming could not be installed: its interop tests will skip"; \
		     $(PIP) install -q -r requirements-dev.txt -e '.[test]'; } \
		|| { kill $$mldf; exit 1; }; \
	wait $$mldf || { cat $(VENV)/mldf-setup.log; \
		echo "MLDataForge's venv could not be built: its interop tests will skip"; }
	touch $(VENV)/.test $@

interop: $(VENV)/.interop

demo: $(VENV)/.base
	$(PY) -m torchforge.demo

# Two pytest-xdist workers: most tests wait on child processes, servers or timers, so two share 2 cores
# well (425 s here with two). Tests that run Streaming take a lock (its shared memory is machine-wide);
# tests of several gloo ranks start them from a fork server that imported torch once (tests/_forkserver.py).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.interop
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(VENV)/.interop
	$(PIP) install -q -r requirements-dev.txt -e '.[plots,bench]'
	$(PY) benchmarks/report.py

lint: $(VENV)/.test
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check torchforge tests benchmarks

clean:
	rm -rf $(VENV) .venv-mldf build *.egg-info .pytest_cache
