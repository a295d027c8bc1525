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
# (.venv-mldf). Failure to install is not fatal: the interop tests then skip with the reason.
$(VENV)/.interop: $(VENV)/.test
	-$(PIP) install -q -r requirements-dev.txt 'mosaicml-streaming==0.13.0' 'huggingface-hub<1.0' \
		|| echo "mosaicml-streaming could not be installed: its interop tests will skip"
	-timeout 600 bash tests/interop/setup_mldataforge.sh \
		|| echo "MLDataForge's venv could not be built: its interop tests will skip"
	touch $@

interop: $(VENV)/.interop

demo: $(VENV)/.base
	$(PY) -m torchforge.demo

test: $(VENV)/.interop
	$(PY) -m pytest -q

bench: $(VENV)/.interop
	$(PIP) install -q -r requirements-dev.txt -e '.[plots,bench]'
	$(PY) benchmarks/report.py

lint: $(VENV)/.test
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check torchforge tests benchmarks

clean:
	rm -rf $(VENV) .venv-mldf build *.egg-info .pytest_cache
